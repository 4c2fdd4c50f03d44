"""fresh: a new tensor shaped by its size argument, taking only the dtype and device of
its input (``new_empty``, ``new_zeros``).

Shaped like its sharded input along the split dim (DeepSeek's MLA keys:
``kv.new_empty(*kv.shape[:-1], d)``, filled per head by ``copy_`` into slices), it
is made as this rank's part: the split dim's size becomes the local one. Any other
shape is made whole on every rank (its values do not depend on the input).
"""

from __future__ import annotations

from ..graph import args_of, hint, tensor_shape
from ...layouts import Shard
from .base import R, Context, Kind, Outcome, local_size, register, tensor_to_tensor


@register
class FreshKind(Kind):
    name = "fresh"

    def reads(self, op) -> bool:
        return tensor_to_tensor(op) and "size" in [a.name for a in op._schema.arguments]

    def rule(self, node, lays, ctx: Context) -> Outcome:
        lay, src, out = lays[(0,)], tensor_shape(node.args[0]), tensor_shape(node)
        if len(out) == len(src) and hint(out[lay.dim]) == hint(src[lay.dim]):
            return Outcome(lay, rule="new tensor shaped like its input: this rank's part")
        return Outcome(R, rule="new tensor of another shape: whole")

    def local_args(self, node, src, out, size, divide) -> dict:
        if not isinstance(out, Shard):
            return {}
        sizes = list(args_of(node)["size"])
        sizes[out.dim] = local_size(sizes[out.dim], out, size, divide)
        return {"size": sizes}
