"""rewrite: an annotated graph -> the graph one rank runs.

Executes the annotation's transitions on a copy of its graph (the
annotation is never changed): f, g, local slices, replica sums and output
gathers become named modules (``tp_f_0``, ``tp_g_3``); the ops whose role
says so are replaced (the vocab-parallel lookup and loss, random ops on a
sharded region); a row-parallel bias moves after its g; and each kind
rewrites its size arguments for the local shard. Each inserted collective
runs over this rank's group along its transition's mesh dimension (``groups``);
the ops replaced by role, over the group of the dimension the annotation
plans. Parameters are bound separately (``bind``), so every capture of one
model shares the same shards.
"""

from __future__ import annotations

import copy
import operator
import warnings
from collections.abc import Mapping
from typing import cast

import torch
import torch.fx as fx
import torch.nn as nn

from .annotation import Annotation, Edge
from .capture import module_of
from .graph import args_of, op_name, operand, operands, replace_operand, set_arg, tensor_shape
from .kinds import KINDS, Role
from .purposes import PURPOSES
from .rules import VocabEmbedding, VocabLoss
from .token_order import keep_gathered_order
from .transitions import Purpose, Transition
from ..errors import ConfigurationError
from ..layouts import MeshDim, Shard
from ..runtime.comm import Group
from ..runtime.graph_ops import GatherShard, ModelParallelRNG, VocabLookup
from ..torch_compat import OpOverload

aten = torch.ops.aten


def rewrite(ann: Annotation, groups: Mapping[MeshDim, Group], *, gather_output: bool = True,
            device: torch.device | None = None) -> fx.GraphModule:
    """The graph this rank runs: a rewritten copy of ``ann.gm`` (sharing its tensors).

    ``groups``: this rank's group along each mesh dimension the annotation acts on
    (``{MeshDim.TP: group}``), of the annotation's size there."""
    _check_groups(ann, groups)
    gm, env = _copy(ann.gm)
    rw = _Rewriter(ann, groups, gm, env)
    rw.run()
    keep_gathered_order(gm, rw.group.size, {node: ann.outcomes[orig].out
                                            for orig, node in env.items() if orig in ann.outcomes})
    if gather_output:
        rw.gather_outputs()
    if device is not None:
        _retarget_devices(gm.graph, device)
    gm.graph.lint()
    gm.recompile()
    return gm


def _check_groups(ann: Annotation, groups: Mapping[MeshDim, Group]) -> None:
    """A group for the planned dim and every transition's, each of the annotated size."""
    for dim in dict.fromkeys([ann.dim, *(t.mesh_dim for t in ann.transitions)]):
        group, size = groups.get(dim), ann.dims.get(dim)
        if group is None:
            raise ConfigurationError(
                f"no group for mesh dimension {dim}: rewrite was given groups for "
                f"{', '.join(map(str, groups)) or 'none'}", where="rewrite",
                fix=f"pass groups={{MeshDim.{dim.name}: group}}, this rank's group along {dim}")
        if group.size != size:
            raise ConfigurationError(
                f"the group for mesh dimension {dim} has {group.size} ranks, but the "
                f"annotation planned {dim}={size}", where="rewrite",
                fix=f"annotate with the group's size ({dim}={group.size}), or pass the group "
                    "the annotation was made for")


def _copy(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict]:
    """A copy of ``gm`` whose graph and modules are new and whose tensors are shared."""
    memo = {id(t): t for t in [*gm.parameters(), *gm.buffers()]}
    with warnings.catch_warnings():  # torch's own pytree deprecation, inside deepcopy
        warnings.simplefilter("ignore", FutureWarning)
        new = copy.deepcopy(gm, memo)
    return new, dict(zip(gm.graph.nodes, new.graph.nodes))


class _Rewriter:
    def __init__(self, ann: Annotation, groups: Mapping[MeshDim, Group], gm: fx.GraphModule,
                 env: dict[fx.Node, fx.Node]):
        self.ann, self.groups, self.gm, self.graph = ann, groups, gm, gm.graph
        self.group = groups[ann.dim]  # the planned dim's: the ops replaced by role run on it
        self.env = env  # annotated node -> the node computing it here
        self.reduced: dict[fx.Node, fx.Node] = {}  # annotated partial -> the node of its sum
        # (src, purpose) -> the node of a transition shared by consumers
        self.shared: dict[tuple[fx.Node, Purpose], fx.Node] = {}
        # (src, SEQ_GRAD_BUCKET) -> a bucket's outputs, by annotated source
        self.buckets: dict[tuple[fx.Node, Purpose], dict[fx.Node, fx.Node]] = {}
        self.count: dict[str, int] = {}  # modules inserted so far, by kind
        self.at_edge: dict[Edge, list[Transition]] = {}  # by (consumer, operand path)
        self.after: dict[fx.Node, Transition] = {}  # its G (or sequence scatter, or STAT)
        self.gathers: list[Transition] = []
        self.bias: dict[fx.Node, fx.Node | None] = {}  # annotated view -> its partial's bias
        # a row-parallel partial joining a sum of partial sums -> that sum; the sum -> the
        # biases (taken out of its partials) added after its g
        self.joined = {p: total for total, ps in ann.joined_biases.items() for p in ps}
        self.join_bias: dict[fx.Node, list[fx.Node | None]] = {}
        self.fused: set[fx.Node] = set()  # annotated linears run by the first sharing their input
        self.losses: dict[fx.Node, Transition] = {}  # annotated vocab-parallel loss -> its
        # VOCAB_LOSS transition
        for t in ann.transitions:
            if t.purpose in (Purpose.G, Purpose.SEQ_SCATTER, Purpose.STAT):
                self.after[t.src] = t
            elif t.purpose is Purpose.GATHER_OUTPUT:
                self.gathers.append(t)
            elif t.purpose is Purpose.VOCAB_LOSS:  # the loss op itself realises it
                self.losses[t.consumers[0][0]] = t
            else:
                for edge in t.consumers:
                    self.at_edge.setdefault(edge, []).append(t)

    def _group_of(self, t: Transition) -> Group:
        """The group ``t``'s collectives run over: this rank's along its mesh dim."""
        return self.groups[t.mesh_dim]

    def _module(self, kind: str, mod: nn.Module) -> str:
        n = self.count[kind] = self.count.get(kind, -1) + 1
        name = f"tp_{kind}_{n}"
        self.gm.add_submodule(name, mod)
        return name

    def _realise(self, t: Transition, *args, **kwargs) -> str:
        """Adds the module that realises ``t`` (``purposes.PURPOSES``), made from ``args``
        and ``kwargs``: its name."""
        kind, module = PURPOSES[t.purpose].realised_by(t.forward)
        return self._module(kind, module(*args, **kwargs))

    @staticmethod
    def _site(node: fx.Node) -> str:
        mod = module_of(node)
        return f"{node.name}@{mod}" if mod else node.name

    def _value(self, orig: fx.Node) -> fx.Node:
        """The node a consumer of ``orig`` reads (after its g, if it has one)."""
        return self.reduced.get(orig, self.env[orig])

    def run(self) -> None:
        for orig in list(self.ann.gm.graph.nodes):
            out = self.ann.outcomes.get(orig)
            if out is None:
                continue
            if orig in self.fused:  # already run by the linears sharing its re-gather
                continue
            node = self.env[orig]
            regather = self._operands(orig, node)
            if regather is not None:
                node = self._keep_shard(orig, node, *regather)
            self._rewrite_sizes(orig, node)
            local = self._local_form(orig, node)
            if local is not node:  # a mean's summand: its users read it instead
                node = self.env[orig] = local
            self._stride_safe(orig, node, out)
            node = self._model_parallel_rng(orig, node, out)
            if out.role is Role.VOCAB_EMBEDDING:
                node = self.env[orig] = self._vocab_embedding(node, out)
            elif out.role is Role.VOCAB_LOSS:
                node = self._vocab_loss(orig, node)
            if orig in self.ann.deferred and out.bias is not None:  # added after the scatter
                node, self.bias[self.ann.deferred[orig]] = self._strip_bias(orig, node, out)
            if orig in self.joined:  # its bias waits for the g of the sum it joins
                node, bias = self._strip_bias(orig, node, out)
                self.join_bias.setdefault(self.joined[orig], []).append(bias)
            if orig in self.after:
                self._reduce(orig, node, out, self.after[orig])

    # ----------------------------------------------------------------- transitions

    def _operands(self, orig: fx.Node, node: fx.Node):
        """Execute the transitions on ``orig``'s operands at ``node``; a re-gather is
        returned, as ``(transition, this rank's shard)``, for ``_keep_shard``."""
        regather = None
        for path, a in operands(orig):
            ts = self.at_edge.get((orig, path))
            if ts:
                new = self._value(a)
                for t in ts:
                    if t.purpose is Purpose.SEQ_REGATHER:
                        regather = (t, self._value(a))
                    else:
                        new = self._execute(t, new, node, a)
                replace_operand(node, path, new)
        return regather

    def _execute(self, t: Transition, value: fx.Node, consumer: fx.Node,
                 src: fx.Node) -> fx.Node:
        """The node that gives ``consumer`` the value ``t`` turns ``value`` (of annotated
        node ``src``) into."""
        if t.purpose is Purpose.SEQ_GRAD_BUCKET:
            return self._bucket(t, consumer)[src]
        group = self._group_of(t)
        if t.purpose is Purpose.SPLIT:
            with self.graph.inserting_before(consumer):
                shard = self._realise(t, cast(Shard, t.after), group.rank, group.size)
                return self.graph.call_module(shard, (value,))
        key = (t.src, t.purpose)
        if key not in self.shared:
            site = self._site(t.src)
            if t.purpose in (Purpose.F, Purpose.SEQ_GRAD):
                mod = self._realise(t, group, site)
            elif t.purpose is Purpose.SEQ_GATHER:
                mod = self._realise(t, group, cast(Shard, t.before).dim, site)
            elif t.purpose in (Purpose.SEQ_UNSHARD, Purpose.GATHER):
                before = cast(Shard, t.before)
                mod = self._realise(t, group, before, t.messages[0][before.dim], site)
            else:  # REPLICA_GRAD
                mod = self._realise(t, group, cast(Shard, t.after), site)
            at = self.graph.inserting_before(consumer) if _written_in_place(value) \
                else self.graph.inserting_after(value)
            with at:
                self.shared[key] = self.graph.call_module(mod, (value,))
        return self.shared[key]

    def _bucket(self, t: Transition, consumer: fx.Node) -> dict:
        """The ``SumGradients`` node of bucket ``t``, placed before its first consumer (in
        that consumer's module, so it stays in the block): annotated source -> its output."""
        key = (t.src, t.purpose)
        if key not in self.buckets:
            values = [self._value(s) for s in t.sources]
            for v in values:  # a parameter read first after the consumer: read it before
                if v.op == "get_attr" and consumer < v:
                    consumer.prepend(v)
            mod = self._realise(t, self._group_of(t), self._site(t.src))
            with self.graph.inserting_before(consumer):
                node = self.graph.call_module(mod, tuple(values))
                outs = [self.graph.call_function(operator.getitem, (node, i))
                        for i in range(len(values))]
            _in_module_of(node, consumer)
            self.buckets[key] = dict(zip(t.sources, outs))
        return self.buckets[key]

    def _reduce(self, orig: fx.Node, node: fx.Node, out, t: Transition) -> None:
        """g (or the sequence scatter) after a partial result; a bias operand is added
        once, after it."""
        users = list(node.users)
        node, bias = self._strip_bias(orig, node, out)
        bias = self.bias.get(orig, bias)
        group = self._group_of(t)
        if t.purpose is Purpose.SEQ_SCATTER:
            mod = self._realise(t, group, cast(Shard, t.after).dim, self._site(node))
        else:  # G, STAT (a max's: MaxOverRanks)
            mod = self._realise(t, group, self._site(node))
        with self.graph.inserting_after(node):
            g = self.graph.call_module(mod, (node,))
        last = g
        for b in [bias, *self.join_bias.get(orig, [])]:
            if b is not None:
                with self.graph.inserting_after(last):
                    last = self.graph.call_function(aten.add.Tensor, (last, b))
        self.reduced[orig] = last
        for u in users:
            if u is not node:
                u.replace_input_with(node, last)

    def _strip_bias(self, orig: fx.Node, node: fx.Node, out) -> tuple[fx.Node, fx.Node | None]:
        """``node`` without its bias operand (an addmm becomes an mm), and the bias."""
        if out.bias is None:
            return node, None
        bias = operand(node, out.bias)
        if op_name(node) == "aten.addmm.default":
            with self.graph.inserting_before(node):
                mm = self.graph.call_function(aten.mm.default, (node.args[1], node.args[2]))
            node = self.env[orig] = self._replace(node, mm)
        else:
            replace_operand(node, out.bias, None)
        return node, bias

    def _keep_shard(self, orig: fx.Node, node: fx.Node, t: Transition,
                    shard: fx.Node) -> fx.Node:
        """The linears of one gathered sequence (``t``'s consumers, ``orig`` the first in
        graph order) as one node keeping ``shard`` for backward: the node of ``orig``."""
        linears = [c for c, _ in t.consumers]
        weights = []
        for c in linears:
            if c is not orig:  # its weight's own transitions (a replica sum) first
                self._operands(c, self.env[c])
            args = args_of(self.env[c])
            weights += [args["weight"], args.get("bias")]
        for v in weights:  # a later linear's parameters, read before the first
            if v is not None and v.op == "get_attr" and node < v:
                node.prepend(v)
        mod = self._realise(t, self._group_of(t), cast(Shard, t.before).dim, self._site(t.src))
        with self.graph.inserting_before(node):
            fused = self.graph.call_module(mod, (args_of(node)["input"], shard, *weights))
            outs = [self.graph.call_function(operator.getitem, (fused, i))
                    for i in range(len(linears))]
        _in_module_of(fused, node)
        for c, out in zip(linears, outs):
            self.env[c] = self._replace(self.env[c], out)
            self.fused.add(c)
        self.fused.discard(orig)
        gather = next((g for g in self.at_edge.get((orig, (0,)), ())
                       if g.purpose is Purpose.SEQ_GATHER), None)
        if gather is not None and {c for c, _ in gather.consumers} == set(linears):
            gathered = cast(fx.Node, fused.args[0])  # read by these linears alone: they gather it
            fused.args = (None, *fused.args[1:])
            self.graph.erase_node(gathered)
            self.gm.delete_submodule(str(gathered.target))  # a call_module's target: its name
        return self.env[orig]

    def gather_outputs(self) -> None:
        out = next(n for n in self.graph.nodes if n.op == "output")
        for t in self.gathers:
            value = self._value(t.src)
            with self.graph.inserting_before(out):
                before = cast(Shard, t.before)
                gathered = self.graph.call_module(self._realise(
                    t, self._group_of(t), before, t.messages[0][before.dim], self._site(t.src)),
                    (value,))
            out.replace_input_with(value, gathered)

    # ----------------------------------------------------------------- ops replaced by role

    def _replace(self, node: fx.Node, new: fx.Node) -> fx.Node:
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        return new

    def _model_parallel_rng(self, orig: fx.Node, node: fx.Node, out) -> fx.Node:
        """A random op on a sharded tensor draws from the model-parallel stream."""
        where = self.ann.rules.strategy.random.get(op_name(orig))
        if where is None or not isinstance(out.out, Shard):
            return node
        args = args_of(node)
        p = args[cast(OpOverload, node.target)._schema.arguments[where].name]
        if not p or not args.get("train", True):
            return node
        mod = self._module("rng", ModelParallelRNG(node.target, self.group))
        with self.graph.inserting_before(node):
            new = self.graph.call_module(mod, node.args, dict(node.kwargs))
        self.env[orig] = self._replace(node, new)
        return new

    def _vocab_embedding(self, node: fx.Node, out) -> fx.Node:
        spec = cast(VocabEmbedding, self.ann.rules.strategy.vocab_embedding)  # its role: set
        weight, ids = node.args[spec.weight], node.args[spec.indices]
        lay = out.needs[(spec.weight,)]
        rows = tensor_shape(cast(fx.Node, weight))[0]
        pad = args_of(node)["padding_idx"]
        lookup = VocabLookup(rows, lay.padded or rows, self.group, None if pad == -1 else pad)
        with self.graph.inserting_before(node):
            new = self.graph.call_module(self._module("vocab", lookup), (weight, ids))
        return self._replace(node, new)

    def _vocab_loss(self, orig: fx.Node, node: fx.Node) -> fx.Node:
        spec = cast(VocabLoss, self.ann.rules.strategy.vocab_loss)  # its role: set
        names = [a.name for a in cast(OpOverload, node.target)._schema.arguments]
        args = args_of(node)
        arg = lambda i: args[names[i]]  # noqa: E731
        t = self.losses[orig]
        loss = self._realise(
            t, self._group_of(t), vocab_size=tensor_shape(arg(spec.logits))[1],
            reduction=arg(spec.reduction), ignore_index=arg(spec.ignore_index),
            label_smoothing=arg(spec.label_smoothing) or 0.0, site=self._site(node))
        with self.graph.inserting_before(node):
            new = self.graph.call_module(loss, (arg(spec.logits), arg(spec.target)))
        self.env[orig] = self._replace(node, new)
        return new

    # ----------------------------------------------------------------- size arguments

    def _sharded_input(self, orig: fx.Node):
        """(the layout ``orig`` reads of its first operand, its kind) when that operand is
        this rank's shard and a kind covers the op; else None."""
        if not orig.args or not isinstance(orig.args[0], fx.Node):
            return None
        src = self.ann.read(orig.args[0], orig, (0,))
        kind = self.ann.rules.kind(op_name(orig))
        return (src, KINDS[kind]) if isinstance(src, Shard) and kind is not None else None

    def _rewrite_sizes(self, orig: fx.Node, node: fx.Node) -> None:
        """Literal (or traced) sizes of the sharded dim become this rank's sizes."""
        sharded = self._sharded_input(orig)
        if sharded is None:
            return
        src, kind = sharded

        def divide(size, by: int):
            with self.graph.inserting_before(node):  # a traced size expression
                return self.graph.call_function(operator.floordiv, (size, by))

        local = kind.local_args(node, src, self.ann.layouts.get(orig), self.group.size, divide)
        for name, value in local.items():
            set_arg(node, name, value)

    def _local_form(self, orig: fx.Node, node: fx.Node) -> fx.Node:
        """What the op's kind adds for it to give this rank's part (``Kind.local_form``)."""
        sharded = self._sharded_input(orig)
        if sharded is None:
            return node
        src, kind = sharded
        return kind.local_form(node, src, self.ann.layouts.get(orig), self.group.size, self.graph)

    def _stride_safe(self, orig: fx.Node, node: fx.Node, out) -> None:
        """A view of a tensor that is not whole here becomes a reshape.

        Export drops ``contiguous()`` calls that were no-ops at full size
        (torchtitan's ``transpose(1, 2).contiguous().view(...)``); a rank's part
        (a local slice, or a narrower result) can have strides the view cannot
        take. ``reshape`` is the view wherever the view is valid.
        """
        if op_name(orig) not in _VIEWS:
            return
        read = self.ann.read(cast(fx.Node, orig.args[0]), orig, (0,))
        if isinstance(read, Shard) or isinstance(out.needs.get((0,)), Shard):
            size = args_of(node)[_VIEWS[op_name(orig)]]
            node.target, node.args, node.kwargs = aten.reshape.default, (node.args[0], size), {}


def _in_module_of(node: fx.Node, like: fx.Node) -> None:
    """``node`` (inserted by the rewriter) belongs to ``like``'s module, so block
    outlining (recomputation, FSDP) keeps it in ``like``'s block."""
    if "nn_module_stack" in like.meta:
        node.meta["nn_module_stack"] = like.meta["nn_module_stack"]


def _written_in_place(node: fx.Node) -> bool:
    """Is ``node``'s tensor written in place later, directly or through a view (a
    ``new_empty`` filled by ``copy_`` into slices)? A transition then reads it at
    its consumer, after the writes: autograd forbids writing into what a custom
    Function returned as-is."""
    for user in node.users:
        schema = getattr(user.target, "_schema", None)
        if schema is None or not schema.arguments or user.args[0] is not node:
            continue
        alias = schema.arguments[0].alias_info
        if alias is not None and (alias.is_write or _written_in_place(user)):
            return True
    return False


# view overloads whose input must have view-compatible strides -> their sizes argument
_VIEWS = {"aten.view.default": "size", "aten._unsafe_view.default": "size"}


def _retarget_devices(graph: fx.Graph, device: torch.device) -> None:
    """Ops captured on meta create (factories) or move (``to.device``, a real buffer
    of a meta-built model) their tensors to ``device`` instead."""
    if device.type == "meta":
        return

    def retarget(a):
        return device if isinstance(a, torch.device) and a.type == "meta" else a
    for node in graph.nodes:
        node.args = tuple(retarget(a) for a in node.args)
        node.kwargs = {k: retarget(v) for k, v in node.kwargs.items()}


def gather_params(gm: fx.GraphModule, layouts: dict, group: Group) -> None:
    """Parameters held as shards (``layouts``: get_attr target -> its ``Shard``) that
    this graph reads whole are all-gathered where it reads them; backward keeps this
    rank's slice of their gradient."""
    graph = gm.graph
    reads = [n for n in graph.nodes if n.op == "get_attr" and n.target in layouts]
    for i, node in enumerate(reads):
        lay = layouts[node.target]
        name = f"tp_gather_param_{i}"
        gm.add_submodule(name, GatherShard(group, lay, tensor_shape(node)[lay.dim], node.target))
        users = list(node.users)
        with graph.inserting_after(node):
            whole = graph.call_module(name, (node,))
        for u in users:
            u.replace_input_with(node, whole)
    graph.lint()
    gm.recompile()


def bind(gm: fx.GraphModule, tensors: dict[str, torch.Tensor]) -> None:
    """Set parameters/buffers of ``gm`` by FQN (every alias of a tied weight)."""
    for fqn, t in tensors.items():
        owner, _, leaf = fqn.rpartition(".")
        try:
            mod = gm.get_submodule(owner) if owner else gm
        except AttributeError:
            continue
        if not hasattr(mod, leaf):
            continue
        if isinstance(t, nn.Parameter):
            mod._parameters.pop(leaf, None)
            mod._buffers.pop(leaf, None)
            mod.register_parameter(leaf, t)
        else:
            mod._parameters.pop(leaf, None)
            setattr(mod, leaf, t)  # a registered buffer stays one
