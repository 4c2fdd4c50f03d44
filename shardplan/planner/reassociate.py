"""Sums of partial results regrouped so that they share one g.

A parallel-residual block (GPT-J, GPT-NeoX, Cohere, Phi, Falcon, PaLM) adds
two row-parallel outputs to the residual stream: ``x + attn(h) + mlp(h)``,
which the graph spells ``(x + P1) + P2``. Read in that order each partial
sum meets the replicated ``x`` alone and needs its own g; the sum is
associative, so ``x + (P1 + P2)`` computes the same value with one g after
``P1 + P2`` (GPT-NeoX's own trainer reduces once so). ``regroup`` rewrites
every such chain of additions in place; the annotation then joins the
partial sums (``linear_chains.pass_partials``).

A replicated term added to a partial sum before ops linear in both (GPT-OSS's
experts: each expert's bias added to its row-parallel output, then weighted
and summed over the top-k) is carried apart: ``chain(P + b)`` computes as
``chain(P) + chain(b)`` (``carry_apart``), so the g follows ``P`` to where the
chain is smallest (after the top-k sum: b*s*h, not b*s*k*h).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.fx as fx

from ..layouts import Partial, Replicate
from .graph import numel, op_name

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


def carry_apart(gm: fx.GraphModule, layouts: dict, through: dict) -> bool:
    """Rewrite one ``chain(P + b)`` (or ``P += b`` then ``chain(P)``) of ``gm`` as
    ``chain(P) + chain(b)``: ``P`` partial in ``layouts``, ``b`` replicated and of its
    shape, ``chain`` ops linear in the sum, each read by the next alone, up to the
    smallest tensor on the way, smaller than the sum. True if one was rewritten
    (annotate again, then call again)."""
    for add in gm.graph.nodes:
        kind = _add_kind(add)
        if kind is None:
            continue
        terms = [t for t in add.args if _partial(t, layouts, through)]
        rest = [t for t in add.args if t not in terms]
        if len(terms) != 1 or len(rest) != 1 or not isinstance(layouts.get(rest[0]), Replicate) \
                or not _same_shape((terms[0], rest[0]), add) \
                or (kind == _ADD_ and (add.args[0] is not terms[0] or len(terms[0].users) != 1)):
            continue  # in place: only into the partial sum, which nothing else reads
        chain = _smaller_chain(add, layouts, through)
        if chain:
            _replay(gm, add, chain, terms[0], rest[0])
            return True
    return False


def _smaller_chain(add: fx.Node, layouts: dict, through: dict) -> list[tuple[fx.Node, int]]:
    """The ops after ``add``, each linear in the one before (at the position given) and
    its only reader, its other operands replicated, up to the smallest (``[]`` when
    none is smaller than ``add``)."""
    chain, cur = [], add
    while len(cur.users) == 1:
        nxt = next(iter(cur.users))
        pos = [i for i, a in enumerate(nxt.args) if a is cur] if nxt.op == "call_function" else []
        if len(pos) != 1 or pos[0] not in through.get(op_name(nxt), ()) or any(
                isinstance(a, fx.Node) and not isinstance(layouts.get(a), Replicate)
                for i, a in enumerate(nxt.args) if i != pos[0]) or cur in nxt.kwargs.values():
            break
        chain.append((nxt, pos[0]))
        cur = nxt
    sizes = [numel(n) for n, _ in chain]
    if not sizes or min(sizes) >= numel(add):
        return []
    return chain[:sizes.index(min(sizes)) + 1]


def _replay(gm: fx.GraphModule, add: fx.Node, chain: list, part: fx.Node, whole: fx.Node) -> None:
    """``chain`` run on ``part`` and on ``whole`` apart, the two added where it ended."""
    end = chain[-1][0]
    ends = []
    with gm.graph.inserting_before(end.next):  # in order, after the chain
        for term in (part, whole):
            cur = term
            for node, pos in chain:
                args = list(node.args)
                args[pos] = cur
                new = gm.graph.call_function(node.target, tuple(args), dict(node.kwargs))
                new.meta = dict(node.meta)
                cur = new
            ends.append(cur)
        total = gm.graph.call_function(torch.ops.aten.add.Tensor, tuple(ends))
    total.meta = dict(end.meta)
    end.replace_all_uses_with(total)
    for node, _ in reversed(chain):
        gm.graph.erase_node(node)
    gm.graph.erase_node(add)
    gm.recompile()
