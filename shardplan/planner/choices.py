"""choices: where the planner weighs one way of running a region against another.

A reduction over a split dim (a norm over all heads) can run in distributed
form (each rank reduces its part, the small result is all-reduced: a
``stat`` transition) or stop its region (the region's openers stay
replicated, today's move). ``annotate`` plans both, per region, and keeps
the cheaper by ``Cost``: the bytes a training step moves between ranks (both
passes, at the example's shapes) plus the parameter bytes each rank holds.
A ``Choice`` records the decision and both costs for the plan and reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .shards import local_shape

DISTRIBUTED, REPLICATED = "distributed", "replicated"


@dataclass(frozen=True)
class Cost:
    moved: int  # bytes all ranks' collectives move per step (forward + backward), per rank
    params: int  # parameter bytes one rank holds

    @property
    def total(self) -> int:
        return self.moved + self.params

    def __str__(self) -> str:
        return f"{self.moved} B moved + {self.params} B of parameters"


@dataclass(frozen=True)
class Choice:
    """How the reductions ``nodes`` (over a split dim of one region) run."""

    nodes: tuple  # fx.Node, the reductions in graph order
    chosen: str  # DISTRIBUTED or REPLICATED
    costs: dict  # alternative -> Cost


def cost_of(ann) -> Cost:
    """What the annotation ``ann`` costs per rank: bytes moved and parameter bytes held."""
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
        params += math.prod(local_shape(tuple(p.shape), ann.params.get(name), ann.tp)) \
            * p.element_size()
    return Cost(moved, params)
