"""Sums of partial results regrouped so that they share one g.

A parallel-residual block (GPT-J, GPT-NeoX, Cohere, Phi, Falcon, PaLM) adds
two row-parallel outputs to the residual stream: ``x + attn(h) + mlp(h)``,
which the graph spells ``(x + P1) + P2``. Read in that order each partial
sum meets the replicated ``x`` alone and needs its own g; the sum is
associative, so ``x + (P1 + P2)`` computes the same value with one g after
``P1 + P2`` (GPT-NeoX's own trainer reduces once so). ``regroup`` rewrites
every such chain of additions in place; the annotation then joins the
partial sums (``linear_chains.pass_partials``).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.fx as fx

from ..layouts import Partial
from .graph import op_name

_ADD, _ADD_ = "aten.add.Tensor", "aten.add_.Tensor"


def regroup(gm: fx.GraphModule, layouts: dict, through: dict) -> bool:
    """Rewrite one ``(x + P1) + P2`` (or ``(P1 + x) + P2``, ``P2 + (x + P1)``, or in place
    ``x += P1; x += P2``) of ``gm``, ``P1`` and ``P2`` partial in ``layouts``, as
    ``x + (P1 + P2)``; True if one was rewritten (annotate again, then call again).
    A term is partial also through ops linear in it (``through``: the rule set's
    ``partial_through``, e.g. the dropout after a row-parallel linear)."""
    for outer in gm.graph.nodes:
        found = _chain(outer, layouts, through)
        if found is None:
            continue
        inner, x, first, second = found
        with gm.graph.inserting_before(outer):
            both = gm.graph.call_function(torch.ops.aten.add.Tensor, (first, second))
        both.meta = {**second.meta, "val": outer.meta.get("val")}
        outer.args = (x, both)
        gm.graph.erase_node(inner)
        gm.recompile()
        return True
    return False


def _chain(outer: fx.Node, layouts: dict, through: dict):
    """``(inner, x, P1, P2)`` when ``outer`` adds partial ``P2`` to ``inner = x + P1``,
    ``inner`` read by ``outer`` alone; else None. Out of place the terms may come in
    either order; in place (``add_``) ``x`` is what both write into, read by nothing else."""
    kind = _add_kind(outer)
    if kind is None:
        return None
    left, right = cast(tuple[fx.Node, fx.Node], outer.args)
    pairs = [(left, right)] if kind == _ADD_ else [(left, right), (right, left)]
    for inner, second in pairs:
        if not (_add_kind(inner) == kind and len(inner.users) == 1
                and _partial(second, layouts, through)):
            continue
        a, b = cast(tuple[fx.Node, fx.Node], inner.args)
        if kind == _ADD_:  # writes into a: nothing else may see it between the two
            orders = [(a, b)] if len(a.users) == 1 else []
        else:
            orders = [(a, b), (b, a)]
        for x, first in orders:
            if _partial(first, layouts, through) and _read_whole(x, layouts, through) and \
                    _same_shape((x, first, second), outer):
                return inner, x, first, second
    return None


def _add_kind(node) -> str | None:
    """``aten.add.Tensor`` or ``aten.add_.Tensor`` of two tensors (no ``alpha``), else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and op_name(node) in (_ADD, _ADD_) and len(node.args) == 2 and not node.kwargs
            and all(isinstance(a, fx.Node) for a in node.args)):
        return None
    return op_name(node)


def _read_whole(x: fx.Node, layouts: dict, through: dict) -> bool:
    """Is ``x`` reduced before this sum reads it anyway: not partial, or a partial sum
    others read too (a vocab-parallel embedding's output, also read by the norm)? A term
    that is one more partial of the sum is left to join it (no regrouping in circles)."""
    return not _partial(x, layouts, through) or len(x.users) > 1


def _partial(node, layouts: dict, through: dict) -> bool:
    """A partial sum, or an op linear in one that it alone reads (its g can move after it)."""
    while isinstance(node, fx.Node) and not isinstance(layouts.get(node), Partial):
        src = node.args[0] if node.op == "call_function" and node.args else None
        if not (isinstance(src, fx.Node) and 0 in through.get(op_name(node), ())
                and len(src.users) == 1):
            return False
        node = src
    return isinstance(node, fx.Node)


def _same_shape(terms: tuple, outer: fx.Node) -> bool:
    """Every term has the sum's shape (no broadcast moves with the regrouping)."""
    want = outer.meta.get("val")
    vals = [t.meta.get("val") for t in terms]
    return isinstance(want, torch.Tensor) and all(
        isinstance(v, torch.Tensor) and v.shape == want.shape for v in vals)
