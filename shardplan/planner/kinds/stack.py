"""stack: join equally shaped tensors along a new dim (interleaved rotary's
``stack((-x2, x1), -1).flatten(-2)``).

The new dim is never the split one: pieces sharded alike on one dim give a
result sharded on that dim (one place later if the new dim comes before it),
and a replicated piece is sliced to this rank's part to join them.
"""

from __future__ import annotations

from ..graph import args_of, tensor_shape
from ...layouts import Shard
from .base import Context, Kind, Outcome, conflict, register, with_dim


@register
class StackKind(Kind):
    name = "stack"
    ops = frozenset({"aten.stack.default"})

    def rule(self, node, lays, ctx: Context) -> Outcome:
        pieces = [lays[(0, j)] for j in range(len(node.args[0]))]
        sharded = {lay for lay in pieces if isinstance(lay, Shard)}
        if len(sharded) != 1:
            return conflict(node, "stack of differently sharded tensors")
        lay = sharded.pop()
        dim = args_of(node)["dim"] % len(tensor_shape(node))
        needs = {(0, j): lay for j, p in enumerate(pieces) if not isinstance(p, Shard)}
        return Outcome(with_dim(lay, lay.dim + (1 if dim <= lay.dim else 0)), needs,
                       rule="stack (new dim)")
