"""annotate: give every tensor of a captured graph a layout, by a rule set.

One forward pass over the graph in topological order. At each node the rule
kind of its op (from the rule set) maps the operands' layouts to the output's;
the Megatron strategy decides where regions open (a GEMM on a replicated
input with a parameter weight: column parallel), and everything else follows:
a GEMM that contracts a sharded factor is row parallel and its partial result
is reduced at once (g); a replicated tensor entering a region gets f.

A region that reaches an op the rules cannot run locally is not opened: its
opener is kept replicated, with a warning, and the pass is repeated. So the
result is always correct, and efficient where the rules apply.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .capture import GUARDS, module_of, source_of
from ..errors import DivisibilityError, LayoutError
from ..layouts import Partial, Replicate, Shard
from .rules import Einsum, RuleSet

R = Replicate()


@dataclass
class Conflict:
    """A sharded or partial value reaching an op that cannot run locally."""

    node: fx.Node
    reason: str
    origins: frozenset = frozenset()
    divisibility: bool = False
    no_rule: bool = False  # the rules do not know the op
    closes: bool = False  # a reduction over the split dim: the region just does not close
    replicas: int = 1  # for a divisibility conflict: replicas that would make the split divide


@dataclass
class Outcome:
    """What one rule says about one node."""

    out: object  # Layout, tuple of Layouts, or None for non-tensors
    needs: dict = field(default_factory=dict)  # operand path -> required Layout
    role: str = "local"
    rule: str = ""
    conflict: Conflict | None = None
    bias: tuple | None = None  # operand path of a bias to add after g


@dataclass
class Annotation:
    """The engine's result for one graph at one tp."""

    gm: fx.GraphModule
    tp: int
    layouts: dict  # fx.Node -> Layout | tuple | None
    outcomes: dict  # fx.Node -> Outcome
    params: dict  # get_attr target -> Layout
    requires_grad: dict  # fx.Node -> bool
    disabled: dict  # opener fx.Node -> reason it stays replicated
    warnings: list  # openers kept replicated for a reason other than a non-closing region
    rules: RuleSet


# --------------------------------------------------------------------------- graph helpers

def op_name(node: fx.Node) -> str:
    t = node.target
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, torch._ops.OpOverload):
        return f"aten.{t.__name__}" if t.namespace == "aten" else f"{t.namespace}.{t.__name__}"
    return getattr(t, "__name__", str(t))


def operands(node: fx.Node) -> list[tuple[tuple, fx.Node]]:
    """Every fx.Node argument with its path: (i,), (i, j) for lists, ("k", name)."""
    out = []
    for i, a in enumerate(node.args):
        if isinstance(a, fx.Node):
            out.append(((i,), a))
        elif isinstance(a, (list, tuple)):
            out.extend(((i, j), b) for j, b in enumerate(a) if isinstance(b, fx.Node))
    for k, a in node.kwargs.items():
        if isinstance(a, fx.Node):
            out.append((("k", k), a))
    return out


def shape(node: fx.Node) -> tuple | None:
    v = node.meta.get("val")
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def hint(d) -> int:
    """A concrete size for a (possibly symbolic) dim: its example value."""
    if isinstance(d, int):
        return d
    h = getattr(getattr(d, "node", None), "hint", None)
    return int(h) if h is not None else int(d)


def is_symbolic(d) -> bool:
    return not isinstance(d, int)


def describe(node: fx.Node) -> str:
    mod = module_of(node)
    return f"{node.name} ({op_name(node)}{' in ' + mod if mod else ''})"


# --------------------------------------------------------------------------- the pass

def annotate(gm: fx.GraphModule, tp: int, rules: RuleSet, *, strict: bool = False) -> Annotation:
    """Layouts for every node of ``gm`` under tensor parallelism ``tp``.

    Openers whose regions reach an op that cannot run locally are kept
    replicated and the pass repeats. A split that does not divide by tp is
    an error, except where holding the split dim on groups of ranks makes it
    divide and the region turns into an ordinary shard before any GEMM (K/V
    heads fewer than tp: each rank holds the K/V head its query heads use).
    """
    params = dict(gm.named_parameters(remove_duplicate=False))
    disabled: dict = {}
    replicas: dict = {}  # opener -> (replicas, the divisibility conflict that asked for them)
    while True:
        ann, conflicts = _Pass(gm, tp, rules, params, disabled,
                               {o: r for o, (r, _) in replicas.items()}).run()
        if not conflicts:
            break
        retry = False
        for c in conflicts:
            held = [o for o in c.origins if o in replicas]
            if held:
                c = replicas[held[0]][1]  # grouping ranks did not help: the split itself is wrong
                c.divisibility, c.replicas = True, 1
            if c.divisibility:
                grow = [o for o in c.origins if c.replicas > replicas.get(o, (1,))[0]]
                if c.replicas > 1 and grow:
                    for o in grow:
                        replicas[o] = (c.replicas, c)
                    retry = True
                    continue
                raise DivisibilityError(c.reason, where=describe(c.node), source=source_of(c.node),
                                        fix=f"choose tp dividing that size (tp={tp} does not)")
            if strict and not c.closes:
                raise LayoutError(c.reason, where=describe(c.node), source=source_of(c.node),
                                  fix="add a rule for this op, or drop strict=True to keep the "
                                      "region replicated")
            for o in c.origins:  # a fallback outranks a region that just does not close
                if o not in disabled or (not c.closes and not disabled[o][1]):
                    disabled[o] = (f"{c.reason} at {describe(c.node)}", not c.closes)
        if retry:
            continue
    ann.disabled = {n: why for n, (why, _) in disabled.items()}
    ann.warnings = [f"{describe(n)} kept replicated: {why}"
                    for n, (why, warn) in disabled.items() if warn]
    return ann


class _Pass:
    def __init__(self, gm, tp, rules: RuleSet, params, disabled, replicas):
        self.gm, self.tp, self.rules, self.params, self.disabled = gm, tp, rules, params, disabled
        self.replicas = replicas
        self.layouts: dict = {}
        self.origins: dict = {}  # node -> frozenset of opener nodes its layout derives from
        self.outcomes: dict = {}
        self.grad: dict = {}
        self.param_layouts: dict = {}  # target -> (Layout, origins)
        self.conflicts: list[Conflict] = []
        self.openers = {o.op: o for o in rules.strategy.open}

    def run(self):
        for node in self.gm.graph.nodes:
            self._visit(node)
        ann = Annotation(self.gm, self.tp, self.layouts, self.outcomes,
                         {t: lay for t, (lay, _) in self.param_layouts.items()},
                         self.grad, {}, [], self.rules)
        return ann, self.conflicts

    # ----------------------------------------------------------------- per node

    def _visit(self, node: fx.Node) -> None:
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
        self.grad[node] = any(self.grad.get(a, False) for _, a in ins) and _floating(node)
        origins = frozenset().union(*[self.origins.get(a, frozenset()) for _, a in ins]) \
            if ins else frozenset()
        outcome = self._rule(node, ins)
        if outcome.conflict:
            outcome.conflict.origins = outcome.conflict.origins or origins
            self.conflicts.append(outcome.conflict)
            outcome = Outcome(_replicated_like(node), rule="conflict")
        self._params_needed(node, ins, outcome, origins)
        self.outcomes[node] = outcome
        out = outcome.out
        if isinstance(out, Partial):
            out = R  # reduced at once by g
        self.layouts[node] = out
        if outcome.role in ("column",):
            origins = origins | {node}
        self.origins[node] = origins if _any_sharded(out) else frozenset()

    def _params_needed(self, node, ins, outcome: Outcome, origins) -> None:
        """Record layouts required of parameters/buffers; disagreeing uses conflict."""
        if outcome.role in ("column", "vocab_embedding"):
            origins = origins | {node}
        for path, a in ins:
            if a.op != "get_attr":
                continue
            need = outcome.needs.get(path, R)
            have = self.param_layouts.get(a.target)
            if have is None:
                self.param_layouts[a.target] = (need, origins)
            elif have[0] != need:
                self.conflicts.append(Conflict(
                    node, f"{a.target} is needed as {have[0]} and as {need}",
                    have[1] | origins | {node}))

    def _rule(self, node: fx.Node, ins) -> Outcome:
        name = op_name(node)
        lays = {p: self.layouts.get(a, R) for p, a in ins}
        all_rep = all(not _any_sharded(l) for l in lays.values())
        strat = self.rules.strategy
        if all_rep:
            if name in self.openers and node not in self.disabled:
                opened = self._open_column(node, name)
                if opened:
                    return opened
            if strat.vocab_embedding and name == strat.vocab_embedding.op and node not in self.disabled:
                opened = self._open_vocab(node)
                if opened:
                    return opened
            return Outcome(_replicated_like(node), rule="replicated inputs")
        if name == "getitem":
            src = self.layouts[node.args[0]]
            return Outcome(src[node.args[1]] if isinstance(src, tuple) else src, rule="getitem")
        if strat.vocab_loss and name == strat.vocab_loss.op:
            return self._vocab_loss(node, lays)
        kind = self.rules.kind(name)
        if kind is None:
            return Outcome(None, conflict=Conflict(node, f"no rule for {name} on a sharded input",
                                                   no_rule=True))
        return getattr(self, f"_{kind}")(node, lays)

    # ----------------------------------------------------------------- strategy

    def _open_column(self, node, name) -> Outcome | None:
        spec = self.openers[name]
        w = node.args[spec.weight] if len(node.args) > spec.weight else None
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and w.target in self.params):
            return None
        es = self.rules.einsum[name]
        labels = _labels(node, es)
        if labels is None:
            return None
        wdim = labels[(spec.weight,)].index(spec.factor)
        odim = labels["out"].index(spec.factor)
        size = hint(shape(node)[odim])
        blocks = _segments(node, odim, self.rules)
        padded = None
        r = self.replicas.get(node, 1)
        if any(b % (self.tp // r) for b in (blocks or [size])):
            if blocks is None and self.rules.strategy.pad_vocabulary and _only_to_sinks(node, self.rules):
                padded = math.ceil(size / self.tp) * self.tp
            else:
                return _conflict(node, f"{module_of(node) or node.name}: output size "
                                 f"{'+'.join(map(str, blocks or [size]))} does not divide by tp={self.tp}",
                                 divisibility=True)
        shard = lambda d: Shard(d, blocks, padded, r)  # noqa: E731
        needs = {(spec.weight,): shard(wdim)}
        for path, _ in operands(node):
            if path != (spec.weight,) and path in labels and spec.factor in labels[path]:
                needs[path] = shard(labels[path].index(spec.factor))  # the bias
        rule = "open: column parallel" + (f", each part on {r} ranks" if r > 1 else "")
        return Outcome(shard(odim), needs, role="column", rule=rule)

    def _open_vocab(self, node) -> Outcome | None:
        spec = self.rules.strategy.vocab_embedding
        w, idx = node.args[spec.weight], node.args[spec.indices]
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and w.target in self.params):
            return None
        rows, cols = shape(w)
        if rows < spec.min_rows_per_column * cols or not _from_input(idx, self.rules):
            return None
        padded = None
        if rows % self.tp:
            if not self.rules.strategy.pad_vocabulary:
                return None
            padded = math.ceil(rows / self.tp) * self.tp
        return Outcome(Partial(), {(spec.weight,): Shard(0, None, padded)},
                       role="vocab_embedding", rule="vocab-parallel embedding")

    def _vocab_loss(self, node, lays) -> Outcome:
        spec = self.rules.strategy.vocab_loss
        logits = lays.get((spec.logits,))
        weight = node.args[spec.weight] if len(node.args) > spec.weight else None
        if not (isinstance(logits, Shard) and logits.dim == 1 and not logits.blocks) or weight is not None:
            return _conflict(node, "cross-entropy over logits not split along the classes")
        return Outcome(R, {(spec.logits,): logits}, role="vocab_loss",
                       rule="vocab-parallel cross-entropy")

    # ----------------------------------------------------------------- rule kinds

    def _einsum(self, node, lays) -> Outcome:
        es: Einsum = self.rules.einsum[op_name(node)]
        labels = _labels(node, es)
        if labels is None:
            return _conflict(node, f"{op_name(node)}: operands do not match '{es.sig}'")
        return _factor_rule(node, lays, labels, self.tp, partial_ok=es.partial,
                            shardable=es.shardable, rule=f"einsum {es.sig}")

    def _elementwise(self, node, lays) -> Outcome:
        out_rank = len(shape(node) or ())
        labels = {p: [f"d{out_rank - len(shape(a)) + i}" for i in range(len(shape(a)))]
                  for p, a in operands(node) if shape(a) is not None}
        labels["out"] = [f"d{i}" for i in range(out_rank)]
        return _factor_rule(node, lays, labels, self.tp, partial_ok=False, shardable=None,
                            rule="elementwise")

    def _inspect(self, node, lays) -> Outcome:
        """Ops that only check their input (metadata asserts): no output to lay out."""
        return Outcome(None, rule="inspect")

    def _size(self, node, lays) -> Outcome:
        """A size query: fine unless it asks for the size of the split dim."""
        lay = lays[(0,)]
        dim = node.args[1] if len(node.args) > 1 else None
        if dim is None or dim % len(shape(node.args[0])) == lay.dim:
            return _conflict(node, f"{op_name(node)} asks for the size of the sharded dim")
        return Outcome(None, rule="size of another dim")

    def _identity(self, node, lays) -> Outcome:
        """One tensor in, same layout out; other operands only lend a dtype (type_as)."""
        return Outcome(lays.get((0,), R), rule="identity")

    def _reshape(self, node, lays) -> Outcome:
        lay = lays[(0,)]
        src, dst = shape(node.args[0]), shape(node)
        src_h, src_sym = [hint(d) for d in src], [is_symbolic(d) for d in src]
        if lay.replicas > 1 and _merges_expanded_copies(node, lay):
            d = lay.dim  # the copies of each part are split between the ranks holding it
            src_h[d:d + 2] = [src_h[d] * src_h[d + 1]]
            src_sym[d:d + 2] = [False]
            lay = Shard(d)
        res = _map_reshape(lay, src_h, [hint(d) for d in dst], src_sym,
                           [is_symbolic(d) for d in dst], self.tp)
        if isinstance(res, Conflict):
            res.node = node
            return Outcome(None, conflict=res)
        return Outcome(res, rule="reshape")

    def _permute(self, node, lays) -> Outcome:
        lay = lays[(0,)]
        rank = len(shape(node))
        name = op_name(node)
        if name.endswith("transpose.int"):
            a, b = (d % rank for d in node.args[1:3])
            perm = list(range(rank))
            perm[a], perm[b] = b, a
        elif name.endswith("t.default"):
            perm = list(range(rank))[::-1]
        else:
            perm = [d % rank for d in node.args[1]]
        return Outcome(_with_dim(lay, perm.index(lay.dim)), rule="permute")

    def _expand(self, node, lays) -> Outcome:
        lay = lays[(0,)]
        src, dst = shape(node.args[0]), shape(node)
        d = lay.dim + len(dst) - len(src)
        if hint(dst[d]) != hint(src[lay.dim]):
            return _conflict(node, "expand along a sharded dim")
        if lay.replicas > 1:  # broadcast copies of a part held by several ranks: split them
            e = lay.dim + 1
            copies = hint(dst[d + 1]) if e < len(src) and hint(src[e]) == 1 else 0
            one_each = lay.local_size(hint(src[lay.dim]), self.tp) == 1  # one K/V head per rank
            if not one_each or copies % lay.replicas or not all(
                    self.rules.kind(op_name(u)) == "reshape" for u in node.users):
                return _conflict(node, "expand of a dim held by groups of ranks")
        return Outcome(_with_dim(lay, d), rule="expand")

    def _split(self, node, lays) -> Outcome:
        lay = lays[(0,)]
        name = op_name(node)
        rank = len(shape(node.args[0]))
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) \
            if "unbind" not in name else (node.args[1] if len(node.args) > 1 else 0)
        dim %= rank
        pieces = [tuple(v.shape) for v in node.meta["val"]]
        if dim != lay.dim:
            d = lay.dim - (1 if "unbind" in name and lay.dim > dim else 0)
            return Outcome(tuple(_with_dim(lay, d) for _ in pieces), rule="split (other dim)")
        sizes = [hint(p[dim]) for p in pieces]
        groups = _group_blocks(lay, sizes) if lay.replicas == 1 else None
        if groups is None:
            return _conflict(node, f"split {sizes} across the sharded dim does not follow its "
                                   f"blocks {lay.blocks}")
        return Outcome(tuple(Shard(dim, g if len(g) > 1 else None) for g in groups),
                       rule="split (sharded dim, by blocks)")

    def _slice(self, node, lays) -> Outcome:
        lay = lays[(0,)]
        name = op_name(node)
        rank = len(shape(node.args[0]))
        dim = (node.args[1] if len(node.args) > 1 else 0) % rank
        if dim != lay.dim:
            d = lay.dim - (1 if name.endswith("select.int") and lay.dim > dim else 0)
            return Outcome(_with_dim(lay, d), rule="slice (other dim)")
        if name.endswith("select.int"):
            return _conflict(node, "select on the sharded dim")
        full = hint(shape(node.args[0])[dim])
        start, stop = _slice_range(node, name, full)
        if start is None:
            return _conflict(node, "strided slice on the sharded dim")
        bounds = list(_cumsum(lay.blocks or [full]))
        if start not in bounds or stop not in bounds or lay.padded or lay.replicas > 1:
            return _conflict(node, f"slice [{start}:{stop}] cuts a block of the sharded dim")
        inner = [b for b, s in zip(lay.blocks or [full], bounds) if start <= s - b and s <= stop]
        return Outcome(Shard(dim, tuple(inner) if len(inner) > 1 else None),
                       rule="slice (sharded dim, whole blocks)")

    def _concat(self, node, lays) -> Outcome:
        dim = node.args[1] if len(node.args) > 1 else 0
        rank = len(shape(node))
        dim %= rank
        ls = [lays[(0, j)] for j in range(len(node.args[0]))]
        if any(not isinstance(l, Shard) for l in ls) or len({l.dim for l in ls}) != 1:
            return _conflict(node, "cat of sharded and replicated tensors")
        if ls[0].dim != dim:
            if len(set(ls)) != 1:
                return _conflict(node, "cat of differently sharded tensors")
            return Outcome(ls[0], rule="cat (other dim)")
        blocks = []
        for l, (_, a) in zip(ls, [(p, a) for p, a in operands(node)]):
            if l.padded:
                return _conflict(node, "cat of padded shards")
            blocks.extend(l.blocks or [hint(shape(a)[dim])])
        return Outcome(Shard(dim, tuple(blocks)), rule="cat (sharded dim: blocks)")

    def _reduce(self, node, lays) -> Outcome:
        lay = lays[(0,)]
        if not isinstance(lay, Shard):
            return _conflict(node, f"{op_name(node)} on a tensor sharded only in a secondary operand")
        src = shape(node.args[0])
        rank = len(src)
        spec = self.rules.reduce[op_name(node)].dim
        if spec == "all":
            dims = set(range(rank))
        elif spec.startswith("last:"):
            dims = set(range(rank - len(node.args[int(spec[5:])]), rank))
        else:
            arg = node.args[int(spec)] if len(node.args) > int(spec) else None
            arg = list(range(rank)) if arg is None else ([arg] if isinstance(arg, int) else arg)
            dims = {d % rank for d in arg}
        if lay.dim in dims:
            return Outcome(None, conflict=Conflict(
                node, f"{op_name(node)} reduces over the sharded dim", closes=True))
        out_rank = len(shape(node))
        d = lay.dim if out_rank == rank else lay.dim - sum(1 for x in dims if x < lay.dim)
        needs = {p: R for p in lays if p != (0,)}
        for p, a in operands(node):
            if p != (0,) and _any_sharded(lays[p]):
                return _conflict(node, f"{op_name(node)} with a sharded secondary operand")
        return Outcome(_with_dim(lay, d), needs, rule=f"reduce over {sorted(dims)}")


# --------------------------------------------------------------------------- rule helpers

def _conflict(node, reason, divisibility=False) -> Outcome:
    return Outcome(None, conflict=Conflict(node, reason, divisibility=divisibility))


def _replicated_like(node):
    v = node.meta.get("val")
    if isinstance(v, (tuple, list)):
        return tuple(R if isinstance(x, torch.Tensor) else None for x in v)
    return R if isinstance(v, torch.Tensor) else None


def _any_sharded(lay) -> bool:
    if isinstance(lay, tuple):
        return any(_any_sharded(x) for x in lay)
    return isinstance(lay, (Shard, Partial))


def _floating(node) -> bool:
    v = node.meta.get("val")
    if isinstance(v, (tuple, list)):
        return any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in v)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _with_dim(lay: Shard, d: int) -> Shard:
    return Shard(d, lay.blocks, lay.padded, lay.replicas)


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def _labels(node, es: Einsum) -> dict | None:
    """Factor letters per operand dim (and "out"), expanding '...' from the right.

    An operand with fewer dims than its spec broadcasts (an attention mask
    [T, T] against '...hqk'): its dims are the spec's last ones. Broadcasting
    adds no dims to the output, so an operand with more '...' dims than the
    output does not match (matmul with a 1-D operand drops a dim instead).
    """
    rank = len(shape(node))
    out_body = es.output.removeprefix("...")
    if rank < len(out_body):
        return None
    out: dict = {"out": _expand_labels(es.output, rank)}
    batch = rank - len(out_body)
    for p, a in operands(node):
        if shape(a) is None or len(p) != 1 or p[0] >= len(es.operands):
            continue
        spec = es.operands[p[0]]
        out[p] = _expand_labels(spec, len(shape(a)))
        if out[p] is None or len(shape(a)) - len(spec.removeprefix("...")) > batch:
            return None
    return out if out["out"] is not None else None


def _expand_labels(spec: str, rank: int) -> list[str] | None:
    """Letters for ``rank`` dims: '...' as ".n" … ".1"; fewer dims take the last letters."""
    body = spec.removeprefix("...")
    if rank <= len(body):
        return list(body[len(body) - rank:])
    if spec.startswith("..."):
        n = rank - len(body)
        return [f".{n - i}" for i in range(n)] + list(body)
    return None


def _factor_rule(node, lays, labels, tp, *, partial_ok, shardable, rule) -> Outcome:
    """The shared rule of einsum and elementwise ops: one sharded factor at most.

    An operand of size 1 along the sharded factor (or without it) broadcasts
    and is used whole. One with a smaller size that divides the full one is
    grouped (SDPA's enable_gqa: query head i uses K/V head i // (H / KV)):
    contiguous shards of both pair up when that size divides by tp.
    """
    sizes: dict = {}
    for p, lab in labels.items():
        shp = shape(node) if p == "out" else shape(_operand(node, p))
        for f, d in zip(lab, shp):
            sizes[f] = max(sizes.get(f, 1), hint(d))
    sharded: dict = {}
    for p, lay in lays.items():
        if isinstance(lay, Shard):
            if p not in labels:
                return _conflict(node, "sharded operand outside the op's signature")
            f = labels[p][lay.dim]
            key = (lay.blocks, lay.padded, lay.replicas)
            if lay.replicas > 1 and not rule.startswith("elementwise"):
                return _conflict(node, f"{op_name(node)} on a dim held by groups of ranks")
            if sharded.setdefault(f, key) != key:
                return _conflict(node, "operands sharded with different blocks")
    if len(sharded) > 1:
        return _conflict(node, f"operands sharded on different dims ({', '.join(sharded)})")
    (f, (blocks, padded, replicas)), = sharded.items()
    if shardable is not None and not (f in shardable or (f.startswith(".") and "." in shardable)):
        return _conflict(node, f"factor {f!r} of {op_name(node)} cannot be sharded")
    needs, bias = {}, None
    for p, lab in labels.items():
        if p == "out":
            continue
        size = hint(shape(_operand(node, p))[lab.index(f)]) if f in lab else 1
        if size == 1:
            needs[p] = R
        elif size == sizes[f] or (sizes[f] % size == 0 and size % tp == 0
                                  and not (blocks or padded)):
            needs[p] = Shard(lab.index(f), blocks, padded, replicas)
        else:
            return _conflict(node, f"{op_name(node)}: operand {p} has {size} of the "
                                   f"{sizes[f]} along the sharded factor {f!r}")
    if f in labels["out"]:
        return Outcome(Shard(labels["out"].index(f), blocks, padded, replicas), needs, rule=rule)
    if not partial_ok or padded:
        return _conflict(node, f"{op_name(node)} contracts the sharded factor {f!r}")
    for p, lab in labels.items():
        if p != "out" and f not in lab:
            bias = p
    is_row = any(_operand(node, p).op == "get_attr" for p, n in needs.items() if isinstance(n, Shard))
    return Outcome(Partial(), needs, role="row" if is_row else "partial", rule=rule, bias=bias)


def _operand(node, path):
    a = node.args[path[0]] if path[0] != "k" else node.kwargs[path[1]]
    return a[path[1]] if len(path) == 2 and path[0] != "k" else a


def _map_reshape(lay: Shard, src, dst, src_sym, dst_sym, tp) -> Shard | Conflict:
    """Where a shard of ``src`` lands in ``dst`` after a row-major reshape, or why not."""
    def fail(reason, **kw):
        return Conflict(None, reason, **kw)

    groups = _reshape_groups(src, dst)
    if groups is None:
        return fail("reshape groups do not match")
    for (a, b), (c, e) in groups:
        if a <= lay.dim < b:
            break
    if any(src_sym[a:b]) or any(dst_sym[c:e]):
        return fail("reshape mixes the sharded dim with batch/sequence dims")
    if lay.padded:
        if (b - a, e - c) == (1, 1):
            return Shard(c, None, lay.padded)
        return fail("reshape of a padded dim")
    parts = tp // lay.replicas
    inner = math.prod(src[lay.dim + 1:b])
    flat = [blk * inner for _ in range(math.prod(src[a:lay.dim]))
            for blk in (lay.blocks or [src[lay.dim]])]
    for j in range(c, e):
        row = dst[j] * math.prod(dst[j + 1:e])
        inner_out = math.prod(dst[j + 1:e])
        rows, cur, ok = [], [], True
        for blk in flat:
            cur.append(blk)
            if sum(cur) == row:
                rows.append(cur)
                cur = []
            elif sum(cur) > row:
                ok = False
                break
        if not ok or cur or any(r != rows[0] for r in rows):
            continue
        if any(blk % inner_out for blk in rows[0]):
            continue
        counts = [blk // inner_out for blk in rows[0]]
        if all(n == 1 for n in counts) and j < e - 1:
            continue  # a dim enumerating the blocks, or a new size-1 dim: the shard lies inside
        if any(n % parts for n in counts):  # the major dim carries the shard (heads): no
            needed = tp // math.gcd(counts[0], tp) if len(counts) == 1 else 1  # moving it inward
            return fail(f"split of a sharded dim into {[dst[k] for k in range(c, e)]} does not "
                        f"divide by tp={tp} (e.g. heads not divisible by tp)",
                        divisibility=True, replicas=needed)
        blocks = tuple(counts)
        return Shard(j, blocks if len(blocks) > 1 else None, None, lay.replicas)
    return fail(f"reshape {list(src)} -> {list(dst)} cuts the shard")


def _merges_expanded_copies(node: fx.Node, lay: Shard) -> bool:
    """Is ``node`` a reshape merging ``lay``'s dim with the next one, made by an expand
    from size 1 (a repeat of K/V heads for grouped-query attention)?"""
    src = node.args[0]
    d = lay.dim
    if op_name(src) != "aten.expand.default" or lay.blocks or lay.padded:
        return False
    before = shape(src.args[0])
    off = len(shape(src)) - len(before)
    if d + 1 - off >= len(before) or hint(before[d + 1 - off]) != 1:
        return False
    dst = [hint(x) for x in shape(node)]
    src_h = [hint(x) for x in shape(src)]
    merged = src_h[:d] + [src_h[d] * src_h[d + 1]] + src_h[d + 2:]
    return _reshape_groups(merged, dst) is not None and \
        hint(shape(src)[d + 1]) % lay.replicas == 0


def _reshape_groups(src, dst):
    """Pair runs of dims with equal products: [((a, b), (c, e)), ...].

    Size-1 dims facing each other pair up; one that appears on one side only
    joins the run after it (a new head dim of size 1 is the major dim of what
    follows); trailing ones join the last run.
    """
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        if i < len(src) and j < len(dst) and src[i] == 1 and dst[j] == 1:
            groups.append(((i, i + 1), (j, j + 1)))  # a size-1 dim on both sides: kept
            i, j = i + 1, j + 1
            continue
        a, c = i, j
        while i < len(src) and src[i] == 1:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i == len(src) and j == len(dst):  # only size-1 dims were left
            if groups:
                (ga, _), (gc, _) = groups[-1]
                groups[-1] = ((ga, i), (gc, j))
            else:
                groups.append(((a, i), (c, j)))
            break
        if i == len(src) or j == len(dst):
            return None
        ps, pd = src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd and i < len(src):
                ps *= src[i]; i += 1  # noqa: E702
            elif pd < ps and j < len(dst):
                pd *= dst[j]; j += 1  # noqa: E702
            else:
                return None
        groups.append(((a, i), (c, j)))
    return groups


def _group_blocks(lay: Shard, sizes: list[int]):
    """Split a sharded dim's blocks into consecutive groups of the given sizes."""
    if lay.padded:
        return None
    blocks = list(lay.blocks or [sum(sizes)])
    groups = []
    for s in sizes:
        g = []
        while blocks and sum(g) < s:
            g.append(blocks.pop(0))
        if sum(g) != s:
            return None
        groups.append(tuple(g))
    return groups


def _slice_range(node, name, full):
    if name.endswith("narrow.default"):
        start, length = node.args[2], node.args[3]
        return start % full if start < 0 else start, (start % full if start < 0 else start) + length
    start = node.args[2] if len(node.args) > 2 else 0
    stop = node.args[3] if len(node.args) > 3 else full
    step = node.args[4] if len(node.args) > 4 else 1
    if step != 1 or not isinstance(start, int) or not isinstance(stop, int):
        return None, None
    start = 0 if start is None else (start + full if start < 0 else start)
    stop = full if stop is None else (stop + full if stop < 0 else min(stop, full))
    return start, stop


def _segments(node: fx.Node, dim: int, rules: RuleSet) -> tuple[int, ...] | None:
    """How a column output is cut downstream (fused QKV): the block sizes, or None."""
    size = hint(shape(node)[dim])
    bounds: set[int] = set()
    frontier = [(node, dim)]
    seen = set()
    while frontier:
        cur, d = frontier.pop()
        if cur in seen:
            continue
        seen.add(cur)
        rank = len(shape(cur))
        for user in cur.users:
            name = op_name(user)
            kind = rules.kind(name)
            ushape = shape(user)
            if kind in ("identity", "elementwise") and ushape is not None and len(ushape) == rank \
                    and hint(ushape[d]) == size:
                frontier.append((user, d))
            elif kind == "reshape" and ushape and d == rank - 1 and _keeps_last_dim(cur, user):
                frontier.append((user, len(ushape) - 1))
            elif kind == "split":
                sdim = user.args[2] if len(user.args) > 2 else 0
                if "unbind" not in name and sdim % rank == d:
                    bounds.update(_cumsum(hint(v.shape[d]) for v in user.meta["val"]))
            elif kind == "slice" and not name.endswith("select.int"):
                sdim = (user.args[1] if len(user.args) > 1 else 0) % rank
                if sdim == d:
                    start, stop = _slice_range(user, name, size)
                    if start is not None:
                        bounds.update({start, stop})
    bounds = sorted(b for b in bounds if 0 < b < size)
    if not bounds:
        return None
    edges = [0, *bounds, size]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def _keeps_last_dim(src: fx.Node, node: fx.Node) -> bool:
    """Does the reshape ``node`` leave ``src``'s last dim whole (regrouping only the others)?"""
    groups = _reshape_groups([hint(d) for d in shape(src)], [hint(d) for d in shape(node)])
    if not groups:
        return False
    (a, b), (c, e) = groups[-1]
    return b - a == 1 and e - c == 1


def _only_to_sinks(node: fx.Node, rules: RuleSet) -> bool:
    """Does this output reach only the graph output or a loss (an LM head's logits)?"""
    loss = rules.strategy.vocab_loss.op if rules.strategy.vocab_loss else None
    for user in node.users:
        name = op_name(user)
        if user.op == "output" or name == loss or rules.kind(name) in ("inspect", "size"):
            continue
        if rules.kind(name) in ("identity", "reshape", "slice") and _only_to_sinks(user, rules):
            continue
        return False
    return True


def _from_input(node: fx.Node, rules: RuleSet) -> bool:
    """Is ``node`` a graph input, through shape-only ops?"""
    while node.op == "call_function" and rules.kind(op_name(node)) in ("identity", "reshape", "slice"):
        node = node.args[0]
    return node.op == "placeholder"
