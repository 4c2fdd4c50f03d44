"""annotate: give every tensor of a captured graph a layout, by a rule set.

One forward pass over the graph in topological order (``layout_pass``). At
each node the rule kind of its op (``kinds.KINDS``, by the rule set's listing)
maps the operands' layouts to the output's; the Megatron strategy decides where
regions open (a GEMM on a replicated input with a parameter weight: column
parallel), and everything else follows: a GEMM that contracts a sharded
factor is row parallel and its output is ``Partial``.

A region that reaches an op the rules cannot run locally is not opened: its
opener is kept replicated and the pass is repeated (``settle``). So the result
is always correct, and efficient where the rules apply. An opener kept
replicated gets a warning unless its region merely does not close (a reduction
over the split dim, e.g. a norm of a split tensor): that is the rules working,
not a missing rule. Where a region stopped so, this module plans it the other
ways too (its reductions distributed, its shard gathered) and keeps the cheapest.

The pass ends by listing the transitions (``transition_derivation``): f
where a replicated tensor enters a region, g after each partial result, the
local slices, the vocab-parallel loss, the gathers of sharded outputs.

With ``sequence_parallel`` a partial result that has the sequence dim is
read as ``Shard(seq)`` (reduce-scattered): the ops between regions run on
this rank's tokens by the same rules, and an operand is all-gathered where a
region opens on it or where an op cannot run on the tokens alone. The
sequence dim is the symbolic token dim of the inputs, followed by its
symbol through every reshape and transpose (``sequence_dims``).
"""

from __future__ import annotations

import copy

import torch.fx as fx

from .annotation import Annotation
from ..errors import ShardplanError
from ..layouts import Layout, MeshSizes
from .graph import op_name
from .kinds import Role
from .reassociate import carry_apart, regroup
from .decompose import decomposable, decompose
from .choices import Alternative, Choice, cost_of
from .rules import RuleSet
from .settle import settle
from .transition_derivation import bucket_grad_sums
from .transitions import Purpose


def annotate(gm: fx.GraphModule, dims: MeshSizes, rules: RuleSet, *, strict: bool = False,
             sequence_parallel: bool = False, keep: dict[str, Layout] | None = None,
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
    planned = lambda g, undistributed, gather: settle(  # noqa: E731
        g, dims, rules, strict, sequence_parallel, keep, undistributed, gather)
    undistributed = _reductions(gm, rules)  # reductions kept from running distributed (all, first)
    gather: frozenset[str] = frozenset()  # names of the ops whose split operands are all-gathered
    ann = planned(gm, undistributed, gather)
    through = rules.strategy.partial_through
    for _ in gm.graph.nodes:  # x + P1 + P2 as x + (P1 + P2): one g; at most one a node
        # (and chain(P + b) as chain(P) + chain(b): the g after the chain)
        if sequence_parallel or not (regroup(gm, ann.layouts, through)
                                     or carry_apart(gm, ann.layouts, through)):
            break
        ann = planned(gm, undistributed, gather)
    regions: dict[frozenset[str], set[str]] = {}  # openers -> the ops that stopped them, by name
    for node, openers in ann.stopped.items() if distribute else ():
        if _reduction(node, undistributed):
            regions.setdefault(frozenset(o.name for o in openers), set()).add(node.name)
    for node, openers in ann.blocked.items() if distribute else ():
        regions.setdefault(frozenset(o.name for o in openers), set()).add(node.name)
    choices = []
    for origins, stops in regions.items():
        nodes = {n.name: n for n in gm.graph.nodes}
        if not stops <= nodes.keys():
            continue  # written out with an earlier region
        alts = {}
        names = {n for n in stops if _reduction(nodes[n], undistributed)}
        done = ()
        if names:
            alt, done, names = _distributed(gm, ann, planned, undistributed, gather, names, origins)
            if done:  # else none can run distributed (a max that needs its gradient)
                alts[Alternative.DISTRIBUTED] = alt
        if not sequence_parallel and not names:
            alt, gathered = _gathered(gm, ann, planned, undistributed, gather, stops, origins)
            if alt is not None:
                alts[Alternative.GATHERED] = alt
        if not alts:
            continue
        alts[Alternative.REPLICATED] = ann
        costs = {k: cost_of(a) for k, a in alts.items()}
        chosen = min((k for k in Alternative if k in costs), key=lambda k: costs[k].total)
        choices.append(Choice(done or tuple(n for n in gm.graph.nodes if n.name in stops),
                              chosen, {k: costs[k] for k in Alternative if k in costs}))
        if chosen == Alternative.DISTRIBUTED:  # the written-out graph becomes the model's
            gm.graph = alts[chosen].gm.graph
            alts[chosen].gm = gm
            ann, undistributed = alts[chosen], undistributed - names
        elif chosen == Alternative.GATHERED:
            ann, gather = alts[chosen], gather | gathered
    ann.choices = choices
    if not cut_blocks:
        ann.transitions = bucket_grad_sums(ann.transitions, per_block=False)
    return ann


def _reduction(node: fx.Node, undistributed: frozenset) -> bool:
    """Is ``node`` a reduction the rules can run distributed (or a fused norm or softmax
    written out in such)? There the choice is Megatron's: distributed or replicated."""
    return node.name in undistributed or decomposable(node)


def _reductions(gm: fx.GraphModule, rules: RuleSet) -> frozenset:
    """Names of the reductions the rules can run distributed over a split dim."""
    return frozenset(n.name for n in gm.graph.nodes if n.op == "call_function"
                     and getattr(rules.reduce.get(op_name(n)), "distributed", None))


def _distributed(gm, ann: Annotation, planned, undistributed: frozenset, gather: frozenset,
                 names: set, origins: frozenset):
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
            alt = planned(g, undistributed - names, gather)
        except ShardplanError:  # not a plan at all this way: the baseline stands
            return None, (), names
        more = {n.name for n, o in alt.stopped.items()
                if _reduction(n, undistributed) and {x.name for x in o} & origins} - names
        if not more:
            done = tuple(n for n, o in alt.outcomes.items()
                         if o.role is Role.DISTRIBUTED and n.name not in before)
            return alt, done, names
        names = names | more


def _gathered(gm, ann: Annotation, planned, undistributed: frozenset, gather: frozenset, stops: set,
              origins: frozenset):
    """``ann`` with the shards read by ``stops`` (the ops one region stopped at)
    all-gathered there, and at every further op that region then stops at, so that
    its openers stay sharded. Returns the annotation and the ops gathered at, or None
    where that gathers nothing or the openers stay replicated anyway (another conflict
    holds them)."""
    names = set(stops)
    while True:
        try:
            alt = planned(gm, undistributed, gather | names)
        except ShardplanError:  # not a plan at all this way: the baseline stands
            return None, names
        more = {n.name for n, o in alt.blocked.items()
                if not _reduction(n, undistributed) and {x.name for x in o} & origins} - names
        if not more:
            held = {n.name for n in alt.disabled}
            gathers = lambda a: sum(t.purpose is Purpose.GATHER for t in a.transitions)  # noqa: E731
            useless = origins <= held or gathers(alt) == gathers(ann)
            return (None if useless else alt), names
        names = names | more

