"""permute: ops that reorder dims; the shard moves with its dim."""

from __future__ import annotations

import torch.fx as fx

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
    "aten.numpy_T.default": lambda args, rank: list(range(rank))[::-1],
}


@register
class PermuteKind(Kind):
    name = "permute"
    ops = frozenset(_PERMUTATIONS)

    def rule(self, node, lays, ctx: Context) -> Outcome:
        lay = lays[(0,)]
        perm = _PERMUTATIONS[op_name(node)](args_of(node), len(shape(node)))
        return Outcome(with_dim(lay, perm.index(lay.dim)), rule="permute")


def viewed_parameter(node: fx.Node) -> tuple[fx.Node, list[int]] | None:
    """A weight read through a permute (Falcon's ``x @ W.T``, HF experts'
    ``gate_up_proj.transpose(-2, -1)``): the ``get_attr`` it reads and the
    permutation (output dim i = the weight's dim perm[i]); else None."""
    if node.op != "call_function" or op_name(node) not in _PERMUTATIONS:
        return None
    src = node.args[0]
    if not (isinstance(src, fx.Node) and src.op == "get_attr"):
        return None
    return src, _PERMUTATIONS[op_name(node)](args_of(node), len(shape(node)))
