"""choices: where the planner weighs one way of running a region against another.

A region that reaches an op that cannot run on its parts (a norm over all
heads, a cumsum or sort over the split features) can stop there (its openers
stay replicated: ``replicated``), run the op's reductions over the split dim
in distributed form (each rank reduces its part, the small result is
all-reduced: a ``stat`` transition; ``distributed``), or all-gather the shard
for the op, which then runs replicated with everything after it, while the
work upstream stays sharded (a ``gather`` transition; ``gathered``).
``annotate`` plans each that applies, per region, and keeps the cheapest by
``Cost``: the bytes a training step moves between ranks (both passes, at the
example's shapes) plus the bytes each rank holds for its parameters in that
step, each with its gradient. Ties go by ``Alternative``'s order: distributed, then
replicated (no new communication), then gathered.
A ``Choice`` records the decision and every alternative's cost for the plan
and reports.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from .shards import local_shape

class Alternative(str, enum.Enum):
    """A way to plan a stopped region (``Choice.chosen``), in the order of preference
    among equal costs."""

    DISTRIBUTED = "distributed"
    REPLICATED = "replicated"
    GATHERED = "gathered"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Cost:
    moved: int  # bytes all ranks' collectives move per step (forward + backward), per rank
    params: int  # bytes one rank holds for parameters in a training step (with gradients)

    @property
    def total(self) -> int:
        return self.moved + self.params

    def __str__(self) -> str:
        return f"{self.moved} B moved + {self.params} B of parameters and gradients"


@dataclass(frozen=True)
class Choice:
    """How the ops ``nodes`` one region stopped at run."""

    nodes: tuple[fx.Node, ...]  # in graph order: the reductions run distributed, else the stops
    chosen: Alternative
    costs: dict[Alternative, Cost]  # in the order of Alternative


def cost_of(ann) -> Cost:
    """What the annotation ``ann`` costs per rank: bytes moved, and bytes held for the
    parameters and the gradients of those that train (a replicated weight holds both in
    full on every rank: a K projection kept whole at tp 4 costs more than its share of
    a replica sum)."""
    moved = 0
    for t in ann.transitions:
        size = torch.empty((), dtype=t.dtype).element_size()
        sides = sum(1 for c in (t.forward, t.backward) if c.communicates)
        moved += sides * size * sum(t.elements)
    params = 0
    seen = set()
    for name, p in ann.gm.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += math.prod(local_shape(tuple(p.shape), ann.params.get(name), ann.size)) \
            * p.element_size() * (2 if p.requires_grad else 1)
    return Cost(moved, params)
