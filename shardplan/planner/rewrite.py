"""rewrite: an annotated graph -> the graph one rank runs.

Inserts the communication the annotation calls for as named modules (f before
each region, g after each partial result, the vocab-parallel lookup and loss,
gathers of sharded outputs), moves row-parallel biases after g, and rewrites
shape constants for the local shard. Parameters are bound separately
(``bind``), so every capture of one model shares the same shards.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn

from .capture import module_of
from .annotate import Annotation, _any_sharded, _slice_range, hint, op_name, operands, shape
from ..layouts import Partial, Replicate, Shard
from ..runtime.comm import Group
from ..runtime.graph_ops import (CopyToRegion, GatherShard, LocalShard, ModelParallelRNG,
                                ReduceFromRegion, SumOverReplicas, VocabCrossEntropy, VocabLookup)

aten = torch.ops.aten


def rewrite(ann: Annotation, group: Group, *, gather_output: bool = True,
            device: torch.device | None = None) -> fx.GraphModule:
    """Rewrite ``ann.gm`` in place for ``group.rank`` and return it."""
    rw = _Rewriter(ann, group)
    for node in list(ann.gm.graph.nodes):
        rw.visit(node)
    rw.output(gather_output)
    if device is not None:
        _retarget_devices(ann.gm.graph, device)
    ann.gm.graph.lint()
    ann.gm.recompile()
    return ann.gm


class _Rewriter:
    def __init__(self, ann: Annotation, group: Group):
        self.ann, self.group, self.gm, self.graph = ann, group, ann.gm, ann.gm.graph
        self.f_of: dict = {}
        self.count: dict = {}

    def _module(self, kind: str, mod: nn.Module) -> str:
        n = self.count[kind] = self.count.get(kind, -1) + 1
        name = f"tp_{kind}_{n}"
        self.gm.add_submodule(name, mod)
        return name

    def _site(self, node: fx.Node) -> str:
        mod = module_of(node)
        return f"{node.name}@{mod}" if mod else node.name

    def visit(self, node: fx.Node) -> None:
        out = self.ann.outcomes.get(node)
        if out is None:
            return
        entering = _any_sharded(out.out)
        for path, a in operands(node):
            if path == out.bias:
                continue
            need = out.needs.get(path, Replicate())
            have = self.ann.layouts.get(a)
            if not isinstance(have, Replicate):
                continue
            if isinstance(need, Shard) and a.op == "get_attr":
                if need.replicas > 1 and self.ann.requires_grad.get(a):
                    _replace_operand(node, path, self._replica_sum(a, need))
                continue  # a sharded parameter: sliced when bound
            new = a
            if entering and self.ann.requires_grad.get(a):
                new = self._f(a)
            if isinstance(need, Shard):
                with self.graph.inserting_before(node):
                    new = self.graph.call_module(
                        self._module("shard", LocalShard(need, self.group.rank, self.group.size)),
                        (new,))
            if new is not a:
                _replace_operand(node, path, new)
        self._rewrite_sizes(node)
        self._model_parallel_rng(node, out)
        if out.role == "vocab_embedding":
            self._vocab_embedding(node, out)
        elif out.role == "vocab_loss":
            self._vocab_loss(node)
        elif isinstance(out.out, Partial):
            self._reduce(node, out)

    def _model_parallel_rng(self, node: fx.Node, out) -> None:
        """A random op on a sharded tensor draws from the model-parallel stream."""
        where = self.ann.rules.strategy.random.get(op_name(node))
        if where is None or not isinstance(out.out, Shard):
            return
        p = node.args[where] if len(node.args) > where else 0.0
        train = node.args[2] if op_name(node).endswith("dropout.default") else True
        if not p or not train:
            return
        mod = self._module("rng", ModelParallelRNG(node.target, self.group))
        with self.graph.inserting_before(node):
            new = self.graph.call_module(mod, node.args, dict(node.kwargs))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        self.ann.outcomes[new] = out
        self.ann.layouts[new] = self.ann.layouts[node]

    def _f(self, a: fx.Node) -> fx.Node:
        if a not in self.f_of:
            with self.graph.inserting_after(a):
                self.f_of[a] = self.graph.call_module(
                    self._module("f", CopyToRegion(self.group, self._site(a))), (a,))
        return self.f_of[a]

    def _replica_sum(self, a: fx.Node, lay: Shard) -> fx.Node:
        if a not in self.f_of:
            with self.graph.inserting_after(a):
                self.f_of[a] = self.graph.call_module(self._module("replica_sum", SumOverReplicas(
                    self.group, lay.dim, lay.replicas, self._site(a))), (a,))
        return self.f_of[a]

    def _g_after(self, node: fx.Node, site_of: fx.Node) -> fx.Node:
        with self.graph.inserting_after(node):
            g = self.graph.call_module(
                self._module("g", ReduceFromRegion(self.group, self._site(site_of))), (node,))
        return g

    def _reduce(self, node: fx.Node, out) -> None:
        """g after a partial result; a bias operand is added once, after g."""
        users = list(node.users)
        bias = None
        if out.bias is not None:
            bias = _operand(node, out.bias)
            if op_name(node) == "aten.addmm.default":
                with self.graph.inserting_before(node):
                    mm = self.graph.call_function(aten.mm.default, (node.args[1], node.args[2]))
                mm.meta = dict(node.meta)
                node.replace_all_uses_with(mm)
                self.graph.erase_node(node)
                node = mm
            else:
                _replace_operand(node, out.bias, None)
        g = self._g_after(node, node)
        last = g
        if bias is not None:
            with self.graph.inserting_after(g):
                last = self.graph.call_function(aten.add.Tensor, (g, bias))
        self._replicated(node, g, last)
        for u in users:
            if u is not node:
                u.replace_input_with(node, last)

    def _replicated(self, original: fx.Node, *made: fx.Node) -> None:
        """Nodes made after a g hold the replicated value: later regions read them like
        any replicated tensor (an f before, a local slice where needed)."""
        for n in made:
            self.ann.layouts[n] = Replicate()
            self.ann.requires_grad[n] = self.ann.requires_grad.get(original, False)

    def _vocab_embedding(self, node: fx.Node, out) -> None:
        spec = self.ann_spec("vocab_embedding")
        weight, ids = node.args[spec.weight], node.args[spec.indices]
        lay = out.needs[(spec.weight,)]
        rows = shape(weight)[0]
        padding_idx = node.args[2] if len(node.args) > 2 and node.args[2] != -1 else None
        with self.graph.inserting_before(node):
            lookup = self.graph.call_module(
                self._module("vocab", VocabLookup(rows, lay.padded or rows, self.group, padding_idx)),
                (weight, ids))
        lookup.meta = dict(node.meta)
        node.replace_all_uses_with(lookup)
        self.graph.erase_node(node)
        users = list(lookup.users)
        g = self._g_after(lookup, lookup)
        self._replicated(node, g)
        for u in users:
            u.replace_input_with(lookup, g)

    def _vocab_loss(self, node: fx.Node) -> None:
        spec = self.ann_spec("vocab_loss")
        args = list(node.args) + [None] * 6
        logits, target = args[spec.logits], args[spec.target]
        vocab = shape(logits)[1]
        loss = VocabCrossEntropy(
            self.group, vocab_size=vocab,
            reduction=1 if args[spec.reduction] is None else args[spec.reduction],
            ignore_index=-100 if args[spec.ignore_index] is None else args[spec.ignore_index],
            label_smoothing=args[spec.label_smoothing] or 0.0, site=self._site(node))
        with self.graph.inserting_before(node):
            new = self.graph.call_module(self._module("vocab_loss", loss), (logits, target))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)

    def ann_spec(self, which):
        return getattr(self.ann.rules.strategy, which)

    # ----------------------------------------------------------------- shape constants

    def _rewrite_sizes(self, node: fx.Node) -> None:
        """Literal (or traced) sizes of the sharded dim become this rank's sizes."""
        if not node.args or not isinstance(node.args[0], fx.Node):
            return
        src = self.ann.layouts.get(node.args[0])
        if not isinstance(src, Shard):
            return
        name = op_name(node)
        kind = self.ann.rules.kind(name)
        tp = self.group.size
        out = self.ann.layouts.get(node)
        if kind in ("reshape", "expand") and isinstance(out, Shard):
            pos = 2 if name.endswith("unflatten.int") else 1
            if len(node.args) > pos and isinstance(node.args[pos], (list, tuple)):
                sizes = list(node.args[pos])
                j = out.dim - (len(shape(node)) - len(sizes)) if name.endswith("unflatten.int") \
                    else out.dim
                if 0 <= j < len(sizes):
                    sizes[j] = self._local(node, sizes[j], out, shape(node)[out.dim])
                    if kind == "expand" and out.replicas > 1:  # copies split between replicas
                        sizes[j + 1] = self._divided(node, sizes[j + 1], out.replicas)
                    _set_arg(node, pos, sizes)
        elif kind == "split" and name != "aten.unbind.int":
            dim = (node.args[2] if len(node.args) > 2 else 0) % len(shape(node.args[0]))
            if dim == src.dim and name == "aten.split.Tensor":
                _set_arg(node, 1, node.args[1] // tp)
            elif dim == src.dim and name == "aten.split_with_sizes.default":
                _set_arg(node, 1, [s // tp for s in node.args[1]])
        elif kind == "slice" and not name.endswith("select.int"):
            dim = (node.args[1] if len(node.args) > 1 else 0) % len(shape(node.args[0]))
            if dim == src.dim:
                start, stop = _slice_range(node, name, hint(shape(node.args[0])[dim]))
                if name.endswith("narrow.default"):
                    _set_arg(node, 2, start // tp)
                    _set_arg(node, 3, (stop - start) // tp)
                else:
                    _set_arg(node, 2, start // tp)
                    _set_arg(node, 3, stop // tp)

    def _local(self, node, size, lay: Shard, full):
        if isinstance(size, int):
            return size if size == -1 else lay.local_size(size, self.group.size)
        return self._divided(node, size, self.group.size // lay.replicas)

    def _divided(self, node, size, by: int):
        if isinstance(size, int):
            return size if size == -1 else size // by
        with self.graph.inserting_before(node):  # a traced size expression
            return self.graph.call_function(operator.floordiv, (size, by))

    # ----------------------------------------------------------------- outputs

    def output(self, gather: bool) -> None:
        out = next(n for n in self.graph.nodes if n.op == "output")
        if not gather:
            return

        def fix(a):
            if isinstance(a, fx.Node) and isinstance(self.ann.layouts.get(a), Shard):
                lay = self.ann.layouts[a]
                with self.graph.inserting_before(out):
                    return self.graph.call_module(self._module("gather", GatherShard(
                        self.group, lay, _full(a, lay), self._site(a))), (a,))
            if isinstance(a, (list, tuple)):
                return type(a)(fix(x) for x in a)
            if isinstance(a, dict):
                return {k: fix(v) for k, v in a.items()}
            return a

        out.args = tuple(fix(a) for a in out.args)


def _full(node, lay: Shard) -> int:
    return hint(shape(node)[lay.dim])


def _operand(node, path):
    if path[0] == "k":
        return node.kwargs[path[1]]
    a = node.args[path[0]]
    return a[path[1]] if len(path) == 2 else a


def _replace_operand(node: fx.Node, path, new) -> None:
    if path[0] == "k":
        kwargs = dict(node.kwargs)
        kwargs[path[1]] = new
        node.kwargs = kwargs
        return
    args = list(node.args)
    if len(path) == 2:
        inner = list(args[path[0]])
        inner[path[1]] = new
        args[path[0]] = type(node.args[path[0]])(inner)
    else:
        args[path[0]] = new
    node.args = tuple(args)


def _set_arg(node: fx.Node, i: int, value) -> None:
    args = list(node.args)
    args[i] = value
    node.args = tuple(args)


def _retarget_devices(graph: fx.Graph, device: torch.device) -> None:
    """Factory ops captured on meta create their tensors on ``device`` instead."""
    for node in graph.nodes:
        d = node.kwargs.get("device")
        if isinstance(d, torch.device) and d.type == "meta" and device.type != "meta":
            node.kwargs = {**node.kwargs, "device": device}


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
            if leaf in mod._buffers:
                mod._buffers[leaf] = t
            else:
                setattr(mod, leaf, t)
