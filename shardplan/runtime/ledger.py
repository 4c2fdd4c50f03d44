"""The communication ledger: a record of every collective (and point-to-point
transfer) the runtime issues.

    with CommLedger() as ledger:
        loss = model(x).sum(); loss.backward()
    ledger.count(kind="all_reduce", direction="forward")

Ledgers are per thread, so each simulated rank keeps its own.

Compiled graphs run no Python per collective. There the mappings call
``traced`` instead, once per collective of either direction in the forward:
an op in the graph (it never breaks it) that records when a ledger listens,
so a compiled call records the same collectives as an eager one, those of
the backward at forward time.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx

from ..torch_compat import current_graph_task_id

_local = threading.local()


@dataclass(frozen=True)
class CommRecord:
    """One collective or point-to-point transfer as one rank saw it.

    ``elements`` is the logical size of the collective: the reduced tensor for
    an all-reduce, the gathered (full) tensor for an all-gather, the input
    (full) tensor for a reduce-scatter, the tensor sent or received for a
    send or recv (whose ``peer`` is the other rank, within the group).
    """

    kind: str  # all_reduce | all_gather | reduce_scatter | broadcast | send | recv
    group_size: int
    elements: int
    bytes: int
    direction: str  # forward | backward | none
    site: str
    op: str = "sum"
    peer: int | None = None


class CommLedger:
    """Context manager collecting ``CommRecord``s issued on this thread."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __enter__(self) -> CommLedger:
        _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack().remove(self)

    def filter(self, **match) -> list[CommRecord]:
        """Records whose fields equal every given keyword."""
        return [r for r in self.records
                if all(getattr(r, k) == v for k, v in match.items())]

    def count(self, **match) -> int:
        return len(self.filter(**match))

    def total_bytes(self, **match) -> int:
        return sum(r.bytes for r in self.filter(**match))

    def summary(self) -> Counter:
        """How many collectives of each (kind, direction, elements)."""
        return Counter((r.kind, r.direction, r.elements) for r in self.records)


def _stack() -> list[CommLedger]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def recording() -> bool:
    return bool(_stack())


def record(rec: CommRecord) -> None:
    for ledger in _stack():
        ledger.records.append(rec)


@torch.library.custom_op("shardplan::record_collective", mutates_args=())
def traced(t: torch.Tensor, kind: str, group_size: int, factor: int, direction: str,
           site: str, op: str = "sum", element_size: int = 0, times: int = 1) -> None:
    """Record ``times`` compiled collectives of ``t.numel() * factor`` elements of
    ``element_size`` bytes (default: ``t``'s). A custom op with a side effect: a
    compiled graph keeps it and calls it on every run (identical calls are merged
    into one: say ``times``)."""
    if direction == "backward" and current_graph_task_id() != -1:
        return  # a block recomputed in backward: its backward was recorded the first time
    if recording():
        elements = t.numel() * factor
        for _ in range(times):
            record(CommRecord(kind=kind, group_size=group_size, elements=elements,
                              bytes=elements * (element_size or t.element_size()),
                              direction=direction, site=site, op=op))


@traced.register_fake
def _(t, kind, group_size, factor, direction, site, op="sum", element_size=0, times=1) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.shardplan.record_collective.default)
