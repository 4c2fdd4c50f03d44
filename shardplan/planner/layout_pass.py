"""layout_pass: one walk over a captured graph giving every tensor a layout.

In topological order, the rule kind of each node's op (``kinds.KINDS``, by
the rule set's listing) maps the operands' layouts to the output's; the
Megatron strategy decides where regions open (a GEMM on a replicated input
with a parameter weight: column parallel, a large embedding: vocab parallel),
and everything else follows: a GEMM that contracts a sharded factor is row
parallel and its output is ``Partial``. An op that cannot run on its parts
is a ``Conflict``, collected for ``settle`` to resolve; the walk itself
never backtracks.

Under sequence parallelism, operands held on the ranks' tokens are gathered
where a region opens on them or where an op cannot run on the tokens alone.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.fx as fx

from .annotation import R, Annotation, Edge, read_as
from .capture import GUARDS, module_of
from ..layouts import Layout, MeshSizes, Partial, Shard
from .graph import floating, hint, op_name, operands, shape, tensor_shape
from .kinds import KINDS, Conflict, Context, Outcome, Role
from .kinds.base import any_sharded, replicated_like
from .kinds.factors import labels
from .kinds.permute import experts_view, parameter_layout, viewed_parameter
from .reshape import keeps_last_dim
from .rules import RuleSet, VocabEmbedding, VocabLoss
from .split_params import split_parameter
from .transitions import Purpose


class LayoutPass:
    """One walk over ``gm`` (``run``) with the decisions taken so far: the openers kept
    replicated (``disabled``: opener -> (reason, warn)), the ranks per part of each
    opener held by groups of ranks (``replicas``), the parameters held split with
    their views (``split``), the reductions kept from running distributed
    (``undistributed``) and the ops whose split operands are all-gathered for them
    (``gather``, by name)."""

    def __init__(self, gm: fx.GraphModule, dims: MeshSizes, rules: RuleSet,
                 params: dict[str, torch.nn.Parameter], disabled: dict[fx.Node, tuple[str, bool]],
                 replicas: dict[fx.Node, int | tuple[int, ...]],
                 seq_dims: dict[fx.Node, frozenset[int]], undistributed: frozenset[str],
                 split: dict[fx.Node, tuple[Shard, fx.Node]], gather: frozenset[str] = frozenset()):
        self.gm, self.rules, self.params, self.disabled = gm, rules, params, disabled
        self.split = split
        self.gather = gather
        # parameters (and their views) found needed split by this pass, for the next
        self.wanted: dict[fx.Node, tuple[Shard, fx.Node]] = {}
        self.grad: dict[fx.Node, bool] = {}
        self.ctx = Context(dims, rules, undistributed, self.grad)
        self.dim, self.size = self.ctx.dim, self.ctx.size  # the mesh dim planned, its ranks
        self.replicas = replicas
        self.seq_dims = seq_dims  # empty unless sequence parallel
        self.scattered: dict[fx.Node, Shard] = {}
        self.gathered: dict[Edge, tuple[Shard, Purpose]] = {}
        self.deferred: dict[fx.Node, fx.Node] = {}
        self.layouts: dict[fx.Node, Layout | tuple | None] = {}
        self.origins: dict[fx.Node, frozenset[fx.Node]] = {}  # the openers a layout derives from
        self.outcomes: dict[fx.Node, Outcome] = {}
        # get_attr target -> (its layout, the openers that asked for it)
        self.param_layouts: dict[str, tuple[Layout, frozenset[fx.Node]]] = {}
        self.conflicts: list[Conflict] = []
        self.openers = {o.op: o for o in rules.strategy.open}

    def run(self) -> tuple[Annotation, list[Conflict]]:
        """The annotation this walk gives (its transitions not yet listed), and the
        conflicts it met."""
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
                target = cast(str, node.target)
                self.param_layouts[target] = (lay, frozenset({node}))
                self.grad[node] = self.params[target].requires_grad
            else:
                self.grad[node] = self.grad[cast(fx.Node, node.args[0])] and floating(node)
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
            src = self.layouts[cast(fx.Node, node.args[0])]
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
            kind = ctx.kind_at(user)
            ushape = shape(user)
            if kind.per_element and ushape is not None and len(ushape) == rank \
                    and hint(ushape[d]) == size:
                frontier.append((user, d))
            elif kind.name == "reshape" and ushape and d == rank - 1 and \
                    keeps_last_dim([hint(x) for x in tensor_shape(cur)], [hint(x) for x in ushape]):
                frontier.append((user, len(ushape) - 1))
            elif kind.name == "reshape" and ushape and len(ushape) > d and \
                    [hint(x) for x in tensor_shape(cur)[:d + 1]] \
                    == [hint(x) for x in ushape[:d + 1]]:
                frontier.append((user, d))  # dims after d regrouped (bmm's [S, n, 1] squeezed)
            elif user.args and user.args[0] is cur:
                bounds |= kind.cuts(user, d)
    inner = sorted(b for b in bounds if 0 < b < size)
    if not inner:
        return None
    edges = [0, *inner, size]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def _only_to_sinks(node: fx.Node, ctx: Context) -> bool:
    """Does this output reach only the graph output or a loss (an LM head's logits)?"""
    loss = ctx.rules.strategy.vocab_loss
    for user in node.users:
        kind = ctx.kind_at(user)
        if user.op == "output" or (loss and op_name(user) == loss.op) or kind.metadata_only:
            continue
        if kind.keeps_element_order and _only_to_sinks(user, ctx):
            continue
        return False
    return True


def _from_input(node: fx.Node, ctx: Context) -> bool:
    """Is ``node`` a graph input, through ops that keep its elements' order?"""
    while node.op == "call_function" and ctx.kind_at(node).keeps_element_order:
        node = cast(fx.Node, node.args[0])
    return node.op == "placeholder"
