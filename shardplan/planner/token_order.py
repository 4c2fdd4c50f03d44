"""token_order: sequence-parallel regions that never need their tokens in order.

A sequence all-gather leaves the ranks' parts one after another; with the
sequence dim not outermost (``[B, T, C]`` split on T) putting the tokens back
in sequence order is a copy, and the reduce-scatter leaving the region makes
each rank's part contiguous again, another. A region that only computes each
token by itself (an MLP: linears and pointwise ops between the region's own
tensors) gives the same tokens in any order, so it can run on the order the
gather left: ``keep_gathered_order`` marks its gather (the linears that gather
their own input) and its reduce-scatters ``stacked``, and both copies go,
forward and backward (``Group.all_gather(stacked=True)``). Regions with
anything else (attention, reshapes, random ops) keep the sequence order.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..runtime.graph_ops import LinearsOnGatheredSequence, ScatterToSequence

aten = torch.ops.aten

#: ``node.meta`` key set on the nodes of a region run in the gathered order
GATHERED_ORDER = "shardplan_gathered_order"


def keep_gathered_order(gm: fx.GraphModule) -> None:
    """Mark every token-wise sequence-parallel region of ``gm`` to run in the order its
    gather leaves the tokens."""
    for node in gm.graph.nodes:
        mod = _module(gm, node)
        if isinstance(mod, LinearsOnGatheredSequence) and node.args[0] is None:
            region = _token_wise_region(gm, node, mod.dim)
            if region is not None:
                inside, scatters = region
                for n in [node, *scatters]:
                    _module(gm, n).stacked = True
                for n in inside:
                    n.meta[GATHERED_ORDER] = True


def _module(gm: fx.GraphModule, node: fx.Node):
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def _token_wise_region(gm, start: fx.Node, dim: int):
    """(the region's nodes, its sequence reduce-scatters) when everything ``start``'s
    outputs reach before a reduce-scatter along ``dim`` is token-wise; else None."""
    inside, scatters, todo = {start}, [], [start]
    while todo:
        for user in todo.pop().users:
            if user in inside or user in scatters or user.target is aten.sym_size.int:
                continue  # a size reads alike in any token order
            mod = _module(gm, user)
            if isinstance(mod, ScatterToSequence) and mod.dim == dim:
                scatters.append(user)
            elif _token_wise_op(user):
                inside.add(user)
                todo.append(user)
            else:
                return None
    if not scatters or not all(_operands_fit(n, inside) for n in [*inside - {start}, *scatters]):
        return None
    return inside, scatters


def _token_wise_op(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem or node.target is aten.linear.default:
        return True
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def _operands_fit(node: fx.Node, inside: set) -> bool:
    """Every tensor ``node`` reads is the region's own (same token order), or one that
    has no tokens: a linear's parameters, a bias-like operand whose dims but the last are
    1."""
    if node.target is aten.linear.default:
        params = [a for a in node.args[1:3] if a is not None]
        return node.args[0] in inside and all(p.op == "get_attr" for p in params)
    for a in [*node.args, *node.kwargs.values()]:
        if isinstance(a, fx.Node) and a not in inside and not _feature_only(a):
            return False
    return True


def _feature_only(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and all(s == 1 for s in val.shape[:-1])
