"""transition_derivation: the transitions (``transitions.Transition``) an annotation implies.

At each node, in graph order: f where a replicated tensor enters a region,
the local slice of a replicated activation read sharded, the replica sum of a
parameter part held by several ranks, the sequence gathers; after it, g for a
partial result (or its reduce-scatter under sequence parallelism), or the
vocab-parallel loss. Last, the gathers of sharded graph outputs. A block's
sequence-parallel gradient sums are bucketed into one all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import cast

import torch
import torch.fx as fx

from .annotation import R, Annotation, Edge
from .blocks import split_first
from .capture import module_of
from ..layouts import Partial, Replicate, Shard
from .graph import args_of, op_name, operand, operands
from .kinds import Context, Role
from .kinds.base import any_sharded
from .kinds.permute import viewed_parameter
from .linear_chains import earlier_f
from .transitions import Collective, Purpose, Transition, dtype_of, message
from ..torch_compat import OpOverload


def _keeps_shard(node: fx.Node, path) -> bool:
    """Does ``node`` keep only the sequence shard of its gathered input for backward
    (a linear's input, all-gathered again for the weight's gradient)?"""
    return op_name(node) == "aten.linear.default" and path == (0,)


def derive_transitions(ann: Annotation) -> list[Transition]:
    """Every layout change of the annotated graph, in graph order of its consumer.

    At each node: f for each replicated tensor that enters a region (shared
    by all its consumers), a local slice for each replicated activation read
    sharded, a replica sum for each parameter part held by several ranks;
    after it, g for a partial result, or the vocab-parallel loss. Last, a
    gather for each sharded graph output.
    """
    out: list[Transition] = []
    # (src, purpose, *key) -> index in out, for transitions shared by consumers
    made: dict[tuple, int] = {}
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
            names = [x.name for x in cast(OpOverload, node.target)._schema.arguments]
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
            at = ann.outcomes[owner].bias
            bias = operand(owner, at) if at is not None else None
            if bias is not None and ann.requires_grad.get(bias):  # added per token after it
                shared(Purpose.SEQ_GRAD, bias, (owner, at), before=R, after=R,
                       forward=Collective.NONE, backward=Collective.ALL_REDUCE)
        elif isinstance(o.out, Partial) and node not in ann.deferred and node not in ann.passed:
            stat = o.role is Role.DISTRIBUTED
            maximum = stat and ann.rules.reduce[op_name(node)].distributed == "max"
            out.append(Transition(Purpose.STAT if stat else Purpose.G, node,
                                  tuple((u, None) for u in node.users), Partial(), R,
                                  Collective.ALL_REDUCE_MAX if maximum else Collective.ALL_REDUCE,
                                  Collective.NONE,
                                  (message(node),), dtype_of(node), mesh_dim=ann.dim))
    out = bucket_grad_sums(merge_part_fs(out))
    output = next(n for n in ann.gm.graph.nodes if n.op == "output")
    for a in output.all_input_nodes:
        lay = ann.read(a)
        if isinstance(lay, Shard):
            out.append(Transition(Purpose.GATHER_OUTPUT, a, ((output, None),), lay, R,
                                  Collective.ALL_GATHER, Collective.LOCAL_SLICE,
                                  (message(a),), dtype_of(a), mesh_dim=ann.dim))
    return out


def merge_part_fs(ts: list[Transition]) -> list[Transition]:
    """The f's of the parts of one replicated tensor (``select``s of a stack: a
    written-out LayerNorm's mean and inverse deviation) as one f of the whole, where
    the parts are its only readers and each part's f serves all its readers: one
    all-reduce of both gradients instead of one each, in the first one's place."""
    by_whole: dict[fx.Node, list[int]] = {}
    for i, t in enumerate(ts):
        if t.purpose is Purpose.F and op_name(t.src) == "aten.select.int" \
                and {c for c, _ in t.consumers} == set(t.src.users):
            by_whole.setdefault(cast(fx.Node, t.src.args[0]), []).append(i)
    merged: dict[int, Transition] = {}
    dropped: set[int] = set()
    for whole, idx in by_whole.items():
        parts = [ts[i].src for i in idx]
        if len(idx) < 2 or set(parts) != set(whole.users):
            continue
        merged[idx[0]] = replace(ts[idx[0]], src=whole, consumers=tuple((p, (0,)) for p in parts),
                                 messages=(message(whole),), dtype=dtype_of(whole))
        dropped.update(idx[1:])
    return [merged.get(i, t) for i, t in enumerate(ts) if i not in dropped]


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


def bucket_grad_sums(ts: list[Transition], per_block: bool = True) -> list[Transition]:
    """The ``SEQ_GRAD``s of parameters of one block (and dtype), read only inside it, as
    one ``SEQ_GRAD_BUCKET`` where the first of them was: one all-reduce instead of one
    per norm weight, norm bias and row bias. A block's bucket stays in the block, so
    recomputation and FSDP see it there. ``per_block=False``: every parameter's
    ``SEQ_GRAD`` and bucket of one dtype in one bucket, summed once the last gradient
    is ready. An activation's ``SEQ_GRAD`` (a position embedding's output) joins its
    block's bucket where it is made before the bucket's first reader."""
    groups: dict[tuple, list[int]] = {}  # (block, dtype, mesh dim) -> indices in ts
    for i, t in enumerate(ts):
        if t.purpose in (Purpose.SEQ_GRAD_BUCKET, Purpose.SEQ_GRAD):
            block = block_of(owner_name(t.src)) if per_block else ()
            if all(block_of(module_of(c)) == block for c, _ in t.consumers) or not per_block:
                groups.setdefault((block, t.dtype, t.mesh_dim), []).append(i)
    for key, idx in groups.items():  # the bucket runs before its first reader
        first = min(c for i in idx for c, _ in ts[i].consumers)
        groups[key] = [i for i in idx if all(v.op == "get_attr" or v < first
                                              for v in ts[i].sources or (ts[i].src,))]
    buckets: dict[int, Transition] = {}  # index of a bucket's first member -> the bucket
    dropped: set[int] = set()
    for idx in groups.values():
        if len(idx) < 2:
            continue
        members = [ts[i] for i in idx]
        buckets[idx[0]] = Transition(
            Purpose.SEQ_GRAD_BUCKET, members[0].src, sum((m.consumers for m in members), ()),
            R, R, Collective.NONE, Collective.ALL_REDUCE,
            messages=((sum(m.elements[0] for m in members),),), dtype=members[0].dtype,
            sources=sum((m.sources or (m.src,) for m in members), ()), mesh_dim=members[0].mesh_dim)
        dropped.update(idx[1:])
    return [buckets.get(i, t) for i, t in enumerate(ts) if i not in dropped]


def owner_name(node: fx.Node) -> str:
    """A parameter's name, or the module an activation is made in: where its block is."""
    return str(node.target) if node.op == "get_attr" else module_of(node)


def block_of(name: str) -> tuple:
    """(list path, index) of the outermost block ``name`` lies in; () outside blocks."""
    found = split_first(name or "")
    return found[:2] if found else ()


def _with_consumer(t: Transition, edge: Edge) -> Transition:
    return replace(t, consumers=t.consumers + (edge,))
