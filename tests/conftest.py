"""Shared fixtures: rank runners, created once per world size per session."""

from __future__ import annotations

import pytest

from shardplan.ranks import RealRanks, SimulatedRanks


@pytest.fixture(scope="session")
def real_ranks():
    """``real_ranks(n)``: a cached ``RealRanks(n)`` pool; spawn cost is paid once.

    Tests that break the pool (timeouts, dead ranks) should make their own:
    a broken cached pool respawns on its next run, costing a second spawn.
    """
    pools: dict[int, RealRanks] = {}

    def get(n: int) -> RealRanks:
        if n not in pools:
            pools[n] = RealRanks(n)
        return pools[n]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def sim_ranks():
    """``sim_ranks(n)``: a ``SimulatedRanks(n)`` (threads; nothing to cache but symmetry)."""
    return SimulatedRanks
