"""permute: ops that reorder dims; the shard moves with its dim."""

from __future__ import annotations

from ..graph import args_of, op_name, shape
from .base import Context, Kind, Outcome, register, with_dim


def _transpose(args, rank):
    a, b = args["dim0"] % rank, args["dim1"] % rank
    perm = list(range(rank))
    perm[a], perm[b] = b, a
    return perm


# each overload -> the permutation its arguments describe (output dim i = input dim perm[i])
_PERMUTATIONS = {
    "aten.transpose.int": _transpose,
    "aten.permute.default": lambda args, rank: [d % rank for d in args["dims"]],
    "aten.t.default": lambda args, rank: list(range(rank))[::-1],
}


@register
class PermuteKind(Kind):
    name = "permute"
    ops = frozenset(_PERMUTATIONS)

    def rule(self, node, lays, ctx: Context) -> Outcome:
        lay = lays[(0,)]
        perm = _PERMUTATIONS[op_name(node)](args_of(node), len(shape(node)))
        return Outcome(with_dim(lay, perm.index(lay.dim)), rule="permute")
