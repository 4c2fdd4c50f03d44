"""Shared fixtures: rank runners, created once per world size per session."""

from __future__ import annotations

import concurrent.futures

import pytest

from shardplan.planner.shared_capture import CaptureShare, sharing
from shardplan.ranks import RealRanks, SimulatedRanks


@pytest.fixture(scope="session", autouse=True)
def shared_captures():
    """The session's captures in this process are shared by key (``CaptureShare``): a
    model of the same structure called the same way is exported once. The tests change
    no model code between captures; those that check capturing itself open their own
    ``sharing`` scope."""
    with sharing(CaptureShare()) as share:
        yield share


@pytest.fixture(scope="session")
def real_ranks():
    """``real_ranks(n)``: a cached ``RealRanks(n)`` pool; spawn cost is paid once, and
    each worker keeps its captures for the session (the tests change no model code).

    Tests that break the pool (timeouts, dead ranks) should make their own:
    a broken cached pool respawns on its next run, costing a second spawn.
    """
    pools: dict[int, RealRanks] = {}

    def get(n: int) -> RealRanks:
        if n not in pools:
            pools[n] = RealRanks(n, keep_captures=True)
        return pools[n]

    yield get
    with concurrent.futures.ThreadPoolExecutor() as closing:  # each close waits on its workers
        list(closing.map(RealRanks.close, pools.values()))


@pytest.fixture(scope="session")
def sim_ranks():
    """``sim_ranks(n)``: a ``SimulatedRanks(n)`` (threads; nothing to cache but symmetry)."""
    return SimulatedRanks
