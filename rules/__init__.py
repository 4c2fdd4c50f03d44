"""Bundled rule sets: data files read with importlib.resources (rules/ = shardplan.rules)."""
