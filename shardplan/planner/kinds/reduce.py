"""reduce: ops that reduce over some dims; local unless a reduced dim is sharded.

The rule file says where the dims are: ``dim = "N"`` (argument N holds
them), ``"last:N"`` (the last len(argument N) dims, as layer_norm's
normalized_shape) or ``"all"``.
"""

from __future__ import annotations


from ..graph import args_of, op_name, shape
from ...layouts import Shard
from .base import R, Context, Kind, Outcome, Conflict, conflict, register, tensor_to_tensor, \
    any_sharded, with_dim


@register
class ReduceKind(Kind):
    name = "reduce"

    def reads(self, op) -> bool:
        return tensor_to_tensor(op)

    def rule(self, node, lays, ctx: Context) -> Outcome:
        lay = lays[(0,)]
        if not isinstance(lay, Shard):
            return conflict(node, f"{op_name(node)} on a tensor sharded only in a secondary operand")
        rank = len(shape(node.args[0]))
        dims = self._dims(node, ctx.rules.reduce[op_name(node)].dim, rank)
        if lay.dim in dims:
            return Outcome(None, conflict=Conflict(
                node, f"{op_name(node)} reduces over the sharded dim", closes=True))
        for p in lays:
            if p != (0,) and any_sharded(lays[p]):
                return conflict(node, f"{op_name(node)} with a sharded secondary operand")
        # [B, T, C] summed over T, keepdim=False: S(2) -> S(1)
        d = lay.dim if len(shape(node)) == rank else lay.dim - sum(1 for x in dims if x < lay.dim)
        return Outcome(with_dim(lay, d), {p: R for p in lays if p != (0,)},
                       rule=f"reduce over {sorted(dims)}")

    @staticmethod
    def _dims(node, spec: str, rank: int) -> set[int]:
        if spec == "all":
            return set(range(rank))
        names = [a.name for a in node.target._schema.arguments]
        args = args_of(node)
        if spec.startswith("last:"):
            return set(range(rank - len(args[names[int(spec[5:])]]), rank))
        arg = args.get(names[int(spec)])
        arg = list(range(rank)) if arg is None else ([arg] if isinstance(arg, int) else arg)
        return {d % rank for d in arg}
