"""settle: one plan for a graph, the layout walk repeated until no conflict is left.

Each conflict the walk (``layout_pass.LayoutPass``) meets undoes its region:
the region's openers are kept replicated and the walk runs again. A split
that does not divide by tp is an error, unless holding each part on a group
of ranks makes it divide (K/V heads fewer than tp): the opener is then held
so, and the walk runs again. Parameters a view of which is needed split are
held split themselves (``split_params``), and the walk runs again. The
settled walk's annotation gets its warnings and its transitions.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch.fx as fx

from .annotation import Annotation
from .capture import source_of
from ..errors import DivisibilityError, LayoutError
from ..layouts import Layout, MeshSizes, Shard
from .graph import args_of, describe, op_name, tensor_shape
from .kinds import Conflict, Context
from .kinds.base import cumsum
from .kinds.permute import viewed_parameter
from .kinds.pieces import piece_bounds
from .layout_pass import LayoutPass
from .linear_chains import pass_partials
from .rules import RuleSet
from .sequence_dims import sequence_dims, sequence_warnings
from .transition_derivation import derive_transitions


def settle(gm: fx.GraphModule, dims: MeshSizes, rules: RuleSet, strict: bool,
           sequence_parallel: bool, keep: dict[str, Layout] | None, undistributed: frozenset[str],
           gather: frozenset[str]) -> Annotation:
    """``annotate``'s plan with the reductions ``undistributed`` (by name) kept from running
    distributed and the shards read by the ops ``gather`` (by name) all-gathered for them,
    without weighing alternatives."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    # opener -> (the reason it stays replicated, whether to warn of it)
    disabled = _kept_replicated(gm, rules, keep) if keep is not None else {}
    # opener -> (ranks per part, the divisibility conflict that asked for them)
    replicas: dict[fx.Node, tuple[int | tuple[int, ...], Conflict]] = {}
    # a parameter held split, and each view of it -> (layout, parameter)
    split: dict[fx.Node, tuple[Shard, fx.Node]] = {}
    seq_dims = sequence_dims(gm) if sequence_parallel else {}
    stopped: dict[fx.Node, frozenset[fx.Node]] = {}  # op a region stopped at -> its openers
    blocked: dict[fx.Node, frozenset[fx.Node]] = {}  # fallback op reading a shard -> openers
    while True:
        pas = LayoutPass(gm, dims, rules, params, disabled,
                         {o: r for o, (r, _) in replicas.items()}, seq_dims, undistributed, split,
                         gather)
        ann, conflicts = pas.run()
        wanted = {n: held for n, held in pas.wanted.items() if n not in split and
                  (keep is None or keep.get(cast(str, held[1].target)) == pas.wanted[held[1]][0])}
        split.update(wanted)
        if not conflicts:
            if wanted:
                continue
            break
        retry = False
        asked = dict(replicas)  # the counts this pass ran with
        for c in conflicts:
            want = {o: _merge(replicas.get(o, (1,))[0], _wanted(c, o, ann))
                    for o in c.origins} if c.divisibility else {}
            grow = {o: r for o, r in want.items() if r != replicas.get(o, (1,))[0] and r != 1}
            held = [o for o in c.origins if o in asked]
            if held and not grow:  # grouping ranks did not help: the split itself is wrong
                first = asked[held[0]][1]
                if c.divisibility or strict:
                    c = first
                    c.divisibility, c.replicas = True, 1
                else:  # keep that region whole, saying why in the first conflict's words
                    c = replace(c, reason=f"{first.reason}, and its parts held by "
                                           f"groups of ranks meet {c.reason}")
            if c.divisibility:
                if grow:
                    for o, r in grow.items():
                        replicas[o] = (r, c)
                    retry = True
                    continue
                raise DivisibilityError(c.reason, where=describe(c.node), source=source_of(c.node),
                                        fix=_divisible_fix(c.sizes, ann.dim, ann.size))
            if strict and not c.closes:
                raise LayoutError(c.reason, where=describe(c.node), source=source_of(c.node),
                                  fix="add a rule for this op, or drop strict=True to keep the "
                                      "region replicated")
            if c.closes:
                stopped.setdefault(c.node, frozenset(c.origins))
            if c.gatherable:
                blocked.setdefault(c.node, frozenset(c.origins))
            for o in c.origins:  # a fallback (warned) outranks a region that just does not close
                if o not in disabled or (not c.closes and not disabled[o][1]):
                    disabled[o] = (f"{c.reason} at {describe(c.node)}", not c.closes)
        if retry:
            continue
    ann.stopped, ann.blocked = stopped, blocked
    ann.disabled = {n: why for n, (why, _) in disabled.items()}
    ann.warnings = [f"{describe(n)} kept replicated: {why}"
                    for n, (why, warn) in disabled.items() if warn]
    if sequence_parallel:
        ann.warnings += sequence_warnings(ann)
    else:
        ann.passed, ann.joined_biases = pass_partials(ann.layouts, ann.outcomes,
                                                      Context(dims, rules))
    ann.transitions = derive_transitions(ann)
    return ann


def _divisible_fix(sizes: tuple[int, ...], dim: str, size: int) -> str:
    """The sizes of mesh dim ``dim`` that divide every one of ``sizes``, or what to change
    when none > 1 does."""
    if not sizes:
        return f"choose a {dim} dividing that size ({dim}={size} does not)"
    counts = " and ".join(map(str, sizes))
    fits = [t for t in range(2, min(max(sizes), 64) + 1) if all(n % t == 0 for n in sizes)]
    if fits:
        return (f"choose a {dim} dividing {counts}: {', '.join(map(str, fits))} "
                f"({dim}={size} does not)")
    return (f"no {dim} > 1 divides {counts}: run this model at {dim}=1, or give it a head "
            f"count (or width) that divides by {dim}={size}")


def _wanted(c: Conflict, opener: fx.Node, ann: Annotation):
    """The ranks per part a divisibility conflict asks of ``opener``: its count, or one
    per block of the opener's blocked output when the conflict reads some of its blocks
    (Phi-3's K slice of the fused QKV, viewed as 2 heads at tp 4: ``(1, 2, 2)``)."""
    lay = ann.layouts.get(opener)
    n = len(lay.blocks) if isinstance(lay, Shard) and lay.blocks else 1
    if isinstance(c.replicas, tuple):
        return c.replicas if len(c.replicas) == n else max(c.replicas)
    picked = _blocks_read(c.node, opener, ann) if n > 1 and c.replicas != 1 else None
    if picked is None:
        return c.replicas
    return tuple(c.replicas if i in picked else 1 for i in range(n))


def _merge(have, want):
    """Ranks per part meeting both ``have`` and ``want`` (counts, or one per block)."""
    if isinstance(have, int) and isinstance(want, int):
        return max(have, want)
    n = len(have) if isinstance(have, tuple) else len(want)
    have = have if isinstance(have, tuple) else (have,) * n
    want = want if isinstance(want, tuple) else (want,) * n
    merged = tuple(max(a, b) for a, b in zip(have, want))
    return merged[0] if len(set(merged)) == 1 else merged


def _blocks_read(node: fx.Node, opener: fx.Node, ann: Annotation) -> range | None:
    """Which blocks of ``opener``'s output ``node``'s first operand is made of: the piece a
    slice or split along the blocked dim took, followed up the chain of first operands."""
    cur: fx.node.Argument = node
    while isinstance(cur, fx.Node) and cur is not opener and cur.args:
        src = cur.args[0]
        if not isinstance(src, fx.Node):
            return None
        kind = ann.rules.kind(op_name(src if op_name(cur) == "getitem" else cur))
        if op_name(cur) == "getitem" and kind == "split" and op_name(src) != "aten.unbind.int":
            piece, cutter = cast(int, cur.args[1]), src
        elif kind == "slice" and op_name(cur) != "aten.select.int":
            piece, cutter = None, cur
        else:
            cur = src
            continue
        whole = cast(fx.Node, cutter.args[0])
        lay = ann.layouts.get(whole)
        dim = args_of(cutter)["dim"] % len(tensor_shape(whole))
        if not (isinstance(lay, Shard) and lay.blocks and lay.dim == dim):
            cur = cutter.args[0]
            continue
        ends = [0, *cumsum(lay.blocks)]
        start, stop = piece_bounds(cutter, piece)
        if start not in ends or stop not in ends:
            return None
        return range(ends.index(start), ends.index(stop))
    return None




def _kept_replicated(gm: fx.GraphModule, rules: RuleSet,
                     keep: dict[str, Layout]) -> dict[fx.Node, tuple[str, bool]]:
    """Openers (column GEMMs, vocab embeddings) whose weight ``keep`` holds replicated."""
    strat = rules.strategy
    weights = {o.op: o.weight for o in strat.open}
    if strat.vocab_embedding:
        weights[strat.vocab_embedding.op] = strat.vocab_embedding.weight
    out = {}
    for node in gm.graph.nodes:
        i = weights.get(op_name(node)) if node.op == "call_function" else None
        w = node.args[i] if i is not None and len(node.args) > i else None
        w = (viewed_parameter(w) or (w,))[0] if isinstance(w, fx.Node) else w
        if isinstance(w, fx.Node) and w.op == "get_attr" \
                and not isinstance(keep.get(cast(str, w.target)), Shard):
            out[node] = ("replicated, as in the model's first capture", False)
    return out
