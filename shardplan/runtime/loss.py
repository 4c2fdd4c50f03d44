"""Cross-entropy over vocabulary-sharded logits, without gathering the logits.

Each rank holds ``logits[..., start:end]`` of the padded vocabulary. The loss
needs three per-token quantities from the whole vocabulary, each an
all-reduce of ``N = b·s`` elements, never of the ``N·V`` logits:

1. the max logit (``op="max"``), for a stable softmax;
2. the target logit (``sum``: only the owning rank contributes it);
3. the sum of exponentials (``sum``).

Label smoothing also needs the sum of the logits over the vocabulary; it
travels in the second all-reduce, stacked with the target logit, so the
count stays three collectives (the second of ``2N`` elements). The backward
needs no communication: the gradient of this rank's slice is
``softmax - smoothed one-hot``, scaled by the incoming gradient.

Under ``torch.compile`` the forward computes the softmax out of place (dynamo
refuses a saved tensor that was mutated) and the three all-reduces are
recorded in the ledger at trace time (``ledger.traced``).
"""

from __future__ import annotations

import torch

from ..errors import ConfigurationError
from . import ledger
from .comm import Group, as_group
from .layers import check_ids, vocab_range
from .mappings import site_or_caller


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group: Group, vocab_size, ignore_index, smoothing,
                reduction, site):
        per = logits.shape[-1]
        start, _ = vocab_range(per * group.size, group.rank, group.size)
        n_real = max(0, min(per, vocab_size - start))  # unpadded columns on this rank
        x = logits.reshape(-1, per).float()
        if n_real < per:
            x = x.masked_fill(torch.arange(per, device=x.device) >= n_real, float("-inf"))
        t = target.reshape(-1)

        def all_reduce(v, op="sum"):
            return group.all_reduce(v, op, direction="forward", site=site)

        shifted = x - all_reduce(x.max(-1).values, "max").unsqueeze(-1)
        keep = t != ignore_index
        mine = keep & (t >= start) & (t < start + per)
        idx = (t - start).masked_fill(~mine, 0)
        picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        if smoothing:
            summed = shifted[:, :n_real].sum(-1)
            picked, summed = all_reduce(torch.stack([picked, summed])).unbind(0)
        else:
            picked = all_reduce(picked)
        eager = not torch.compiler.is_dynamo_compiling()  # a traced graph may not mutate saved tensors
        probs = shifted.exp_() if eager else shifted.exp()
        sumexp = all_reduce(probs.sum(-1))
        probs = probs.div_(sumexp.unsqueeze(-1)) if eager else probs / sumexp.unsqueeze(-1)

        lse = sumexp.log()
        loss = lse - picked
        if smoothing:
            loss = (1 - smoothing) * loss + smoothing * (lse - summed / vocab_size)
        loss = loss.masked_fill(~keep, 0.0)

        ctx.save_for_backward(probs, idx, mine, keep)
        ctx.meta = (logits.shape, logits.dtype, n_real, vocab_size, smoothing, reduction)
        if reduction == "mean":
            out = loss.sum() / keep.sum()
        elif reduction == "sum":
            out = loss.sum()
        else:
            out = loss.view(target.shape)
        if not torch.is_autocast_enabled(logits.device.type):
            out = out.to(logits.dtype)  # under autocast a loss stays fp32, as F.cross_entropy's does
        return out

    @staticmethod
    def backward(ctx, grad):
        probs, idx, mine, keep = ctx.saved_tensors
        shape, dtype, n_real, vocab_size, smoothing, reduction = ctx.meta
        w = grad.float().reshape(-1).expand(keep.shape[0])
        if reduction == "mean":
            w = w / keep.sum()
        w = torch.where(keep, w, 0.0)  # an all-ignored mean gives zero, as torch does
        dx = probs * w.unsqueeze(-1)
        dx.scatter_add_(-1, idx.unsqueeze(-1), (-(1 - smoothing) * w * mine).unsqueeze(-1))
        if smoothing:
            dx[:, :n_real] -= (smoothing / vocab_size) * w.unsqueeze(-1)
        return dx.view(shape).to(dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, group, *,
                                 vocab_size: int, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, reduction: str = "mean",
                                 site: str | None = None) -> torch.Tensor:
    """``F.cross_entropy(logits, target, ...)`` from this rank's vocabulary slice.

    ``logits_shard`` is ``(..., V_padded / tp)``: rank r's slice
    ``vocab_range(V_padded, r, tp)`` of logits whose last dim is the padded
    vocabulary; columns ``>= vocab_size`` are padding and never count.
    ``target`` is ``(...)`` and the same on every rank. ``ignore_index``,
    ``label_smoothing`` and ``reduction`` ("mean" over non-ignored tokens,
    "sum", "none") mean what they mean for ``F.cross_entropy``.
    """
    group = as_group(group)
    per = logits_shard.shape[-1]
    if per * group.size < vocab_size:
        raise ConfigurationError(
            f"vocab_parallel_cross_entropy: {group.size} shards of {per} logits cover "
            f"{per * group.size} < vocab_size={vocab_size} ids",
            fix="pass each rank's slice of the logits over the padded vocabulary")
    if target.shape != logits_shard.shape[:-1]:
        raise ConfigurationError(
            f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} does not "
            f"match logits {tuple(logits_shard.shape)} without the vocabulary dim")
    if reduction not in ("mean", "sum", "none"):
        raise ConfigurationError(f"unknown reduction {reduction!r}",
                                 fix='use "mean", "sum" or "none"')
    if not 0.0 <= label_smoothing <= 1.0:
        raise ConfigurationError(f"label_smoothing={label_smoothing} is outside [0, 1]")
    check_ids(target, vocab_size, "vocab_parallel_cross_entropy target", ignore_index)
    if torch.compiler.is_dynamo_compiling():
        site = site or "compiled"
        # max, target logit (stacked with the logit sum when smoothing), sum of exps: fp32
        ledger.traced(target, "all_reduce", group.size, 1, "forward", site, "max", 4)
        if label_smoothing:
            ledger.traced(target, "all_reduce", group.size, 2, "forward", site, "sum", 4)
        ledger.traced(target, "all_reduce", group.size, 1, "forward", site, "sum", 4,
                      1 if label_smoothing else 2)
    else:
        site = site_or_caller(site)
    return _VocabParallelCrossEntropy.apply(
        logits_shard, target, group, vocab_size, ignore_index, float(label_smoothing),
        reduction, site)
