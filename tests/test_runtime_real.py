"""The runtime's simulated-rank checks again, on real gloo worker processes.

The per-rank ``check_*`` functions and comparison helpers come unchanged from
``test_mappings``, ``test_layers``, ``test_loss`` and ``test_random`` (they
pickle by reference: ``tests/`` is on ``sys.path`` in the spawned workers too).
Shapes are a fixed set (no hypothesis) and every test sends its cases to a
cached pool as one task (``_batch``), so a world size costs one spawn and each
test one round trip.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardplan.runtime import CommLedger, model_parallel_seed, set_rng_tracker
from test_layers import (assert_vocab_embedding_matches, check_column_parallel,
                         check_parallel_mlp, check_row_parallel, check_row_parallel_skip_g,
                         check_vocab_embedding, full_embedding, full_linear, reference)
from runtime_helpers import assert_mlp_matches, comm
from test_loss import check_vocab_cross_entropy, expected_ledger, make_case
from test_loss import reference as ce_reference
from test_mappings import (_stack, check_forward_only, check_mapping, check_stacked_scatter,
                           gathered_order, randn, stacked_scatter_case)
from test_random import check_dropout_replay, check_streams, draws

pytestmark = [pytest.mark.real, pytest.mark.timeout(120)]

TP = pytest.mark.parametrize("tp", [1, 2, 4], ids=lambda n: f"tp{n}")


def close(actual, expected):
    """fp32, tight: the same tolerance as the simulated tests."""
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, equal_nan=True)


# -- run on every rank ----------------------------------------------------------------

def _batch(ctx, calls):
    """Run ``fn(ctx, *args)`` for each ``(fn, args)`` in order: one round trip for many."""
    return [fn(ctx, *args) for fn, args in calls]


def _isolated_rng(ctx, fn, *args):
    """``fn`` with the worker's CPU RNG restored and no tracker left behind (pools are shared)."""
    try:
        with torch.random.fork_rng(devices=[]):
            return fn(ctx, *args)
    finally:
        set_rng_tracker(None)


def run_batch(pool, calls):
    """Per call, the list of per-rank results."""
    per_rank = pool.run(_batch, calls)
    return [[r[i] for r in per_rank] for i in range(len(calls))]


# -- mappings (f / g / split / gather / sequence) -------------------------------------

B, S, H = 2, 3, 5


def mapping_cases(tp, seed=0):
    """``(name, x, w, expect(rank, y, grad, records))`` for every mapping."""
    gen = torch.Generator().manual_seed(seed)
    b, s, h = B, S, H
    cases = []

    x, w = randn(gen, b, s, h), randn(gen, tp, b, s, h)
    cases.append(("copy", _stack(x, tp), w, lambda r, y, dx, rec, x=x, w=w: (
        close(y, x), close(dx, w.sum(0)),
        _eq(rec, [("all_reduce", "backward", b * s * h)]))))

    x, w = randn(gen, tp, b, s, h), randn(gen, b, s, h)
    cases.append(("reduce", x, _stack(w, tp), lambda r, y, dx, rec, x=x, w=w: (
        close(y, x.sum(0)), close(dx, w),
        _eq(rec, [("all_reduce", "forward", b * s * h)]))))

    x, w = randn(gen, b, s, h * tp), randn(gen, b, s, h * tp)
    cases.append(("scatter", _stack(x, tp), torch.stack(w.chunk(tp, -1)),
                  lambda r, y, dx, rec, x=x, w=w: (
                      close(y, x.chunk(tp, -1)[r]), close(dx, w),
                      _eq(rec, [("all_gather", "backward", b * s * h * tp)]))))

    full, w = randn(gen, b, s, h * tp), randn(gen, b, s, h * tp)
    cases.append(("gather", torch.stack(full.chunk(tp, -1)), _stack(w, tp),
                  lambda r, y, dx, rec, full=full, w=w: (
                      close(y, full), close(dx, w.chunk(tp, -1)[r]),
                      _eq(rec, [("all_gather", "forward", b * s * h * tp)]))))

    full, w = randn(gen, s * tp, b, h), randn(gen, tp, s * tp, b, h)
    cases.append(("gather_seq", torch.stack(full.chunk(tp, 0)), w,
                  lambda r, y, dx, rec, full=full, w=w: (
                      close(y, full), close(dx, w.sum(0).chunk(tp, 0)[r]),
                      _eq(rec, [("all_gather", "forward", full.numel()),
                                ("reduce_scatter", "backward", full.numel())]))))

    x, w = randn(gen, tp, s * tp, b, h), randn(gen, s * tp, b, h)
    cases.append(("reduce_scatter_seq", x, torch.stack(w.chunk(tp, 0)),
                  lambda r, y, dx, rec, x=x, w=w: (
                      close(y, x.sum(0).chunk(tp, 0)[r]), close(dx, w),
                      _eq(rec, [("reduce_scatter", "forward", w.numel()),
                                ("all_gather", "backward", w.numel())]))))
    return cases


def _eq(actual, expected):
    assert actual == expected


def check_gathered_linears(ctx, shards, weights, biases, grads, own_gather=True,
                           stacked=False):
    """Two linears of this rank's tokens (dim 1), backward ``sum(y_i * grads_i[rank])``:
    (outputs, the shard's gradient, weight and bias gradients, ledger). ``own_gather``:
    they gather the tokens themselves (``linears_on_gathered_sequence(None, ...)``), else
    they read ``gather_from_sequence``'s output. ``stacked``: outputs, and so the
    gradients given, in the gathered token order."""
    from shardplan.runtime.mappings import gather_from_sequence, linears_on_gathered_sequence
    shard = shards[ctx.rank].clone().requires_grad_()
    ws = [w.clone().requires_grad_() for w in weights]
    bs = [b.clone().requires_grad_() for b in biases]
    order = (lambda t: gathered_order(t, ctx.group.size, 1)) if stacked else (lambda t: t)
    with CommLedger() as led:
        x = None if own_gather else gather_from_sequence(shard, ctx.group, dim=1)
        ys = linears_on_gathered_sequence(x, shard, [t for wb in zip(ws, bs) for t in wb],
                                          ctx.group, dim=1, stacked=stacked)
        sum((y * order(g[ctx.rank])).sum() for y, g in zip(ys, grads)).backward()
    return ([y.detach() for y in ys], shard.grad, [w.grad for w in ws], [b.grad for b in bs],
            comm(led))


def _assert_gathered_linears(tp, per_rank, shards, weights, biases, grads, stacked=False):
    """Against the sums written out: x the gathered tokens, y_i = x W_i^T + b_i; the
    shard's gradient is this rank's tokens of the ranks' summed input gradients; the
    weights' gradients use the whole x (the backward re-gather); one all-gather forward,
    backward the re-gather (launched before the input's gradient is computed, which it
    overlaps) and then the input gradient's reduce-scatter."""
    x = torch.cat(list(shards), 1)
    grad_x = sum(g.matmul(w) for g, w in zip(grads, weights)).sum(0)  # every rank's, summed
    for r, (ys, dshard, dws, dbs, records) in enumerate(per_rank):
        for y, w, b in zip(ys, weights, biases):
            want = x.matmul(w.t()) + b
            close(y, gathered_order(want, tp, 1) if stacked else want)
        close(dshard, grad_x.chunk(tp, 1)[r])
        for dw, db, g in zip(dws, dbs, grads):
            close(dw, g[r].reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1])))
            close(db, g[r].reshape(-1, g.shape[-1]).sum(0))
        n = x.numel()
        assert records == [("all_gather", "forward", n), ("all_gather", "backward", n),
                           ("reduce_scatter", "backward", n)]


@TP
def test_mappings_match_unsharded_math(real_ranks, tp):
    cases = mapping_cases(tp)
    calls = [(check_mapping, (x, w, name)) for name, x, w, _ in cases]
    gen = torch.Generator().manual_seed(7)
    linears = (randn(gen, tp, B, S, H), [randn(gen, n, H) for n in (4, 6)],
               [randn(gen, n) for n in (4, 6)], [randn(gen, tp, B, S * tp, n) for n in (4, 6)])
    calls.append((check_gathered_linears, linears))
    calls.append((check_gathered_linears, (*linears, False)))
    calls.append((check_gathered_linears, (*linears, True, True)))
    stacked_x, stacked_w, stacked_check = stacked_scatter_case(gen, tp, B, S, H)
    calls.append((check_stacked_scatter, (stacked_x, stacked_w)))
    calls.append((check_forward_only, (torch.ones(3, 4),)))
    *results, gathered, gathered_apart, gathered_stacked, scattered_stacked, forward_only = \
        run_batch(real_ranks(tp), calls)
    _assert_gathered_linears(tp, gathered, *linears)
    _assert_gathered_linears(tp, gathered_apart, *linears)
    _assert_gathered_linears(tp, gathered_stacked, *linears, stacked=True)
    for rank, result in enumerate(scattered_stacked):
        stacked_check(rank, *result)
    for (name, _, _, expect), per_rank in zip(cases, results):
        for rank, (y, dx, records) in enumerate(per_rank):
            try:
                expect(rank, y, dx, records)
            except AssertionError as e:
                raise AssertionError(f"{name} on rank {rank} of tp={tp}: {e}") from e
    assert all(r == [("all_reduce", "forward", 12)] for r in forward_only)


# -- ColumnParallelLinear / RowParallelLinear / the MLP --------------------------------

def _column_cases(tp):
    k, n = 5, 3
    cases = []
    for i, (bias, gather) in enumerate([(True, True), (True, False), (False, True),
                                        (False, False)]):
        full = full_linear(k, n * tp, bias, seed=10 + i)
        gen = torch.Generator().manual_seed(20 + i)
        x, w = torch.randn(B, S, k, generator=gen), torch.randn(B, S, n * tp, generator=gen)
        cases.append((bias, gather, full, x, w))
    return cases, k, n


@TP
def test_column_parallel_linear(real_ranks, tp):
    cases, k, n = _column_cases(tp)
    results = run_batch(real_ranks(tp), [(check_column_parallel, (full, x, w, gather))
                                         for _, gather, full, x, w in cases])
    for (bias, gather, full, x, w), per_rank in zip(cases, results):
        ref_y, ref_dx, ref_g = reference(full, x, w)
        for rank, (y, dx, g, records) in enumerate(per_rank):
            close(y, ref_y if gather else ref_y.chunk(tp, -1)[rank])
            close(dx, ref_dx)
            close(g["weight"], ref_g["weight"].chunk(tp, 0)[rank])
            assert ("bias" in g) == bias
            if bias:
                close(g["bias"], ref_g["bias"].chunk(tp, 0)[rank])
            gathered = [("all_gather", "forward", B * S * n * tp)] if gather else []
            assert records == gathered + [("all_reduce", "backward", B * S * k)]
        # the shards' gradients tile the full weight's gradient exactly
        close(torch.cat([g["weight"] for _, _, g, _ in per_rank], 0), ref_g["weight"])


@TP
def test_row_parallel_linear(real_ranks, tp):
    k, n = 3, 5
    cases = []
    for i, (bias, parallel) in enumerate([(True, True), (True, False), (False, True),
                                          (False, False)]):
        full = full_linear(k * tp, n, bias, seed=30 + i)
        gen = torch.Generator().manual_seed(40 + i)
        x, w = torch.randn(B, S, k * tp, generator=gen), torch.randn(B, S, n, generator=gen)
        cases.append((bias, parallel, full, x, w))
    skip_full = full_linear(2 * tp, 3, True, seed=50)
    skip_x = torch.randn(B, S, 2 * tp, generator=torch.Generator().manual_seed(51))
    calls = [(check_row_parallel, (full, x, w, parallel)) for _, parallel, full, x, w in cases]
    *results, skip = run_batch(real_ranks(tp), calls + [(check_row_parallel_skip_g,
                                                         (skip_full, skip_x))])
    for (bias, parallel, full, x, w), per_rank in zip(cases, results):
        ref_y, ref_dx, ref_g = reference(full, x, w)
        for rank, (y, dx, g, records) in enumerate(per_rank):
            close(y, ref_y)
            close(dx, ref_dx.chunk(tp, -1)[rank] if parallel else ref_dx)
            close(g["weight"], ref_g["weight"].chunk(tp, 1)[rank])
            assert ("bias" in g) == bias
            if bias:
                close(g["bias"], ref_g["bias"])
            scatter = [] if parallel else [("all_gather", "backward", B * S * k * tp)]
            assert records == [("all_reduce", "forward", B * S * n)] + scatter
        close(torch.cat([g["weight"] for _, _, g, _ in per_rank], 1), ref_g["weight"])
    # skip_g: partial sums without bias, no communication
    close(sum(p for p, _, _ in skip) + skip[0][1], skip_full(skip_x).detach())
    assert all(records == [] for _, _, records in skip)


@TP
def test_parallel_mlp(real_ranks, tp):
    h, f = 5, 3
    fc1, fc2 = full_linear(h, f * tp, True, seed=60), full_linear(f * tp, h, True, seed=61)
    gen = torch.Generator().manual_seed(62)
    x, w = torch.randn(B, S, h, generator=gen), torch.randn(B, S, h, generator=gen)
    ref_y, ref_dx, ref_g = reference(nn.Sequential(fc1, nn.GELU(), fc2), x, w)
    (results,) = run_batch(real_ranks(tp), [(check_parallel_mlp, (fc1, fc2, x, w))])
    assert_mlp_matches(results, (ref_y, ref_dx, ref_g), tp, B * S * h)


# -- VocabParallelEmbedding ------------------------------------------------------------

@TP
def test_vocab_parallel_embedding(real_ranks, tp):
    d = 4
    cases = []
    # divisible by tp, and (for tp > 1) not; with and without a padding row
    for i, (vocab, pad) in enumerate([(3 * tp, False), (3 * tp + 1, True),
                                      (3 * tp + 1, False), (3 * tp, True)]):
        gen = torch.Generator().manual_seed(70 + i)
        ids = torch.randint(0, vocab, (B, S), generator=gen)
        ids[0, 1] = vocab - 1  # the last real id, next to the padding rows
        padding_idx = int(ids[0, 0]) if pad else None
        full = full_embedding(vocab, d, padding_idx, seed=80 + i)
        w = torch.randn(B, S, d, generator=gen)
        cases.append((vocab, full, ids, w))
    results = run_batch(real_ranks(tp), [(check_vocab_embedding, (full, ids, w))
                                         for _, full, ids, w in cases])
    for (vocab, full, ids, w), per_rank in zip(cases, results):
        assert_vocab_embedding_matches(per_rank, vocab, full, ids, w)


# -- vocab_parallel_cross_entropy ------------------------------------------------------

CE_VOCABS = {1: [7], 2: [12, 7], 4: [16, 13, 5]}  # divisible / padded / a rank of padding


def _ce_cases(tp):
    cases = []
    for vocab in CE_VOCABS[tp]:
        for smoothing in (0.0, 0.2):
            for reduction in ("mean", "sum", "none"):
                for ignore_index in (-100, 0):
                    seed = 7 * len(cases) + 1000 * tp
                    cases.append((vocab, smoothing, reduction, ignore_index, 0.25, seed))
    # everything ignored: torch's mean is nan, the gradient zero
    cases.append((CE_VOCABS[tp][-1], 0.1, "mean", -100, 1.0, 999))
    return cases


@TP
def test_vocab_parallel_cross_entropy(real_ranks, tp):
    b, s = 2, 3
    cases, calls, refs = _ce_cases(tp), [], []
    for vocab, smoothing, reduction, ignore_index, frac, seed in cases:
        logits, target = make_case(b, s, vocab, tp, ignore_index, frac, seed)
        grad = torch.randn(target.shape if reduction == "none" else (),
                           generator=torch.Generator().manual_seed(seed + 1))
        kwargs = dict(ignore_index=ignore_index, label_smoothing=smoothing, reduction=reduction)
        refs.append(ce_reference(logits, target, grad, vocab, **kwargs))
        calls.append((check_vocab_cross_entropy, (logits, target, grad, vocab, kwargs)))
    results = run_batch(real_ranks(tp), calls)
    for case, (ref_loss, ref_grad), per_rank in zip(cases, refs, results):
        vocab, smoothing, _, _, frac, _ = case
        # fixed seeds: only the all-ignored case ignores every token
        assert ref_loss.isnan().any() == (frac == 1.0), case
        for rank, (loss, shard_grad, records) in enumerate(per_rank):
            try:
                close(loss, ref_loss)
                close(shard_grad, ref_grad.chunk(tp, -1)[rank])
            except AssertionError as e:
                raise AssertionError(f"{case} rank {rank}: {e}") from e
            # three forward all-reduces of per-token values (max, sum-exp [+ smoothing's
            # sum of logits, packed with it], target logit); never the b*s*v logits
            assert records == expected_ledger(b * s, smoothing), (case, records)
            assert all(kind == "all_reduce" and direction == "forward" and n < b * s * vocab
                       for kind, direction, n, _ in records), (case, records)


# -- RNG tracker -----------------------------------------------------------------------

@TP
def test_rng_streams_on_real_ranks(real_ranks, tp):
    seed = 1234 + tp
    streams, replay = run_batch(real_ranks(tp), [
        (_isolated_rng, (check_streams, seed, False)),
        (_isolated_rng, (check_dropout_replay, 7, False)),
    ])
    for rank, out in enumerate(streams):
        # the replicated stream: the same draws as a generator seeded with seed, on every rank
        for got, want in zip(out["replicated"], draws(seed, 3)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        # the model-parallel stream: seeded with seed + 2718 + rank, continued across forks
        assert model_parallel_seed(seed, rank) == seed + 2718 + rank
        for got, want in zip(out["parallel"], draws(seed + 2718 + rank, 2)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    first = streams[0]
    for out in streams[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first["replicated"], out["replicated"]))
        assert not torch.equal(first["parallel"][0], out["parallel"][0])
    # dropout masks replay from saved states; outside a fork they agree across ranks
    for (out1, in1), (out2, in2), _, _ in replay:
        assert torch.equal(out1, out2) and torch.equal(in1, in2)
    assert all(torch.equal(replay[0][0][0], r[0][0]) for r in replay)
    assert all(not torch.equal(replay[0][0][1], r[0][1]) for r in replay[1:])
