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

A reduce-scatter whose input is made token-wise from narrower tensors (a row
linear reading attention's ``h/tp``-wide output; the vocab-parallel lookup
reading the token ids) takes the gathered order too: those tensors are put in
that order instead (``gathered_order``, a copy of fewer bytes than the
scatter's), and the scatter skips its copy, forward and backward.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import operator
from typing import cast

import torch
import torch.fx as fx

from ..layouts import Shard
from ..runtime.graph_ops import (LinearsOnGatheredSequence, ScatterToSequence, VocabLookup,
                                  gathered_order)
from .shards import local_shape
from ..torch_compat import OpOverload

aten = torch.ops.aten

#: ``node.meta`` key set on the nodes of a region run in the gathered order
GATHERED_ORDER = "shardplan_gathered_order"

_SEQUENCE_ORDER = contextvars.ContextVar("shardplan_sequence_order", default=False)


@contextlib.contextmanager
def sequence_order():
    """Graphs rewritten inside keep every region in sequence order (what the gathered
    order buys is measured against this: ``benchmarks.sequence_parallel``)."""
    token = _SEQUENCE_ORDER.set(True)
    try:
        yield
    finally:
        _SEQUENCE_ORDER.reset(token)


def keep_gathered_order(gm: fx.GraphModule, tp: int, layouts: dict) -> None:
    """Mark every token-wise sequence-parallel region of ``gm`` to run in the order its
    gather leaves the tokens; then let every other scatter whose input is made token-wise
    from narrower tensors read them in that order. ``layouts``: each node's layout (the
    graph's shapes are the model's, a rank holds its shard of them)."""
    if _SEQUENCE_ORDER.get():
        return
    for node in list(gm.graph.nodes):
        mod = _module(gm, node)
        if isinstance(mod, LinearsOnGatheredSequence) and node.args[0] is None:
            region = _token_wise_region(gm, node, mod.dim)
            if region is not None:
                inside, scatters = region
                for n in [node, *scatters]:
                    _module(gm, n).stacked = True
                _mark(inside)
    for node in list(gm.graph.nodes):
        mod = _module(gm, node)
        if isinstance(mod, ScatterToSequence) and not mod.stacked:
            _feed_in_gathered_order(gm, node, mod, tp, layouts)


def _mark(nodes) -> None:
    for n in nodes:
        n.meta[GATHERED_ORDER] = True


def _module(gm: fx.GraphModule, node: fx.Node):
    return gm.get_submodule(str(node.target)) if node.op == "call_module" else None


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


def _feed_in_gathered_order(gm, scatter: fx.Node, mod: ScatterToSequence, tp: int,
                            layouts: dict) -> None:
    """Run the token-wise ops producing ``scatter``'s input (those read by nothing else) on
    their token-carrying inputs put in the gathered order, when those are narrower (per
    token, on this rank) than the scatter's input."""
    d = mod.dim

    def width(v):  # elements a token, on this rank
        return math.prod(local_shape(tuple(_val(v).shape), layouts.get(v), tp)[d + 1:])

    def whole_tokens(v):  # every rank holds all of v's tokens
        lay = layouts.get(v)
        return not isinstance(lay, Shard) or lay.dim > d

    src = cast(fx.Node, scatter.args[0])
    if _val(src) is None:  # a node made without a shape: leave it be
        return
    tokens = _val(src).shape[:d + 1]
    inside: set[fx.Node] = set()
    leaves: dict[fx.Node, int] = {}
    todo = [src]
    while todo:
        v = todo.pop()
        if v in inside or v in leaves:
            continue
        readers = {u for u in v.users if u.target is not aten.sym_size.int}
        if _feeds_by_token(gm, v) and readers <= inside | {scatter}:
            inside.add(v)
            todo += [a for a in _data(gm, v) if not _feature_only(a)]
        elif _val(v) is not None and _val(v).shape[:d + 1] == tokens and whole_tokens(v):
            leaves[v] = width(v)
        else:
            return
    if not inside or sum(leaves.values()) >= width(src):
        return
    for leaf in leaves:
        reading = [u for u in gm.graph.nodes if u in inside and leaf in u.all_input_nodes]
        with gm.graph.inserting_before(reading[0]):
            permuted = gm.graph.call_function(gathered_order, (leaf, tp, d, mod.site))
        for u in reading:
            u.replace_input_with(leaf, permuted)
    mod.stacked = True
    _mark(inside)


def _feeds_by_token(gm, node: fx.Node) -> bool:
    """Is ``node`` token-wise in its data operands (``_data``), whose gradients it also
    gives back token by token: a linear of parameters, a pointwise op, the vocab-parallel
    lookup of token ids?"""
    if isinstance(_module(gm, node), VocabLookup):
        return cast(fx.Node, node.args[0]).op == "get_attr"
    if node.target is aten.linear.default:
        return _of_parameters(node)
    return node.target is not operator.getitem and _token_wise_op(node)


def _of_parameters(linear: fx.Node) -> bool:
    """Are a linear's weight and bias parameters (not tensors with tokens of their own)?"""
    return all(cast(fx.Node, a).op == "get_attr" for a in linear.args[1:3] if a is not None)


def _data(gm, node: fx.Node) -> list[fx.Node]:
    """The operands of a token-wise op that carry tokens (a lookup's ids, a linear's input,
    a pointwise op's tensors)."""
    if isinstance(_module(gm, node), VocabLookup):
        return [cast(fx.Node, node.args[1])]
    if node.target is aten.linear.default:
        return [cast(fx.Node, node.args[0])]
    return [a for a in [*node.args, *node.kwargs.values()] if isinstance(a, fx.Node)]


def _val(node: fx.Node):
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _token_wise_op(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem or node.target is aten.linear.default:
        return True
    tags = getattr(node.target, "tags", ())
    # not an in-place op: its input is seen
    return (torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags
            and not cast(OpOverload, node.target)._schema.is_mutable)


def _operands_fit(node: fx.Node, inside: set) -> bool:
    """Every tensor ``node`` reads is the region's own (same token order), or one that
    has no tokens: a linear's parameters, a bias-like operand whose dims but the last are
    1."""
    if node.target is aten.linear.default:
        return node.args[0] in inside and _of_parameters(node)
    for a in [*node.args, *node.kwargs.values()]:
        if isinstance(a, fx.Node) and a not in inside and not _feature_only(a):
            return False
    return True


def _feature_only(node: fx.Node) -> bool:
    val = _val(node)
    return val is not None and all(s == 1 for s in val.shape[:-1])
