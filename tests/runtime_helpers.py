"""Shared pieces of the runtime tests: hypothesis settings, comparison, ledger digest."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=20, deadline=None)
TP = st.sampled_from([1, 2, 4, 8])
DIM = st.integers(1, 4)
SEED = st.integers(0, 2**31 - 1)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def comm(ledger) -> list[tuple]:
    """(kind, direction, elements) of every recorded collective, in order."""
    return [(r.kind, r.direction, r.elements) for r in ledger.records]


def assert_mlp_matches(results, ref, tp: int, elements: int) -> None:
    """Column -> GELU -> row MLP on every rank vs the unsharded one: values, input
    gradient, each shard's weight/bias gradient, and exactly one f and one g."""
    ref_y, ref_dx, ref_g = ref
    for rank, (y, dx, g1, g2, records) in enumerate(results):
        close(y, ref_y)
        close(dx, ref_dx)
        close(g1["weight"], ref_g["0.weight"].chunk(tp, 0)[rank])
        close(g1["bias"], ref_g["0.bias"].chunk(tp, 0)[rank])
        close(g2["weight"], ref_g["2.weight"].chunk(tp, 1)[rank])
        close(g2["bias"], ref_g["2.bias"])
        assert records == [("all_reduce", "forward", elements),
                           ("all_reduce", "backward", elements)]
