"""index: advanced indexing along dims other than the sharded one.

``x[:, :, [-2]]`` (Falcon's fused K/V taken out of its QKV view) is
``aten.index.Tensor(x, [None, None, idx])``: the dims given a ``None`` are
kept whole, the indexed ones are replaced by the index's shape. A shard on a
kept dim moves with it (the indexed dims must be next to each other, as
then the result keeps their place); the index tensors are used whole.
Indexing the sharded dim itself is not local.

``gather(x, dim, index)`` (DeBERTa's relative-position scores picked per
query and key) reads along ``dim`` only: x, index and the result share every
other dim, so a shard on one of them is a shard of all three (a replicated
one is sliced here), provided the index is as long as x there.
"""

from __future__ import annotations

from ..graph import args_of, hint, operands, shape
from ...layouts import Partial, Shard
from .base import R, Context, Kind, Outcome, conflict, register, with_dim


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
            return conflict(node, "index along the sharded dim")
        if hit != list(range(hit[0], hit[-1] + 1)):
            return conflict(node, "indexed dims apart from each other (their result moves first)")
        if lay.dim < hit[0]:
            return Outcome(lay, {p: R for p in lays if p != (0,)}, rule="index (other dims)")
        added = len(shape(node)) - len(shape(node.args[0]))  # index dims in, indexed dims out
        return Outcome(with_dim(lay, lay.dim + added), {p: R for p in lays if p != (0,)},
                       rule="index (other dims)")


@register
class GatherKind(Kind):
    name = "gather"
    ops = frozenset({"aten.gather.default"})

    def rule(self, node, lays, ctx: Context) -> Outcome:
        a = args_of(node)
        dim = a["dim"] % len(shape(node))
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
        if hint(shape(node.args[0])[lay.dim]) != hint(shape(a["index"])[lay.dim]):
            return conflict(node, "gather with an index shorter than its input on the sharded dim")
        return Outcome(lay, {src: lay, index: lay}, rule="gather (other dims)")
