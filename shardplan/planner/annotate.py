"""annotate: give every tensor of a captured graph a layout, by a rule set.

One forward pass over the graph in topological order. At each node the rule
kind of its op (``kinds.KINDS``, by the rule set's listing) maps the
operands' layouts to the output's; the Megatron strategy decides where
regions open (a GEMM on a replicated input with a parameter weight: column
parallel), and everything else follows: a GEMM that contracts a sharded
factor is row parallel and its output is ``Partial``.

A region that reaches an op the rules cannot run locally is not opened: its
opener is kept replicated and the pass is repeated. So the result is always
correct, and efficient where the rules apply. An opener kept replicated gets
a warning unless its region merely does not close (a reduction over the
split dim, e.g. a norm of a split tensor): that is the rules working, not a
missing rule.

The pass ends by listing the transitions (``transitions.Transition``): f
where a replicated tensor enters a region, g after each partial result, the
local slices, the vocab-parallel loss, the gathers of sharded outputs.

With ``sequence_parallel`` a partial result that has the sequence dim is
read as ``Shard(seq)`` (reduce-scattered): the ops between regions run on
this rank's tokens by the same rules, and an operand is all-gathered where a
region opens on it or where an op cannot run on the tokens alone. The
sequence dim is the symbolic token dim of the inputs, followed by its
symbol through every reshape and transpose.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import cast

import torch
import torch.fx as fx

from .blocks import split_first
from .capture import GUARDS, module_of, source_of
from ..errors import ConfigurationError, DivisibilityError, LayoutError, ShardplanError
from ..layouts import MeshDim, MeshSizes, Partial, Replicate, Shard
from .graph import (args_of, describe, floating, hint, op_name, operand, operands, shape,
                    tensor_shape)
from .kinds import KINDS, Conflict, Context, Outcome, Role
from .kinds.base import any_sharded, cumsum, replicated_like
from .kinds.factors import labels
from .kinds.permute import experts_view, parameter_layout, viewed_parameter
from .kinds.pieces import piece_bounds
from .linear_chains import earlier_f, pass_partials
from .reassociate import regroup
from .reshape import keeps_last_dim
from .split_params import split_parameter
from .decompose import decomposable, decompose
from .choices import ORDER, DISTRIBUTED, GATHERED, REPLICATED, Choice, cost_of
from .rules import RuleSet, VocabEmbedding, VocabLoss
from .transitions import Collective, Purpose, Transition, dtype_of, message

R = Replicate()


@dataclass
class Annotation:
    """The engine's result for one graph on one mesh; never changed after ``annotate``.

    The layouts and transitions are placements along ``dim`` (tp), the mesh dimension
    the engine plans; ``dims`` are the sizes of every dimension of the mesh."""

    gm: fx.GraphModule
    dims: MeshSizes
    layouts: dict  # fx.Node -> Layout | tuple | None (a row-parallel output is Partial)
    outcomes: dict  # fx.Node -> Outcome
    params: dict  # get_attr target -> Layout
    requires_grad: dict  # fx.Node -> bool
    disabled: dict  # opener fx.Node -> reason it stays replicated
    warnings: list  # openers kept replicated for a reason other than a non-closing region
    rules: RuleSet
    transitions: list  # [Transition], in the order the rewriter meets them
    # sequence parallelism: partial node -> the Shard(seq) it is reduce-scattered to;
    # (consumer, operand path) -> (the Shard(seq) all-gathered for it, SEQ_GATHER or
    # SEQ_UNSHARD); node -> its seq dims
    scattered: dict = field(default_factory=dict)
    gathered: dict = field(default_factory=dict)
    seq_dims: dict = field(default_factory=dict)
    # a partial result with no sequence dim of its own (HF Conv1D's flattened batch x
    # sequence) -> the view of it that has one, where it is reduce-scattered instead
    deferred: dict = field(default_factory=dict)
    # partial nodes read by an op linear in them: their sum is reduced after it (a g moved
    # on to where the tensor is smallest: an MoE layer's sum over the top-k)
    passed: set = field(default_factory=set)
    # a sum of partial sums -> the row-parallel partials in it whose bias is added after
    # the sum's g (a parallel-residual block's two row biases)
    joined_biases: dict = field(default_factory=dict)
    stopped: dict = field(default_factory=dict)  # op a region stopped at -> its openers
    # op with no rule for a shard it reads (a fallback; all-gathering it would do) -> openers
    blocked: dict = field(default_factory=dict)
    choices: list = field(default_factory=list)  # [choices.Choice], one per weighed region
    dim: MeshDim = MeshDim.TP

    @property
    def size(self) -> int:
        """The ranks along ``dim``: the parts a shard of these layouts is split into."""
        return self.dims[self.dim]

    def read(self, node: fx.Node, consumer: fx.Node | None = None, path=None):
        """The layout ``consumer`` reads of ``node`` (after its g, scatter or gather)."""
        if (consumer, path) in self.gathered:
            return R
        return self.scattered.get(node) or read_as(self.layouts.get(node))

    def on_tokens(self, node: fx.Node, lay=None) -> bool:
        """Is ``node``'s layout (or ``lay``) a shard of its sequence dim?"""
        lay = self.layouts.get(node) if lay is None else lay
        return isinstance(lay, Shard) and lay.dim in self.seq_dims.get(node, ())


def annotate(gm: fx.GraphModule, dims: MeshSizes, rules: RuleSet, *, strict: bool = False,
             sequence_parallel: bool = False, keep: dict | None = None,
             distribute: bool = True, cut_blocks: bool = True) -> Annotation:
    """Layouts and transitions for every node of ``gm`` under tensor parallelism
    ``dims.tp`` (``dims``: the sizes of the mesh's dimensions).

    Openers whose regions reach an op that cannot run locally are kept
    replicated and the pass repeats. A split that does not divide by tp is
    an error, except where holding the split dim on groups of ranks makes it
    divide and the region turns into an ordinary shard before any GEMM (K/V
    heads fewer than tp: each rank holds the K/V head its query heads use).

    ``keep`` (parameter target -> layout, from an earlier capture of the same
    model) keeps replicated every opener whose weight it holds replicated:
    one model has one layout, however it is called.

    A region stopped at an op that cannot run on its parts is planned up to three
    ways, and the cheapest kept (``choices``): stopped there with its openers
    replicated (the baseline: no distributed reduction, no gather), with the
    region's reductions over the split dim distributed (where the rules can run
    them so; a fused norm or softmax is written out first), or with the shard
    all-gathered where the region stopped (``Purpose.GATHER``; not under sequence
    parallelism). ``distribute=False`` gives the baseline alone (the graph unchanged).

    Sequence parallelism sums the gradients of per-token parameters (norm weights, row
    biases) in one all-reduce per block where ``cut_blocks`` (recomputation and FSDP run
    the graph block by block), else in one all-reduce per step, after the last of them.
    """
    settle = lambda g, whole, gather: _settle(  # noqa: E731
        g, dims, rules, strict, sequence_parallel, keep, whole, gather)
    whole = _reductions(gm, rules)  # names of the reductions kept whole (all, to start)
    gather: frozenset[str] = frozenset()  # names of the ops whose split operands are all-gathered
    ann = settle(gm, whole, gather)
    for _ in gm.graph.nodes:  # x + P1 + P2 as x + (P1 + P2): one g; at most one a node
        if sequence_parallel or not regroup(gm, ann.layouts, rules.strategy.partial_through):
            break
        ann = settle(gm, whole, gather)
    regions: dict = {}  # names of openers -> names of the ops that stopped them
    for node, origins in ann.stopped.items() if distribute else ():
        if _reduction(node, whole):
            regions.setdefault(frozenset(o.name for o in origins), set()).add(node.name)
    for node, origins in ann.blocked.items() if distribute else ():
        regions.setdefault(frozenset(o.name for o in origins), set()).add(node.name)
    choices = []
    for origins, stops in regions.items():
        nodes = {n.name: n for n in gm.graph.nodes}
        if not stops <= nodes.keys():
            continue  # written out with an earlier region
        alts = {}
        names = {n for n in stops if _reduction(nodes[n], whole)}
        done = ()
        if names:
            alt, done, names = _distributed(gm, ann, settle, whole, gather, names, origins)
            if done:  # else none can run distributed (a max that needs its gradient)
                alts[DISTRIBUTED] = alt
        if not sequence_parallel and not names:
            alt, gathered = _gathered(gm, ann, settle, whole, gather, stops, origins)
            if alt is not None:
                alts[GATHERED] = alt
        if not alts:
            continue
        alts[REPLICATED] = ann
        costs = {k: cost_of(a) for k, a in alts.items()}
        chosen = min((k for k in ORDER if k in costs), key=lambda k: costs[k].total)
        choices.append(Choice(done or tuple(n for n in gm.graph.nodes if n.name in stops),
                              chosen, {k: costs[k] for k in ORDER if k in costs}))
        if chosen == DISTRIBUTED:  # the written-out graph becomes the model's
            gm.graph = alts[chosen].gm.graph
            alts[chosen].gm = gm
            ann, whole = alts[chosen], whole - names
        elif chosen == GATHERED:
            ann, gather = alts[chosen], gather | gathered
    ann.choices = choices
    if not cut_blocks:
        ann.transitions = _bucket_grad_sums(ann.transitions, per_block=False)
    return ann


def _reduction(node: fx.Node, whole: frozenset) -> bool:
    """Is ``node`` a reduction the rules can run distributed (or a fused norm or softmax
    written out in such)? There the choice is Megatron's: distributed or replicated."""
    return node.name in whole or decomposable(node)


def _reductions(gm: fx.GraphModule, rules: RuleSet) -> frozenset:
    """Names of the reductions the rules can run distributed over a split dim."""
    return frozenset(n.name for n in gm.graph.nodes if n.op == "call_function"
                     and getattr(rules.reduce.get(op_name(n)), "distributed", None))


def _distributed(gm, ann: Annotation, settle, whole: frozenset, gather: frozenset, names: set,
                 origins: frozenset):
    """``ann`` with one region's reductions ``names`` distributed, on a copy of the graph
    (fused norms and softmaxes written out), with every further reduction that region
    then stops at (a norm's second mean, a softmax's sum after its max). Returns the
    annotation, the reductions it newly runs distributed, and the names enabled."""
    g = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    before = {n.name for n, o in ann.outcomes.items() if o.role is Role.DISTRIBUTED}
    grad = {n.name for n, needs in ann.requires_grad.items() if needs}
    while True:
        fused = [n for n in g.graph.nodes if n.name in names
                 and decomposable(n, n.args[0].name in grad)]
        if fused:
            decompose(g, fused)
        try:
            alt = settle(g, whole - names, gather)
        except ShardplanError:  # not a plan at all this way: the baseline stands
            return None, (), names
        more = {n.name for n, o in alt.stopped.items()
                if _reduction(n, whole) and {x.name for x in o} & origins} - names
        if not more:
            done = tuple(n for n, o in alt.outcomes.items()
                         if o.role is Role.DISTRIBUTED and n.name not in before)
            return alt, done, names
        names = names | more


def _gathered(gm, ann: Annotation, settle, whole: frozenset, gather: frozenset, stops: set,
              origins: frozenset):
    """``ann`` with the shards read by ``stops`` (the ops one region stopped at)
    all-gathered there, and at every further op that region then stops at, so that
    its openers stay sharded. Returns the annotation and the ops gathered at, or None
    where that gathers nothing or the openers stay replicated anyway (another conflict
    holds them)."""
    names = set(stops)
    while True:
        try:
            alt = settle(gm, whole, gather | names)
        except ShardplanError:  # not a plan at all this way: the baseline stands
            return None, names
        more = {n.name for n, o in alt.blocked.items()
                if not _reduction(n, whole) and {x.name for x in o} & origins} - names
        if not more:
            held = {n.name for n in alt.disabled}
            gathers = lambda a: sum(t.purpose is Purpose.GATHER for t in a.transitions)  # noqa: E731
            useless = origins <= held or gathers(alt) == gathers(ann)
            return (None if useless else alt), names
        names = names | more


def _settle(gm, dims, rules, strict, sequence_parallel, keep, whole, gather) -> Annotation:
    """``annotate`` with the reductions ``whole`` kept from running distributed and the
    shards read by the ops ``gather`` all-gathered for them."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    # opener -> (reason, warn)
    disabled: dict = _kept_replicated(gm, rules, keep) if keep is not None else {}
    replicas: dict = {}  # opener -> (replicas, the divisibility conflict that asked for them)
    split: dict = {}  # a parameter held split, and each view of it -> (layout, parameter)
    seq_dims = sequence_dims(gm) if sequence_parallel else {}
    stopped: dict = {}
    blocked: dict = {}
    while True:
        pas = _Pass(gm, dims, rules, params, disabled,
                    {o: r for o, (r, _) in replicas.items()}, seq_dims, whole, split, gather)
        ann, conflicts = pas.run()
        wanted = {n: held for n, held in pas.wanted.items() if n not in split and
                  (keep is None or keep.get(held[1].target) == pas.wanted[held[1]][0])}
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
        ann.warnings += _sequence_warnings(ann)
    else:
        ann.passed, ann.joined_biases = pass_partials(ann.layouts, ann.outcomes,
                                                      Context(dims, rules))
    ann.transitions = _transitions(ann)
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
        lay = ann.layouts.get(cutter.args[0])
        dim = args_of(cutter)["dim"] % len(tensor_shape(cast(fx.Node, cutter.args[0])))
        if not (isinstance(lay, Shard) and lay.blocks and lay.dim == dim):
            cur = cutter.args[0]
            continue
        ends = [0, *cumsum(lay.blocks)]
        start, stop = piece_bounds(cutter, piece)
        if start not in ends or stop not in ends:
            return None
        return range(ends.index(start), ends.index(stop))
    return None


def read_as(lay):
    """The layout a consumer reads: a partial value is reduced (g) before anyone reads it."""
    return R if isinstance(lay, Partial) else lay


class _Pass:
    def __init__(self, gm, dims: MeshSizes, rules: RuleSet, params, disabled, replicas, seq_dims,
                 whole, split, gather=frozenset()):
        self.gm, self.rules, self.params, self.disabled = gm, rules, params, disabled
        self.split = split  # a parameter held split, and its views -> (layout, parameter)
        self.gather = gather  # names of ops whose split operands are all-gathered for them
        self.wanted: dict = {}  # the same, found needed by this pass, for the next
        self.grad: dict = {}
        self.ctx = Context(dims, rules, whole, self.grad)
        self.dim, self.size = self.ctx.dim, self.ctx.size  # the mesh dim planned, its ranks
        self.replicas = replicas
        self.seq_dims = seq_dims  # empty unless sequence parallel
        self.scattered: dict = {}
        self.gathered: dict = {}
        self.deferred: dict = {}
        self.layouts: dict = {}
        self.origins: dict = {}  # node -> frozenset of opener nodes its layout derives from
        self.outcomes: dict = {}
        self.param_layouts: dict = {}  # target -> (Layout, origins)
        self.conflicts: list[Conflict] = []
        self.openers = {o.op: o for o in rules.strategy.open}

    def run(self):
        for node in self.gm.graph.nodes:
            self._visit(node)
        ann = Annotation(self.gm, self.ctx.dims, self.layouts, self.outcomes,
                         {t: lay for t, (lay, _) in self.param_layouts.items()},
                         self.grad, {}, [], self.rules, [],
                         self.scattered, self.gathered, self.seq_dims, self.deferred,
                         dim=self.dim)
        return ann, self.conflicts

    # ----------------------------------------------------------------- per node

    def _visit(self, node: fx.Node) -> None:
        held = self.split.get(node)
        if held is not None and held[1] not in self.disabled:  # split_params
            lay, param = held  # the parameter is the origin, should a conflict undo it
            self.layouts[node], self.origins[node] = lay, frozenset({param})
            if node is param:
                self.param_layouts[node.target] = (lay, frozenset({node}))
                self.grad[node] = self.params[node.target].requires_grad
            else:
                self.grad[node] = self.grad[node.args[0]] and floating(node)
                self.outcomes[node] = Outcome(lay, rule="view of a parameter held split")
            return
        if node.op in ("placeholder", "get_attr"):
            self.layouts[node] = R if isinstance(node.meta.get("val"), torch.Tensor) else None
            self.origins[node] = frozenset()
            self.grad[node] = node.op == "get_attr" and node.target in self.params and \
                self.params[node.target].requires_grad
            return
        if node.op == "output" or (node.op == "call_module" and node.target == GUARDS):
            self.layouts[node] = None
            return
        ins = operands(node)
        self.grad[node] = any(self.grad.get(a, False) for _, a in ins) and floating(node) \
            and op_name(node) != "aten.detach.default"
        origins = frozenset().union(*[self.origins.get(a, frozenset()) for _, a in ins]) \
            if ins else frozenset()
        outcome = self._unflattened(node, ins) or self._rule(node, ins)
        if outcome.conflict:
            outcome.conflict.origins = outcome.conflict.origins or origins
            outcome.conflict.gatherable = \
                not (outcome.conflict.divisibility or outcome.conflict.closes) \
                and any(isinstance(self._read(a), Shard) for _, a in ins)
            self.conflicts.append(outcome.conflict)
            outcome = Outcome(replicated_like(node), rule="conflict")
        if viewed_parameter(node) is None and experts_view(node) is None:
            # not a weight's view: a view's consumers say how the weight is held
            self._params_needed(node, ins, outcome, origins)
        self.outcomes[node] = outcome
        self.layouts[node] = outcome.out
        dims = self.seq_dims.get(node, ())
        if isinstance(outcome.out, Partial) and len(dims) == 1 \
                and outcome.role is not Role.DISTRIBUTED:
            self.scattered[node] = Shard(next(iter(dims)))
        if outcome.role is Role.COLUMN:
            origins = origins | {node}
        self.origins[node] = origins if any_sharded(read_as(outcome.out)) else frozenset()

    def _params_needed(self, node, ins, outcome: Outcome, origins) -> None:
        """Record layouts required of parameters/buffers (read directly or through a
        permute: ``x @ W.T``); disagreeing uses conflict."""
        if outcome.role in (Role.COLUMN, Role.VOCAB_EMBEDDING):
            origins = origins | {node}
        for path, a in ins:
            need = outcome.needs.get(path, R)
            if isinstance(need, Shard) and not isinstance(self._read(a), Shard) \
                    and a.op != "get_attr" and viewed_parameter(a) is None:
                found = split_parameter(a, need, self.params, self.ctx)
                param = next((n for n in found or () if n.op == "get_attr"), None)
                if found is not None and param is not None and param not in self.disabled:
                    self.wanted.update({n: (lay, param) for n, lay in found.items()})
            view = viewed_parameter(a)
            if view is not None:
                held = parameter_layout(a, need) if isinstance(need, Shard) else R
                a = view[0]
                if held is None:
                    self.conflicts.append(Conflict(
                        node, f"{a.target}'s gathered rows are needed split", origins | {node}))
                    continue
                need = held
            if a.op != "get_attr":
                continue
            have = self.param_layouts.get(a.target)
            if have is None:
                self.param_layouts[a.target] = (need, origins)
            elif have[0] != need:
                self.conflicts.append(Conflict(
                    node, f"{a.target} is needed as {have[0]} and as {need}",
                    have[1] | origins | {node}))

    def _read(self, a: fx.Node):
        return self.scattered.get(a) or read_as(self.layouts.get(a, R))

    def _unflattened(self, node: fx.Node, ins) -> Outcome | None:
        """A view giving the sequence back its own dim, of a partial result that had none
        (HF Conv1D: ``view(addmm(b, x.view(-1, h), W), [B, T, h])``): the view stays
        partial (it is linear), so the sum is reduce-scattered after it, onto the tokens."""
        if not self.seq_dims or len(self.seq_dims.get(node, ())) != 1 or not ins \
                or self.rules.kind(op_name(node)) != "reshape":
            return None
        a = cast(fx.Node, node.args[0])
        if not isinstance(self.layouts.get(a), Partial) or a in self.seq_dims \
                or len(a.users) != 1:
            return None
        self.deferred[a] = node
        return Outcome(Partial(), rule="view of a partial sum, reduce-scattered after it")

    def _feeds_openers(self, node: fx.Node) -> bool:
        """Is ``node`` a reshape read only as the input of region openers (HF Conv1D's
        ``x.view(-1, h)`` before its ``addmm``)? Gathered before it, the ranks' tokens then
        enter the region as they do a linear."""
        if self.rules.kind(op_name(node)) != "reshape" or not node.users:
            return False
        for user in node.users:
            spec = self.openers.get(op_name(user)) if user.op == "call_function" else None
            if spec is None or user in self.disabled or \
                    (len(user.args) > spec.weight and user.args[spec.weight] is node):
                return False
        return True

    def _rule(self, node: fx.Node, ins) -> Outcome:
        """The rule's outcome; in sequence parallel, operands held on tokens are gathered
        where a region opens on them or where the op cannot run on tokens alone."""
        lays = {p: self._read(a) for p, a in ins}
        if node.name in self.gather:  # the planner's gather move: the op runs on whole values
            split = [p for p, lay in lays.items() if isinstance(lay, Shard)]
            if any(lays[p].replicas != 1 for p in split):  # parts held by groups of ranks:
                split = []  # their gradients are summed over the group (no gather of them)
            self.gathered.update({(node, p): (lays[p], Purpose.GATHER) for p in split})
            lays = {p: R if p in split else lay for p, lay in lays.items()}
        tokens = [p for p, a in ins if isinstance(lays[p], Shard)
                  and lays[p].dim in self.seq_dims.get(a, ())]
        if not tokens:
            return self._rule_on(node, lays)
        whole = {p: R if p in tokens else lay for p, lay in lays.items()}
        opens = (op_name(node) in self.openers and node not in self.disabled) \
            or self._feeds_openers(node)
        outcome = None if opens else self._rule_on(node, lays)
        if outcome is None or outcome.conflict:
            outcome = self._rule_on(node, whole)
            # into a region: its backward reduce-scatter sums the ranks' partial gradients;
            # elsewhere the gradient is whole on every rank and each keeps its tokens'
            purpose = Purpose.SEQ_GATHER if opens else Purpose.SEQ_UNSHARD
            self.gathered.update({(node, p): (lays[p], purpose) for p in tokens})
        return outcome

    def _rule_on(self, node: fx.Node, lays: dict) -> Outcome:
        name = op_name(node)
        strat = self.rules.strategy
        if not any(any_sharded(lay) for lay in lays.values()):
            if name in self.openers and node not in self.disabled:
                opened = self._open_column(node, name)
                if opened:
                    return opened
            if strat.vocab_embedding and name == strat.vocab_embedding.op \
                    and node not in self.disabled:
                opened = self._open_vocab(node, strat.vocab_embedding)
                if opened:
                    return opened
            return Outcome(replicated_like(node), rule="replicated inputs")
        if name == "getitem":
            src = self.layouts[node.args[0]]
            return Outcome(src[cast(int, node.args[1])] if isinstance(src, tuple) else src,
                           rule="getitem")
        if strat.vocab_loss and name == strat.vocab_loss.op:
            return self._vocab_loss(node, lays, strat.vocab_loss)
        kind = self.rules.kind(name)
        if kind is None:
            return Outcome(None, conflict=Conflict(node, f"no rule for {name} on a sharded input"))
        return KINDS[kind].rule(node, lays, self.ctx)

    # ----------------------------------------------------------------- strategy

    def _open_column(self, node, name) -> Outcome | None:
        spec = self.openers[name]
        w = node.args[spec.weight] if len(node.args) > spec.weight else None
        view = viewed_parameter(w) if isinstance(w, fx.Node) else None
        w = view[0] if view else w
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and w.target in self.params):
            return None
        lab = labels(node, self.rules.einsum[name])
        if lab is None:
            return None
        wdim = lab[(spec.weight,)].index(spec.factor)
        if view and view[1][wdim] is None:  # the factor is the gathered rows' index
            return None
        odim = lab["out"].index(spec.factor)
        size = hint(tensor_shape(node)[odim])
        blocks = _segments(node, odim, self.ctx)
        padded = None
        r = self.replicas.get(node, 1)
        if isinstance(r, tuple) and len(r) != len(blocks or ()):
            r = max(r)  # the blocks a conflict saw are not this capture's
        reps = r if isinstance(r, tuple) else (r,) * len(blocks or [size])
        if any(b % (self.size // k) for b, k in zip(blocks or [size], reps)):
            if blocks is None and self.rules.strategy.pad_vocabulary \
                    and _only_to_sinks(node, self.ctx):
                padded = math.ceil(size / self.size) * self.size
            elif blocks is None and r == 1:
                return _too_narrow(node, size, f"{self.dim}={self.size}")
            else:
                return Outcome(None, conflict=Conflict(
                    node, f"{module_of(node) or node.name}: output size "
                          f"{'+'.join(map(str, blocks or [size]))} does not divide by "
                          f"{self.dim}={self.size}",
                    divisibility=True, sizes=tuple(blocks or [size])))
        shard = lambda d: Shard(d, blocks, padded, r)  # noqa: E731
        needs = {(spec.weight,): shard(wdim)}
        for path, _ in operands(node):
            if path != (spec.weight,) and path in lab and spec.factor in lab[path]:
                needs[path] = shard(lab[path].index(spec.factor))  # the bias
        rule = "open: column parallel" + (
            f", each block's part on {'/'.join(map(str, r))} ranks" if isinstance(r, tuple)
            else f", each part on {r} ranks" if r > 1 else "")
        return Outcome(shard(odim), needs, role=Role.COLUMN, rule=rule)

    def _open_vocab(self, node, spec: VocabEmbedding) -> Outcome | None:
        w, idx = node.args[spec.weight], node.args[spec.indices]
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and w.target in self.params):
            return None
        rows, cols = tensor_shape(w)
        if rows < spec.min_rows_per_column * cols or not _from_input(idx, self.ctx):
            return None
        padded = None
        if rows % self.size:
            if not self.rules.strategy.pad_vocabulary:
                return None
            padded = math.ceil(rows / self.size) * self.size
        return Outcome(Partial(), {(spec.weight,): Shard(0, None, padded)},
                       role=Role.VOCAB_EMBEDDING, rule="vocab-parallel embedding")

    def _vocab_loss(self, node, lays, spec: VocabLoss) -> Outcome:
        logits = lays.get((spec.logits,))
        weight = node.args[spec.weight] if len(node.args) > spec.weight else None
        if not (isinstance(logits, Shard) and logits.dim == 1 and not logits.blocks) \
                or weight is not None:
            return Outcome(None, conflict=Conflict(
                node, "cross-entropy over logits not split along the classes"))
        return Outcome(R, {(spec.logits,): logits}, role=Role.VOCAB_LOSS,
                       rule="vocab-parallel cross-entropy")


# --------------------------------------------------------------------------- strategy helpers

def _too_narrow(node: fx.Node, size: int, parts: str) -> Outcome:
    """A GEMM whose output does not split into ``parts`` (``tp=4``; a 1-wide gate, an odd
    FFN) stays replicated: a plan decision, as Megatron keeps small layers whole. Only
    a cut that the model's own structure forces (heads, fused projections) is refused."""
    return Outcome(None, conflict=Conflict(
        node, f"output size {size} does not divide by {parts}", frozenset({node}), closes=True))


def _kept_replicated(gm: fx.GraphModule, rules: RuleSet, keep: dict) -> dict:
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
                and not isinstance(keep.get(w.target), Shard):
            out[node] = ("replicated, as in the model's first capture", False)
    return out


def _segments(node: fx.Node, dim: int, ctx: Context) -> tuple[int, ...] | None:
    """How a column output is cut downstream (fused QKV): the block sizes, or None.

    ``[B, T, 3*C]`` split into three ``C`` gives ``(C, C, C)``.
    """
    size = hint(tensor_shape(node)[dim])
    bounds: set[int] = set()
    frontier = [(node, dim)]
    seen = set()
    while frontier:
        cur, d = frontier.pop()
        if cur in seen:
            continue
        seen.add(cur)
        rank = len(tensor_shape(cur))
        for user in cur.users:
            kind = ctx.kind_of(user)
            ushape = shape(user)
            if kind in ("identity", "elementwise") and ushape is not None and len(ushape) == rank \
                    and hint(ushape[d]) == size:
                frontier.append((user, d))
            elif kind == "reshape" and ushape and d == rank - 1 and \
                    keeps_last_dim([hint(x) for x in tensor_shape(cur)], [hint(x) for x in ushape]):
                frontier.append((user, len(ushape) - 1))
            elif kind == "reshape" and ushape and len(ushape) > d and \
                    [hint(x) for x in tensor_shape(cur)[:d + 1]] \
                    == [hint(x) for x in ushape[:d + 1]]:
                frontier.append((user, d))  # dims after d regrouped (bmm's [S, n, 1] squeezed)
            elif kind is not None and user.args and user.args[0] is cur:
                bounds |= KINDS[kind].cuts(user, d)
    inner = sorted(b for b in bounds if 0 < b < size)
    if not inner:
        return None
    edges = [0, *inner, size]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def _only_to_sinks(node: fx.Node, ctx: Context) -> bool:
    """Does this output reach only the graph output or a loss (an LM head's logits)?"""
    loss = ctx.rules.strategy.vocab_loss
    for user in node.users:
        kind = ctx.kind_of(user)
        if user.op == "output" or (loss and op_name(user) == loss.op) \
                or kind in ("inspect", "size"):
            continue
        if kind in ("identity", "reshape", "slice") and _only_to_sinks(user, ctx):
            continue
        return False
    return True


def _from_input(node: fx.Node, ctx: Context) -> bool:
    """Is ``node`` a graph input, through shape-only ops?"""
    while node.op == "call_function" and ctx.kind_of(node) in ("identity", "reshape", "slice"):
        node = cast(fx.Node, node.args[0])
    return node.op == "placeholder"


# --------------------------------------------------------------------------- sequence dims

def sequence_dims(gm: fx.GraphModule) -> dict:
    """node -> the dims of its value whose size is the sequence length.

    The sequence length is the symbolic token dim of the first integer input
    (token ids; else the first input): its one symbolic dim, or, with batch
    and sequence both symbolic, the one attention runs along (a softmax's
    reduced dim, SDPA's query dim), else the last (batch-first ids).
    """
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"
              and isinstance(n.meta.get("val"), torch.Tensor)]
    ints = [n for n in inputs if not n.meta["val"].is_floating_point()]
    first = (ints or inputs or [None])[0]
    syms = [] if first is None else [d.node.expr for d in first.meta["val"].shape
                                     if isinstance(d, torch.SymInt)]
    if not syms or len(set(syms)) < len(syms):
        raise ConfigurationError(
            "sequence_parallel=True needs a sequence dim of the inputs, and "
            + ("the example inputs have no symbolic dim" if not syms else
               f"the example's dims {list(first.meta['val'].shape)} share one size"),
            where=first.name if first is not None else None,
            fix="pass example_inputs whose batch size and sequence length differ "
                "(e.g. batch 2, sequence 8)")
    attended = _attended(gm)
    seq = next((s for s in syms if s in attended), syms[-1])
    out = {}
    for node in gm.graph.nodes:
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor):
            dims = {i for i, d in enumerate(v.shape) if isinstance(d, torch.SymInt)
                    and d.node.expr == seq}
            if dims:
                out[node] = frozenset(dims)
    return out


def _attended(gm: fx.GraphModule) -> set:
    """Size symbols attention runs along: softmax's reduced dim, SDPA's query dim."""
    found = set()
    for node in gm.graph.nodes:
        name = op_name(node) if node.op == "call_function" else ""
        if name in ("aten._softmax.default", "aten.softmax.int"):
            v, d = node.meta["val"], node.args[1]
        elif name == "aten.scaled_dot_product_attention.default":
            v, d = node.args[0].meta["val"], -2
        else:
            continue
        size = v.shape[d]
        if isinstance(size, torch.SymInt):
            found.add(size.node.expr)
    return found


# --------------------------------------------------------------------------- transitions

def _sequence_warnings(ann: Annotation) -> list[str]:
    """One warning per partial result without a sequence dim of its own (batch and
    sequence flattened into one dim, as HF's Conv1D does): it is all-reduced, and sliced
    onto the tokens after, instead of reduce-scattered. Where no partial result is
    reduce-scattered at all, one warning instead: sequence parallelism has no effect."""
    unscattered = [n for n, o in ann.outcomes.items()
                   if o.role in (Role.ROW, Role.PARTIAL) and isinstance(o.out, Partial)
                   and n not in ann.seq_dims and n not in ann.deferred]
    if not ann.scattered and not ann.deferred:
        why = (f"no partial result has a dim that is the sequence alone (e.g. "
               f"{describe(unscattered[0])}, output {list(message(unscattered[0]))})"
               if unscattered else "no region ends in a partial sum")
        return [f"sequence_parallel=True has no effect on this model: {why}, so no activation "
                "is held on 1/tp of the sequence and the plan is the one without sequence "
                "parallelism; pass sequence_parallel=False"]
    return [f"{describe(n)}: sequence parallel falls back to all-reduce and slice: its "
            f"output {list(message(n))} has no dim that is the sequence alone (a rank's "
            "tokens are not contiguous in a flattened batch x sequence dim)"
            for n in unscattered]


def _keeps_shard(node: fx.Node, path) -> bool:
    """Does ``node`` keep only the sequence shard of its gathered input for backward
    (a linear's input, all-gathered again for the weight's gradient)?"""
    return op_name(node) == "aten.linear.default" and path == (0,)


def _transitions(ann: Annotation) -> list[Transition]:
    """Every layout change of the annotated graph, in graph order of its consumer.

    At each node: f for each replicated tensor that enters a region (shared
    by all its consumers), a local slice for each replicated activation read
    sharded, a replica sum for each parameter part held by several ranks;
    after it, g for a partial result, or the vocab-parallel loss. Last, a
    gather for each sharded graph output.
    """
    out: list[Transition] = []
    made: dict = {}  # (src, purpose) -> index in out, for transitions shared by consumers
    vocab_loss = ann.rules.strategy.vocab_loss

    def shared(purpose, src, edge, key=(), **fields):
        key = (src, purpose, *key)
        if key in made:
            t = out[made[key]]
            out[made[key]] = _with_consumer(t, edge)
        else:
            made[key] = len(out)
            fields.setdefault("messages", (message(src),))
            out.append(Transition(purpose, src, (edge,), dtype=dtype_of(src), mesh_dim=ann.dim,
                                  **fields))

    for node, o in ann.outcomes.items():
        entering = any_sharded(o.out)
        grad_sum = Purpose.SEQ_GRAD if ann.on_tokens(node, o.out) else Purpose.F
        for path, a in operands(node):
            if path == o.bias or ann.deferred.get(a) is node or a in ann.passed:
                continue  # a bias, or a partial sum this node views or carries on: no f
            if (node, path) in ann.gathered:
                lay, purpose = ann.gathered[(node, path)]
                back = Collective.REDUCE_SCATTER if purpose is Purpose.SEQ_GATHER \
                    else Collective.LOCAL_SLICE
                shared(purpose, a, (node, path), before=lay, after=R,
                       forward=Collective.ALL_GATHER, backward=back)
                if purpose is Purpose.SEQ_GATHER and _keeps_shard(node, path):
                    shared(Purpose.SEQ_REGATHER, a, (node, path), key=block_of(module_of(node)),
                           before=lay, after=R, forward=Collective.NONE,
                           backward=Collective.ALL_GATHER)
                continue
            need, have = o.needs.get(path, R), ann.read(a)
            if not isinstance(have, Replicate) or _gathered_for_region(ann, a):
                continue
            if isinstance(need, Shard) and (a.op == "get_attr" or viewed_parameter(a)):
                # sliced when bound
                if need.replicas != 1 and ann.requires_grad.get(a):
                    shared(Purpose.REPLICA_GRAD, a, (node, path), before=need, after=need,
                           forward=Collective.NONE, backward=Collective.REPLICA_SUM,
                           messages=(_replica_sum_message(a, need),))
                continue
            if entering and ann.requires_grad.get(a):
                src, edge = (a, (node, path)) if ann.seq_dims else \
                    earlier_f(node, path, a, ann.requires_grad, Context(ann.dims, ann.rules))
                shared(grad_sum, src, edge, before=R, after=R,
                       forward=Collective.NONE, backward=Collective.ALL_REDUCE)
            if isinstance(need, Shard):
                out.append(Transition(Purpose.SPLIT, a, ((node, path),), R, need,
                                      Collective.LOCAL_SLICE, Collective.NONE, mesh_dim=ann.dim))
        if o.role is Role.VOCAB_LOSS and vocab_loss is not None:  # (a vocab loss is set)
            args = args_of(node)
            names = [x.name for x in node.target._schema.arguments]
            n = message(args[names[vocab_loss.target]])
            stats = 2 if args[names[vocab_loss.label_smoothing]] else 1  # smoothing rides along
            logits = args[names[vocab_loss.logits]]
            out.append(Transition(
                Purpose.VOCAB_LOSS, logits, ((node, (vocab_loss.logits,)),),
                o.needs[(vocab_loss.logits,)], R, Collective.ALL_REDUCE, Collective.NONE,
                # the max logit, the sum of exps (and of logits), the target's logit
                messages=(n, (stats * math.prod(n),), n), dtype=torch.float32,
                mesh_dim=ann.dim))
        elif node in ann.scattered:
            out.append(Transition(Purpose.SEQ_SCATTER, node, tuple((u, None) for u in node.users),
                                  Partial(), ann.scattered[node], Collective.REDUCE_SCATTER,
                                  Collective.ALL_GATHER, (message(node),), dtype_of(node),
                                  mesh_dim=ann.dim))
            owner = next((p for p, v in ann.deferred.items() if v is node), node)
            path = ann.outcomes[owner].bias
            bias = operand(owner, path) if path is not None else None
            if bias is not None and ann.requires_grad.get(bias):  # added per token after it
                shared(Purpose.SEQ_GRAD, bias, (owner, path), before=R, after=R,
                       forward=Collective.NONE, backward=Collective.ALL_REDUCE)
        elif isinstance(o.out, Partial) and node not in ann.deferred and node not in ann.passed:
            stat = o.role is Role.DISTRIBUTED
            maximum = stat and ann.rules.reduce[op_name(node)].distributed == "max"
            out.append(Transition(Purpose.STAT if stat else Purpose.G, node,
                                  tuple((u, None) for u in node.users), Partial(), R,
                                  Collective.ALL_REDUCE_MAX if maximum else Collective.ALL_REDUCE,
                                  Collective.NONE,
                                  (message(node),), dtype_of(node), mesh_dim=ann.dim))
    out = _bucket_grad_sums(out)
    output = next(n for n in ann.gm.graph.nodes if n.op == "output")
    for a in output.all_input_nodes:
        lay = ann.read(a)
        if isinstance(lay, Shard):
            out.append(Transition(Purpose.GATHER_OUTPUT, a, ((output, None),), lay, R,
                                  Collective.ALL_GATHER, Collective.LOCAL_SLICE,
                                  (message(a),), dtype_of(a), mesh_dim=ann.dim))
    return out


def _replica_sum_message(a: fx.Node, lay: Shard) -> tuple[int, ...]:
    """The buffer a replica sum all-reduces: the full tensor, or of a shard with a count
    per block, the blocks held by several ranks."""
    full = message(a)
    if not isinstance(lay.replicas, tuple):  # not blocked_replicas
        return full
    rows = sum(b for b, r in zip(lay.blocks or (), lay.replicas) if r > 1)
    return tuple(rows if d == lay.dim % len(full) else n for d, n in enumerate(full))


def _gathered_for_region(ann: Annotation, node: fx.Node) -> bool:
    """Was ``node`` made from the ranks' tokens gathered to enter a region (a reshape
    feeding openers)? Its gather's backward reduce-scatter sums the gradient: no f."""
    return any(ann.gathered.get((node, p), (None, None))[1] is Purpose.SEQ_GATHER
               for p, _ in operands(node))


def _bucket_grad_sums(ts: list[Transition], per_block: bool = True) -> list[Transition]:
    """The ``SEQ_GRAD``s of parameters of one block (and dtype), read only inside it, as
    one ``SEQ_GRAD_BUCKET`` where the first of them was: one all-reduce instead of one
    per norm weight, norm bias and row bias. A block's bucket stays in the block, so
    recomputation and FSDP see it there. ``per_block=False``: every parameter's
    ``SEQ_GRAD`` and bucket of one dtype in one bucket, summed once the last gradient
    is ready. An activation's ``SEQ_GRAD`` (a position embedding's output) joins its
    block's bucket where it is made before the bucket's first reader."""
    groups: dict = {}
    for i, t in enumerate(ts):
        if t.purpose in (Purpose.SEQ_GRAD_BUCKET, Purpose.SEQ_GRAD):
            block = block_of(owner_name(t.src)) if per_block else ()
            if all(block_of(module_of(c)) == block for c, _ in t.consumers) or not per_block:
                groups.setdefault((block, t.dtype, t.mesh_dim), []).append(i)
    for key, idx in groups.items():  # the bucket runs before its first reader
        first = min(c for i in idx for c, _ in ts[i].consumers)
        groups[key] = [i for i in idx if all(v.op == "get_attr" or v < first
                                              for v in ts[i].sources or (ts[i].src,))]
    first, dropped = {}, set()
    for idx in groups.values():
        if len(idx) < 2:
            continue
        members = [ts[i] for i in idx]
        first[idx[0]] = Transition(
            Purpose.SEQ_GRAD_BUCKET, members[0].src, sum((m.consumers for m in members), ()),
            R, R, Collective.NONE, Collective.ALL_REDUCE,
            messages=((sum(m.elements[0] for m in members),),), dtype=members[0].dtype,
            sources=sum((m.sources or (m.src,) for m in members), ()), mesh_dim=members[0].mesh_dim)
        dropped.update(idx[1:])
    return [first.get(i, t) for i, t in enumerate(ts) if i not in dropped]


def owner_name(node: fx.Node) -> str:
    """A parameter's name, or the module an activation is made in: where its block is."""
    return str(node.target) if node.op == "get_attr" else module_of(node)


def block_of(name: str) -> tuple:
    """(list path, index) of the outermost block ``name`` lies in; () outside blocks."""
    found = split_first(name or "")
    return found[:2] if found else ()


def _with_consumer(t: Transition, edge) -> Transition:
    return replace(t, consumers=t.consumers + (edge,))
