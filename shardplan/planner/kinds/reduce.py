"""reduce: ops that reduce over some dims; local unless a reduced dim is sharded.

The rule file says where the dims are: ``dim = "N"`` (argument N holds
them), ``"last:N"`` (the last len(argument N) dims, as layer_norm's
normalized_shape) or ``"all"``. A reduction it marks ``distributed`` (sum,
mean) may reduce a split dim: each rank reduces its part, and the result is
``Partial``, all-reduced like a row-parallel output (a ``stat`` transition,
b*s numbers for a norm's statistic; a max's result is all-reduced by max, and
only for an input that needs no gradient). The planner decides per region
whether that beats keeping the region replicated (``Context.undistributed``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph import args_of, op_name, tensor_shape
from ...layouts import Partial, Shard
from .base import R, Context, Kind, Outcome, Conflict, Role, conflict, register, \
    tensor_to_tensor, any_sharded, with_dim


@register
class ReduceKind(Kind):
    name = "reduce"

    def reads(self, op) -> bool:
        """One tensor in; one tensor out, or several of the reduced shape (``max.dim``'s
        and ``topk``'s values and indices)."""
        rets = op._schema.returns
        return tensor_to_tensor(op) or (
            bool(op._schema.arguments)
            and isinstance(op._schema.arguments[0].type, torch.TensorType)
            and bool(rets) and all(isinstance(r.type, torch.TensorType) for r in rets))

    def rule(self, node, lays, ctx: Context) -> Outcome:
        lay = lays[(0,)]
        if not isinstance(lay, Shard):
            return conflict(node,
                            f"{op_name(node)} on a tensor sharded only in a secondary operand")
        for p in lays:
            if p != (0,) and any_sharded(lays[p]):
                return conflict(node, f"{op_name(node)} with a sharded secondary operand")
        spec = ctx.rules.reduce[op_name(node)]
        rank = len(tensor_shape(node.args[0]))
        dims = self._dims(node, spec.dim, rank)
        if lay.dim in dims:
            if spec.distributed and node.name not in ctx.undistributed and not lay.padded \
                    and not (spec.distributed == "max" and ctx.needs_grad.get(node.args[0])):
                return Outcome(Partial(), {p: R for p in lays if p != (0,)},
                               role=Role.DISTRIBUTED,
                               rule=f"distributed {spec.distributed} over the split dim "
                                    f"{lay.dim}: local {spec.distributed}, then all-reduce")
            return Outcome(None, conflict=Conflict(
                node, f"{op_name(node)} reduces over the sharded dim", closes=True))
        # [B, T, C] summed over T, keepdim=False: S(2) -> S(1)
        val = node.meta["val"]
        outs = list(val) if isinstance(val, (tuple, list)) else [val]
        d = lay.dim if outs[0].dim() == rank else lay.dim - sum(1 for x in dims if x < lay.dim)
        out = with_dim(lay, d)
        return Outcome(out if len(outs) == 1 else tuple(out for _ in outs),
                       {p: R for p in lays if p != (0,)}, rule=f"reduce over {sorted(dims)}")

    def local_form(self, node: fx.Node, src: Shard, out, size: int, graph: fx.Graph) -> fx.Node:
        """This rank's summand of a mean over a dim split over ``size`` ranks is its
        mean / size (the part is 1/size of the elements, or size/r parts each held by r
        ranks: r/size of them, summed r times); of a sum, its sum / r."""
        if not isinstance(out, Partial):
            return node
        by = {"aten.mean.dim": size, "aten.sum.dim_IntList": src.replicas}.get(op_name(node), 1)
        if by == 1:
            return node
        users = list(node.users)
        with graph.inserting_after(node):
            scaled = graph.call_function(torch.ops.aten.div.Scalar, (node, by))
        scaled.meta = dict(node.meta)
        for u in users:
            u.replace_input_with(node, scaled)
        return scaled

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
