"""Bundled rule sets: data files read with importlib.resources (package data of shardplan.rules)."""
