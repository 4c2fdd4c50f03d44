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


def viewed_parameter(node: fx.Node) -> tuple[fx.Node, list] | None:
    """A weight read through a permute (Falcon's ``x @ W.T``, HF experts'
    ``gate_up_proj.transpose(-2, -1)``) or by gathering its rows (HF's batched
    experts: ``gate_up_proj[expert_ids]``): the ``get_attr`` it reads and the
    weight dim of each dim of the view (None: the gathered rows' index dims);
    else None."""
    if node.op != "call_function" or not node.args:
        return None
    src = node.args[0]
    if not (isinstance(src, fx.Node) and src.op == "get_attr"):
        return None
    if op_name(node) in _PERMUTATIONS:
        return src, _PERMUTATIONS[op_name(node)](args_of(node), len(shape(node)))
    index = args_of(node).get("indices") if op_name(node) == "aten.index.Tensor" else None
    if index and len(index) == 1 and isinstance(index[0], fx.Node) and shape(index[0]):
        return src, [None] * len(shape(index[0])) + list(range(1, len(shape(src))))
    return None
