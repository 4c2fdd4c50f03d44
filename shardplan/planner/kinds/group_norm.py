"""group_norm: a GroupNorm whose channels are split by whole groups runs locally.

``aten.group_norm(x, G, weight, bias)`` on ``[N, C, *]`` normalizes each of G groups
of C/G channels. Channels split into tp parts that each hold whole groups (G divisible
by tp) make every group local to one rank: each runs ``group_norm`` with G/tp groups
on its channels, with its part of the per-channel weight and bias; no communication.
A batch split is local too. Any other split (groups cut by the split, a spatial dim)
is a fallback (no Megatron answer: the planner weighs gathering the shard for it).
"""

from __future__ import annotations

from ..graph import args_of, operands
from ...layouts import Shard
from .base import Context, Kind, Outcome, conflict, register


@register
class GroupNormKind(Kind):
    name = "group_norm"
    ops = frozenset({"aten.group_norm.default"})

    def rule(self, node, lays, ctx: Context) -> Outcome:
        lay = lays[(0,)]
        params = {p for p, a in operands(node) if p != (0,)}
        if not isinstance(lay, Shard) or any(isinstance(lays[p], Shard) for p in params):
            return conflict(node, "group_norm with a sharded weight or bias")
        if lay.dim == 0:
            return Outcome(lay, rule="group_norm, batch split")
        groups = args_of(node)["num_groups"]
        if lay.dim == 1 and not (lay.blocks or lay.padded or lay.period) and lay.replicas == 1 \
                and groups % ctx.size == 0:
            return Outcome(lay, {p: Shard(0) for p in params},
                           rule=f"group_norm over whole groups: {groups // ctx.size} per rank")
        return conflict(node, "group_norm over groups cut by the split")

    def local_args(self, node, src, out, size, divide) -> dict:
        if src.dim != 1:
            return {}
        return {"num_groups": args_of(node)["num_groups"] // size}
