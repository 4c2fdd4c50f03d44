"""index: advanced indexing along dims other than the sharded one.

``x[:, :, [-2]]`` (Falcon's fused K/V taken out of its QKV view) is
``aten.index.Tensor(x, [None, None, idx])``: the dims given a ``None`` are
kept whole, the indexed ones are replaced by the index's shape. A shard on a
kept dim moves with it (the indexed dims must be next to each other, as
then the result keeps their place); the index tensors are used whole.
Indexing the sharded dim itself is local only where a constant index picks
blocks every rank holds whole, at the same offset locally (Falcon's one K and
one V head after its split query heads).

``gather(x, dim, index)`` (DeBERTa's relative-position scores picked per
query and key) reads along ``dim`` only: x, index and the result share every
other dim, so a shard on one of them is a shard of all three (a replicated
one is sliced here), provided the index is as long as x there.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph import args_of, hint, op_name, operands, tensor_shape
from ...layouts import Partial, Shard
from ...torch_compat import FakeTensor
from .base import R, Context, Kind, Outcome, conflict, cumsum, register, with_dim


@register
class IndexKind(Kind):
    name = "index"
    ops = frozenset({"aten.index.Tensor"})

    def rule(self, node, lays, ctx: Context) -> Outcome:
        lay = lays[(0,)]
        indices = list(args_of(node)["indices"])
        if any(isinstance(x, Shard) for p, x in lays.items() if p != (0,)) \
                or not isinstance(lay, Shard):
            return conflict(node, "an index tensor that is split")
        hit = [i for i, x in enumerate(indices) if x is not None]
        if lay.dim in hit:
            whole = _whole_blocks(lay, indices[lay.dim], hint(tensor_shape(node.args[0])[lay.dim]),
                                  ctx.size) if hit == [lay.dim] else None
            if whole is None:
                return conflict(node, "index along the sharded dim")
            return Outcome(whole, {p: R for p in lays if p != (0,)},
                           rule="index of blocks every rank holds whole")
        if hit != list(range(hit[0], hit[-1] + 1)):
            return conflict(node, "indexed dims apart from each other (their result moves first)")
        if lay.dim < hit[0]:
            return Outcome(lay, {p: R for p in lays if p != (0,)}, rule="index (other dims)")
        # index dims in, indexed dims out
        added = len(tensor_shape(node)) - len(tensor_shape(node.args[0]))
        return Outcome(with_dim(lay, lay.dim + added), {p: R for p in lays if p != (0,)},
                       rule="index (other dims)")


@register
class GatherKind(Kind):
    name = "gather"
    ops = frozenset({"aten.gather.default"})

    def rule(self, node, lays, ctx: Context) -> Outcome:
        a = args_of(node)
        dim = a["dim"] % len(tensor_shape(node))
        paths = {n: p for p, n in operands(node)}
        src, index = paths[node.args[0]], paths[a["index"]]
        if any(isinstance(x, Partial) for x in lays.values()):
            return conflict(node, "gather of a partial sum")
        split = {x for x in lays.values() if isinstance(x, Shard)}
        lay = split.pop()
        if split:
            return conflict(node, "gather of an input and an index split differently")
        if lay.dim == dim:
            return conflict(node, "gather along the sharded dim")
        if hint(tensor_shape(node.args[0])[lay.dim]) != hint(tensor_shape(a["index"])[lay.dim]):
            return conflict(node, "gather with an index shorter than its input on the sharded dim")
        return Outcome(lay, {src: lay, index: lay}, rule="gather (other dims)")


def _whole_blocks(lay: Shard, index, full: int, tp: int) -> Shard | None:
    """``x[..., [-2], :]`` of a blocked shard whose picked block is held whole by every
    rank (Falcon's one K head beside split queries), at the same offset from the end (or
    the start) on each rank as in the full tensor: the result is held whole, its
    gradient summed over the ranks like the block's. None when that does not hold."""
    at = constant_index(index)
    if not at or not lay.blocks or lay.padded:
        return None
    ends = list(cumsum(lay.blocks))
    whole = [r == tp for r in lay.block_replicas()]
    for v in at:
        i = next(k for k, e in enumerate(ends) if v % full < e)
        if not all(whole[i:] if v < 0 else whole[:i + 1]):
            return None
    return Shard(lay.dim, None, None, tp)


_CONSTANT_COPIES = {"aten.lift_fresh_copy.default", "aten.clone.default", "aten.detach.default"}


def constant_index(node) -> list[int] | None:
    """The values of an index tensor the graph holds as a constant (``x[..., [-2], :]``
    lifts ``tensor([-2])``), or None when it is computed or not at hand."""
    while isinstance(node, fx.Node) and node.op == "call_function" \
            and op_name(node) in _CONSTANT_COPIES:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    owner, _, leaf = str(node.target).rpartition(".")  # a get_attr's target is its name
    root = node.graph.owning_module
    if root is None:
        return None
    try:
        t = getattr(root.get_submodule(owner) if owner else root, leaf)
    except AttributeError:
        return None
    if not isinstance(t, torch.Tensor) or t.is_meta or t.is_floating_point() or t.dim() != 1 \
            or isinstance(t, FakeTensor):
        return None
    return [int(v) for v in t.tolist()]
