"""vocab_parallel_cross_entropy against F.cross_entropy on the unsharded logits.

The logits are built over the padded vocabulary with large garbage in the
padding columns (they must never count); each rank takes its slice. The
loss and each shard's gradient must equal F.cross_entropy's loss and the
matching slice of its gradient (zero in the padding), and the ledger must
show exactly three forward all-reduces of one value per token.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplan.errors import ConfigurationError
from shardplan.ranks import SimulatedRanks
from shardplan.runtime import CommLedger, padded_vocab_size, vocab_parallel_cross_entropy

SETTINGS = settings(max_examples=25, deadline=None)
REDUCTIONS = ["mean", "sum", "none"]


def close(actual, expected, **tol):
    torch.testing.assert_close(actual, expected, equal_nan=True,
                               **(tol or dict(atol=1e-5, rtol=1e-5)))


def check_vocab_cross_entropy(ctx, logits, target, grad, vocab_size, kwargs):
    """This rank's loss and logit-shard gradient, and its ledger."""
    shard = logits.chunk(ctx.world_size, -1)[ctx.rank].clone().requires_grad_()
    with CommLedger() as led:
        loss = vocab_parallel_cross_entropy(shard, target, ctx.group,
                                            vocab_size=vocab_size, **kwargs)
        loss.backward(grad)
    return (loss.detach(), shard.grad,
            [(r.kind, r.direction, r.elements, r.op) for r in led.records])


def make_case(b, s, vocab, tp, ignore_index, ignore_frac, seed, dtype=torch.float32):
    """Padded logits (garbage padding), targets with some ignored, and the reference."""
    gen = torch.Generator().manual_seed(seed)
    padded = padded_vocab_size(vocab, tp)
    logits = 3 * torch.randn(b, s, padded, generator=gen)
    logits[..., vocab:] = 50 + torch.randn(b, s, padded - vocab, generator=gen)
    target = torch.randint(0, vocab, (b, s), generator=gen)
    target[torch.rand(b, s, generator=gen) < ignore_frac] = ignore_index
    return logits.to(dtype), target


def reference(logits, target, grad, vocab, **kwargs):
    """F.cross_entropy's loss and its gradient over the padded logits (zero padding)."""
    x = logits[..., :vocab].clone().requires_grad_()
    loss = F.cross_entropy(x.reshape(-1, vocab), target.reshape(-1), **kwargs)
    if kwargs.get("reduction") == "none":
        loss = loss.view(target.shape)
    loss.backward(grad)
    pad = torch.zeros(*logits.shape[:-1], logits.shape[-1] - vocab, dtype=logits.dtype)
    return loss.detach(), torch.cat([x.grad, pad], -1)


def expected_ledger(n_tokens, smoothing):
    return [("all_reduce", "forward", n_tokens, "max"),
            ("all_reduce", "forward", 2 * n_tokens if smoothing else n_tokens, "sum"),
            ("all_reduce", "forward", n_tokens, "sum")]


def run_and_compare(tp, b, s, vocab, ignore_index, ignore_frac, smoothing, reduction, seed):
    logits, target = make_case(b, s, vocab, tp, ignore_index, ignore_frac, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    grad = torch.randn(target.shape if reduction == "none" else (), generator=gen)
    kwargs = dict(ignore_index=ignore_index, label_smoothing=smoothing, reduction=reduction)
    ref_loss, ref_grad = reference(logits, target, grad, vocab, **kwargs)
    results = SimulatedRanks(tp).run(check_vocab_cross_entropy, logits, target, grad,
                                     vocab, kwargs)
    for rank, (loss, shard_grad, records) in enumerate(results):
        close(loss, ref_loss)
        close(shard_grad, ref_grad.chunk(tp, -1)[rank])
        assert records == expected_ledger(b * s, smoothing)


@SETTINGS
@given(tp=st.sampled_from([1, 2, 4, 8]), b=st.integers(1, 3), s=st.integers(1, 5),
       vocab=st.integers(1, 40), ignore_index=st.sampled_from([-100, 0]),
       ignore_frac=st.sampled_from([0.0, 0.3]), smoothing=st.sampled_from([0.0, 0.1, 0.7]),
       reduction=st.sampled_from(REDUCTIONS), seed=st.integers(0, 2**31 - 1))
def test_matches_cross_entropy(tp, b, s, vocab, ignore_index, ignore_frac, smoothing,
                               reduction, seed):
    run_and_compare(tp, b, s, vocab, ignore_index, ignore_frac, smoothing, reduction, seed)


@pytest.mark.parametrize("vocab,tp", [(16, 4), (13, 4), (5, 4), (50, 8), (7, 1)],
                         ids=["divisible", "padded", "rank-without-vocab", "gpt2-like", "tp1"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_vocab_divisible_or_padded(vocab, tp, smoothing, reduction):
    run_and_compare(tp, 2, 3, vocab, -100, 0.25, smoothing, reduction, seed=vocab * tp)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_all_ignored_mean_is_nan_like_torch(smoothing):
    logits, target = make_case(2, 3, 11, 4, -100, 1.0, seed=0)
    grad = torch.tensor(1.0)
    kwargs = dict(label_smoothing=smoothing, reduction="mean")
    ref_loss, ref_grad = reference(logits, target, grad, 11, **kwargs)
    assert ref_loss.isnan()
    for rank, (loss, shard_grad, _) in enumerate(
            SimulatedRanks(4).run(check_vocab_cross_entropy, logits, target, grad, 11, kwargs)):
        assert loss.isnan()
        close(shard_grad, ref_grad.chunk(4, -1)[rank])


def test_bfloat16_logits_give_bfloat16_loss_and_gradient():
    logits, target = make_case(2, 4, 30, 2, -100, 0.0, seed=3)
    ref_loss, ref_grad = reference(logits, target, torch.tensor(1.0), 30)
    low = logits.to(torch.bfloat16)
    for rank, (loss, shard_grad, _) in enumerate(SimulatedRanks(2).run(
            check_vocab_cross_entropy, low, target, torch.tensor(1.0, dtype=torch.bfloat16),
            30, {})):
        assert loss.dtype == shard_grad.dtype == torch.bfloat16
        close(loss.float(), ref_loss, atol=2e-2, rtol=1e-2)
        close(shard_grad.float(), ref_grad.chunk(2, -1)[rank], atol=1e-2, rtol=1e-2)


def check_rejects(ctx, logits, target, kwargs):
    try:
        vocab_parallel_cross_entropy(logits.chunk(ctx.world_size, -1)[ctx.rank], target,
                                     ctx.group, **kwargs)
    except ConfigurationError as e:
        return str(e)
    return None


@pytest.mark.parametrize("target,kwargs,match", [
    ([[0, 7]], dict(vocab_size=7), "id 7"),           # a padding column is not a class
    ([[0, -1]], dict(vocab_size=7), "id -1"),
    ([[0, 1]], dict(vocab_size=9), "vocab_size=9"),    # shards cover only 8
    ([[0, 1]], dict(vocab_size=7, reduction="avg"), "reduction"),
    ([[0, 1]], dict(vocab_size=7, label_smoothing=1.5), "label_smoothing"),
    ([0, 1], dict(vocab_size=7), "target shape"),
])
def test_rejects_bad_arguments(target, kwargs, match):
    logits = torch.randn(1, 2, 8)
    for message in SimulatedRanks(2).run(check_rejects, logits, torch.tensor(target), kwargs):
        assert message is not None and match in message
