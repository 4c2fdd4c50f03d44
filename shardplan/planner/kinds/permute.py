"""permute: ops that reorder dims; the shard moves with its dim."""

from __future__ import annotations

from typing import cast

import torch.fx as fx

from ..graph import args_of, op_name, shape, tensor_shape
from ...layouts import Shard
from .base import Context, Kind, Outcome, register, with_dim


def _transpose(args, rank):
    a, b = args["dim0"] % rank, args["dim1"] % rank
    perm = list(range(rank))
    perm[a], perm[b] = b, a
    return perm


# each overload -> the permutation its arguments describe (output dim i = input dim perm[i])
PERMUTATIONS = {
    "aten.transpose.int": _transpose,
    "aten.permute.default": lambda args, rank: [d % rank for d in args["dims"]],
    "aten.t.default": lambda args, rank: list(range(rank))[::-1],
    "aten.numpy_T.default": lambda args, rank: list(range(rank))[::-1],
}


@register
class PermuteKind(Kind):
    name = "permute"
    shape_only = True
    ops = frozenset(PERMUTATIONS)

    def rule(self, node, lays, ctx: Context) -> Outcome:
        lay = lays[(0,)]
        perm = PERMUTATIONS[op_name(node)](args_of(node), len(tensor_shape(node)))
        return Outcome(with_dim(lay, perm.index(lay.dim)), rule="permute")


def viewed_parameter(node: fx.Node) -> tuple[fx.Node, list] | None:
    """A weight read through a permute (Falcon's ``x @ W.T``, HF experts'
    ``gate_up_proj.transpose(-2, -1)``) or by gathering its rows (HF's batched
    experts: ``gate_up_proj[expert_ids]``), directly or of its ``experts_view``:
    the ``get_attr`` it reads and the weight dim of each dim of the view (None:
    the gathered rows' index dims, and the experts' dim of an experts view);
    else None."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    experts = experts_view(node.args[0])
    src = experts[0] if experts else node.args[0]
    if src.op != "get_attr":
        return None
    dims = [None, 0, 1] if experts else list(range(len(shape(src) or ())))
    if op_name(node) in PERMUTATIONS:
        perm = PERMUTATIONS[op_name(node)](args_of(node), len(tensor_shape(node)))
        return src, [dims[d] for d in perm]
    index = args_of(node).get("indices") if op_name(node) == "aten.index.Tensor" else None
    if index and len(index) == 1 and isinstance(index[0], fx.Node) and shape(index[0]):
        return src, [None] * len(tensor_shape(index[0])) + dims[1:]
    return None


def experts_view(node: fx.Node) -> tuple[fx.Node, int] | None:
    """A 2-D weight holding its experts' rows one after another, viewed as (experts,
    rows, cols) with the rows left to the view (DBRX: ``w1.view(E, -1, H)``) and read
    only through permutes or row gathers: the ``get_attr`` and the experts count. A
    split of the rows is a split of every expert's block of the weight."""
    if node.op != "call_function" or op_name(node) not in ("aten.view.default",
                                                           "aten.reshape.default"):
        return None
    src = node.args[0]
    sizes = list(cast(list, node.args[1])) if len(node.args) > 1 else []
    if not (isinstance(src, fx.Node) and src.op == "get_attr") or len(sizes) != 3 \
            or sizes[1] != -1 or len(tensor_shape(src)) != 2 \
            or tensor_shape(node)[2] != tensor_shape(src)[1] \
            or not all(op_name(u) in PERMUTATIONS or op_name(u) == "aten.index.Tensor"
                       for u in node.users):
        return None
    return src, tensor_shape(node)[0]


def parameter_layout(node: fx.Node, need: Shard) -> Shard | None:
    """The layout the weight ``node`` views (``viewed_parameter``) is held with for the
    view to be ``need``; None where ``need`` splits gathered rows or experts."""
    src, dims = cast(tuple, viewed_parameter(node))  # a view: its callers checked
    d = dims[need.dim]
    if d is None:
        return None
    experts = experts_view(cast(fx.Node, node.args[0]))
    if experts and d == 0:  # each expert's rows, split alike: the experts as blocks
        if need.blocks or need.padded or need.replicas != 1:
            return None
        rows = tensor_shape(src)[0] // experts[1]
        return Shard(0, (rows,) * experts[1] if experts[1] > 1 else None)
    return with_dim(need, d)
