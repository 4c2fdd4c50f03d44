"""index: advanced indexing along dims other than the sharded one.

``x[:, :, [-2]]`` (Falcon's fused K/V taken out of its QKV view) is
``aten.index.Tensor(x, [None, None, idx])``: the dims given a ``None`` are
kept whole, the indexed ones are replaced by the index's shape. A shard on a
kept dim moves with it (the indexed dims must be next to each other, as
then the result keeps their place); the index tensors are used whole.
Indexing the sharded dim itself is not local.
"""

from __future__ import annotations

from ..graph import args_of, shape
from ...layouts import Shard
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
