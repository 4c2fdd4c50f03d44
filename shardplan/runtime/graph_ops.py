"""The modules a rewritten graph calls at its communication points.

Each is a small ``nn.Module`` so that ``print(sharded.code)`` shows every
communication point by name (``self.tp_f_3(x)``, ``self.tp_g_0(y)``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import ConfigurationError
from ..layouts import Shard
from .comm import Group, in_stacked_order
from .layers import check_ids, vocab_lookup, vocab_range
from .ledger import traced
from .loss import vocab_parallel_cross_entropy
from .mappings import (copy_to_region, gather_from_sequence, linears_on_gathered_sequence,
                       max_over_ranks, reduce_from_region, reduce_scatter_to_sequence,
                       sum_gradients)
from .random import tracker_for
from .region_random import DRAWS


class CopyToRegion(nn.Module):
    """f: identity forward, all-reduce of the gradient backward."""

    def __init__(self, group: Group, site: str):
        super().__init__()
        self.group, self.site = group, site

    def forward(self, x):
        return copy_to_region(x, self.group, site=self.site)


class ReduceFromRegion(nn.Module):
    """g: all-reduce forward, identity backward."""

    def __init__(self, group: Group, site: str):
        super().__init__()
        self.group, self.site = group, site

    def forward(self, x):
        return reduce_from_region(x, self.group, site=self.site)


class MaxOverRanks(nn.Module):
    """A distributed max: all-reduce (max) forward; its input needs no gradient."""

    def __init__(self, group: Group, site: str):
        super().__init__()
        self.group, self.site = group, site

    def forward(self, x):
        return max_over_ranks(x, self.group, site=self.site)


class ScatterToSequence(nn.Module):
    """Sequence-parallel g: reduce-scatter along the sequence dim forward, all-gather
    backward; a length tp does not divide is a ``ConfigurationError`` naming the fix.
    ``stacked``: its input's tokens come in the ranks' order (``planner.token_order``)."""

    def __init__(self, group: Group, dim: int, site: str):
        super().__init__()
        self.group, self.dim, self.site = group, dim, site
        self.stacked = False

    def forward(self, x):
        check_sequence(x.shape[self.dim], self.group.size, self.site)
        return reduce_scatter_to_sequence(x, self.group, dim=self.dim, stacked=self.stacked,
                                          site=self.site)


class GatherSequence(nn.Module):
    """Sequence-parallel f: all-gather along the sequence dim forward, reduce-scatter
    backward."""

    def __init__(self, group: Group, dim: int, site: str):
        super().__init__()
        self.group, self.dim, self.site = group, dim, site

    def forward(self, x):
        return gather_from_sequence(x, self.group, dim=self.dim, site=self.site)


class LinearsOnGatheredSequence(nn.Module):
    """The linears reading one sequence-parallel f's output: they keep the shard for
    backward, all-gathered again there once for all of them (a tuple of outputs). With
    ``x=None`` they are the gather's only readers and gather it themselves; ``stacked``:
    leaving the tokens in the ranks' order (``planner.token_order``)."""

    def __init__(self, group: Group, dim: int, site: str):
        super().__init__()
        self.group, self.dim, self.site = group, dim, site
        self.stacked = False

    def forward(self, x, shard, *weights_and_biases):
        return linears_on_gathered_sequence(x, shard, weights_and_biases, self.group,
                                            dim=self.dim, stacked=self.stacked, site=self.site)


class SumGradients(nn.Module):
    """f of several tensors (a tuple of them): one flat all-reduce of their gradients."""

    def __init__(self, group: Group, site: str):
        super().__init__()
        self.group, self.site = group, site

    def forward(self, *tensors):
        return sum_gradients(tensors, self.group, site=self.site)


def gathered_order(x: torch.Tensor, tp: int, dim: int, site: str) -> torch.Tensor:
    """``x`` with its positions along ``dim`` in the order a stacked all-gather leaves
    them (the ``tp`` parts one after another; ``Group.all_gather(stacked=True)``), for
    the sequence scatter at ``site``."""
    check_sequence(x.shape[dim], tp, site)
    return in_stacked_order(x, tp, dim)


def check_sequence(length: int, tp: int, site: str) -> None:
    """Sequence parallelism holds length/tp tokens per rank: tp must divide the length."""
    if length % tp:
        raise ConfigurationError(
            f"sequence length {length} does not divide by tp={tp} "
            "(sequence_parallel=True holds 1/tp of the sequence on each rank)",
            where=site,
            fix=f"pad the sequences to a multiple of {tp} (with an attention mask and "
                f"ignored labels), or parallelize with sequence_parallel=False")


class VocabLookup(nn.Module):
    """This rank's rows of an embedding: ids it does not own give zero rows, and
    the padding row no gradient (``layers.vocab_lookup``, as the hand-written
    ``VocabParallelEmbedding``). Its output is partial; a ``ReduceFromRegion``
    follows it in the graph.
    """

    def __init__(self, num_embeddings: int, padded: int, group: Group, padding_idx=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.start, self.end = vocab_range(padded, group.rank, group.size)
        self.padding_idx = padding_idx

    def forward(self, weight, ids):
        check_ids(ids, self.num_embeddings, "vocab-parallel embedding")
        return vocab_lookup(weight, ids, self.start, self.end, self.padding_idx)


class VocabCrossEntropy(nn.Module):
    """``aten.cross_entropy_loss`` on vocab-sharded logits (class dim 1)."""

    _REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}

    def __init__(self, group: Group, vocab_size: int, reduction: int, ignore_index: int,
                 label_smoothing: float, site: str):
        super().__init__()
        self.group, self.vocab_size, self.site = group, vocab_size, site
        self.reduction = self._REDUCTIONS[reduction]
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def forward(self, logits, target):
        if logits.dim() > 2:
            logits = logits.movedim(1, -1)
        return vocab_parallel_cross_entropy(
            logits, target, self.group, vocab_size=self.vocab_size,
            ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            reduction=self.reduction, site=self.site)


class _GatherShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, layout, full, site):
        ctx.group, ctx.layout = group, layout
        parts = group.all_gather(x, layout.dim, direction="forward", site=site)
        return layout.unshard(list(parts.chunk(group.size, layout.dim)), full)

    @staticmethod
    def backward(ctx, grad):
        return ctx.layout.slice(grad, ctx.group.rank, ctx.group.size), None, None, None, None


class GatherShard(nn.Module):
    """All-gather a (possibly blocked or padded) shard into the full tensor."""

    def __init__(self, group: Group, layout: Shard, full: int, site: str):
        super().__init__()
        self.group, self.layout, self.full, self.site = group, layout, full, site

    def forward(self, x):
        if torch.compiler.is_dynamo_compiling():
            traced(x, "all_gather", self.group.size, self.group.size, "forward", self.site)
        return _GatherShard.apply(x, self.group, self.layout, self.full, self.site)


class LocalShard(nn.Module):
    """This rank's slice of a replicated tensor (no communication)."""

    def __init__(self, layout: Shard, rank: int, tp: int):
        super().__init__()
        self.layout, self.rank, self.tp = layout, rank, tp

    def forward(self, x):
        return self.layout.slice(x, self.rank, self.tp)


class _SumOverReplicas(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, group, layout, site):
        ctx.group, ctx.layout, ctx.site = group, layout, site
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        g, lay = ctx.group, ctx.layout
        sizes = lay.local_blocks(g.size) if lay.blocks else (grad.shape[lay.dim],)
        pieces = list(grad.split(list(sizes), lay.dim))
        summed = [i for i, r in enumerate(lay.block_replicas()) if r > 1]
        bufs = []  # a zero-padded full-size buffer of each block held by several ranks
        for i in summed:
            r, n = lay.block_replicas()[i], sizes[i]
            shape = list(grad.shape)
            shape[lay.dim] = n * (g.size // r)
            buf = grad.new_zeros(shape)
            buf.narrow(lay.dim, (g.rank // r) * n, n).copy_(pieces[i])
            bufs.append(buf)
        total = g.all_reduce(torch.cat(bufs, lay.dim), direction="backward", site=ctx.site)
        at = 0
        for i, buf in zip(summed, bufs):
            r, n = lay.block_replicas()[i], sizes[i]
            pieces[i] = total.narrow(lay.dim, at + (g.rank // r) * n, n)
            at += buf.shape[lay.dim]
        return torch.cat(pieces, lay.dim).clone(), None, None, None  # drop the buffer


class SumOverReplicas(nn.Module):
    """Identity forward; backward sums a parameter part's gradient over the ranks
    that hold the same part (``Shard(replicas=r)``), so their copies stay equal; of a
    blocked shard with a count per block, the blocks held by several ranks, in one
    all-reduce."""

    def __init__(self, group: Group, layout: Shard, site: str):
        super().__init__()
        self.group, self.layout, self.site = group, layout, site

    def forward(self, w):
        if torch.compiler.is_dynamo_compiling() and w.requires_grad and torch.is_grad_enabled():
            traced(w, "all_reduce", self.group.size,
                   self.group.size // min(r for r in self.layout.block_replicas() if r > 1),
                   "backward", self.site)
        return _SumOverReplicas.apply(w, self.group, self.layout, self.site)


class ModelParallelRNG(nn.Module):
    """Runs one random op of a sharded region (dropout on split activations or on
    attention probabilities) on this rank's model-parallel stream, so ranks that
    hold different heads draw different masks, and replicated regions stay in step.
    Ops with a traceable form (``region_random.DRAWS``) take the stream's state as
    data, eager and compiled; any other runs under ``tracker.fork()`` (eager only)."""

    def __init__(self, op, group: Group):
        super().__init__()
        self.op, self.group = op, group
        self.draw = DRAWS.get(op._schema.name)

    @property
    def traceable(self) -> bool:
        return self.draw is not None

    def forward(self, *args, **kwargs):
        tracker = tracker_for(self.group.rank)
        if self.draw is None:
            with tracker.fork():
                return self.op(*args, **kwargs)
        first = next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
        return self.draw(tracker.state_for(first.device), *args, **kwargs)
