"""Parallel layers against the unsharded nn.Linear / nn.Embedding they replace.

A full reference module is built once (fixed seed), each rank takes its
shard with ``from_full`` of its own deepcopy, and the test compares outputs,
input gradients and each shard's weight gradient with the matching slice of
the reference's, plus the ledger against Megatron's counts. ``check_*``
functions are per-rank and picklable, for simulated or real ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from shardplan.errors import ConfigurationError, DivisibilityError
from shardplan.ranks import SimulatedRanks
from shardplan.runtime import (ColumnParallelLinear, CommLedger, RowParallelLinear,
                               VocabParallelEmbedding, padded_vocab_size, vocab_range)
from shardplan.runtime.comm import Rendezvous, ThreadGroup

from runtime_helpers import DIM, SEED, SETTINGS, TP, assert_mlp_matches, close, comm  # noqa: F401


def idle_group(rank: int, size: int) -> ThreadGroup:
    """A group for building layers outside a runner (it must not communicate)."""
    return ThreadGroup(rank, Rendezvous(size))


def full_linear(in_features, out_features, bias, seed) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return layer


def full_embedding(num, dim, padding_idx, seed) -> nn.Embedding:
    gen = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(num, dim, padding_idx=padding_idx)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(num, dim, generator=gen))
        if padding_idx is not None:
            emb.weight[padding_idx] = 0
    return emb


def reference(module, x, w):
    """Output, input gradient and parameter gradients of ``(module(x) * w).sum()``."""
    module = copy.deepcopy(module)
    x = x.clone().requires_grad_(x.is_floating_point())
    y = module(x)
    (y * w).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def grads(layer) -> dict:
    return {n: p.grad for n, p in layer.named_parameters()}


# ---- ColumnParallelLinear --------------------------------------------------------------

def check_column_parallel(ctx, full, x, w, gather_output):
    layer = ColumnParallelLinear.from_full(copy.deepcopy(full), ctx.group,
                                           gather_output=gather_output)
    w_local = w if gather_output else w.chunk(ctx.world_size, -1)[ctx.rank]
    xr = x.clone().requires_grad_()
    with CommLedger() as led:
        y = layer(xr)
        (y * w_local).sum().backward()
    return y.detach(), xr.grad, grads(layer), comm(led)


@SETTINGS
@given(tp=TP, b=DIM, s=DIM, k=st.integers(1, 6), n=DIM, bias=st.booleans(),
       gather_output=st.booleans(), seed=SEED)
def test_column_parallel_matches_linear(tp, b, s, k, n, bias, gather_output, seed):
    full = full_linear(k, n * tp, bias, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x, w = torch.randn(b, s, k, generator=gen), torch.randn(b, s, n * tp, generator=gen)
    ref_y, ref_dx, ref_g = reference(full, x, w)
    results = SimulatedRanks(tp).run(check_column_parallel, full, x, w, gather_output)
    for rank, (y, dx, g, records) in enumerate(results):
        close(y, ref_y if gather_output else ref_y.chunk(tp, -1)[rank])
        close(dx, ref_dx)
        close(g["weight"], ref_g["weight"].chunk(tp, 0)[rank])
        if bias:
            close(g["bias"], ref_g["bias"].chunk(tp, 0)[rank])
        gather = [("all_gather", "forward", b * s * n * tp)] if gather_output else []
        assert records == gather + [("all_reduce", "backward", b * s * k)]


# ---- RowParallelLinear -----------------------------------------------------------------

def check_row_parallel(ctx, full, x, w, input_is_parallel):
    layer = RowParallelLinear.from_full(copy.deepcopy(full), ctx.group,
                                        input_is_parallel=input_is_parallel)
    x_in = x.chunk(ctx.world_size, -1)[ctx.rank] if input_is_parallel else x
    xr = x_in.clone().requires_grad_()
    with CommLedger() as led:
        y = layer(xr)
        (y * w).sum().backward()
    return y.detach(), xr.grad, grads(layer), comm(led)


@SETTINGS
@given(tp=TP, b=DIM, s=DIM, k=DIM, n=st.integers(1, 6), bias=st.booleans(),
       input_is_parallel=st.booleans(), seed=SEED)
def test_row_parallel_matches_linear(tp, b, s, k, n, bias, input_is_parallel, seed):
    full = full_linear(k * tp, n, bias, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x, w = torch.randn(b, s, k * tp, generator=gen), torch.randn(b, s, n, generator=gen)
    ref_y, ref_dx, ref_g = reference(full, x, w)
    results = SimulatedRanks(tp).run(check_row_parallel, full, x, w, input_is_parallel)
    for rank, (y, dx, g, records) in enumerate(results):
        close(y, ref_y)
        close(dx, ref_dx.chunk(tp, -1)[rank] if input_is_parallel else ref_dx)
        close(g["weight"], ref_g["weight"].chunk(tp, 1)[rank])
        if bias:
            close(g["bias"], ref_g["bias"])
        scatter = [] if input_is_parallel else [("all_gather", "backward", b * s * k * tp)]
        assert records == [("all_reduce", "forward", b * s * n)] + scatter


def check_row_parallel_skip_g(ctx, full, x):
    layer = RowParallelLinear.from_full(copy.deepcopy(full), ctx.group, skip_g=True)
    with CommLedger() as led:
        partial = layer(x.chunk(ctx.world_size, -1)[ctx.rank])
    return partial, layer.bias.detach(), comm(led)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_skip_g_returns_partial_without_bias(tp):
    full = full_linear(8, 3, True, 0)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    results = SimulatedRanks(tp).run(check_row_parallel_skip_g, full, x)
    close(sum(p for p, _, _ in results) + results[0][1], full(x).detach())
    assert all(records == [] for _, _, records in results)


# ---- the Megatron MLP: column -> gelu -> row -------------------------------------------

def check_parallel_mlp(ctx, fc1, fc2, x, w):
    col = ColumnParallelLinear.from_full(copy.deepcopy(fc1), ctx.group)
    row = RowParallelLinear.from_full(copy.deepcopy(fc2), ctx.group)
    xr = x.clone().requires_grad_()
    with CommLedger() as led:
        y = row(F.gelu(col(xr)))
        (y * w).sum().backward()
    return y.detach(), xr.grad, grads(col), grads(row), comm(led)


@SETTINGS
@given(tp=TP, b=DIM, s=DIM, h=st.integers(1, 6), f=DIM, seed=SEED)
def test_parallel_mlp_matches_and_communicates_like_megatron(tp, b, s, h, f, seed):
    fc1, fc2 = full_linear(h, f * tp, True, seed), full_linear(f * tp, h, True, seed + 1)
    mlp = nn.Sequential(fc1, nn.GELU(), fc2)
    gen = torch.Generator().manual_seed(seed + 2)
    x, w = torch.randn(b, s, h, generator=gen), torch.randn(b, s, h, generator=gen)
    ref_y, ref_dx, ref_g = reference(mlp, x, w)
    results = SimulatedRanks(tp).run(check_parallel_mlp, fc1, fc2, x, w)
    assert_mlp_matches(results, (ref_y, ref_dx, ref_g), tp, b * s * h)


# ---- VocabParallelEmbedding ------------------------------------------------------------

def check_vocab_embedding(ctx, full, ids, w):
    layer = VocabParallelEmbedding.from_full(copy.deepcopy(full), ctx.group)
    with CommLedger() as led:
        y = layer(ids)
        (y * w).sum().backward()
    return y.detach(), layer.weight.detach(), layer.weight.grad, layer.padded_vocab, comm(led)


def assert_vocab_embedding_matches(results, vocab, full, ids, w) -> None:
    """Each rank's output, weight shard (padded vocabulary) and gradient against the
    full embedding's; one forward all-reduce of the output."""
    tp, d = len(results), full.weight.shape[1]
    ref_y, _, ref_g = reference(full, ids, w)
    padded = padded_vocab_size(vocab, tp)
    padded_weight = torch.cat([full.weight.detach(), torch.zeros(padded - vocab, d)])
    padded_grad = torch.cat([ref_g["weight"], torch.zeros(padded - vocab, d)])
    for rank, (y, weight, grad, padded_vocab, records) in enumerate(results):
        assert padded_vocab == padded and padded % tp == 0 and padded - vocab < tp
        close(y, ref_y)
        torch.testing.assert_close(weight, padded_weight.chunk(tp)[rank], atol=0, rtol=0)
        close(grad, padded_grad.chunk(tp)[rank])
        assert records == [("all_reduce", "forward", ids.numel() * d)]


@SETTINGS
@given(tp=TP, b=DIM, s=DIM, vocab=st.integers(1, 40), d=DIM, pad=st.booleans(), seed=SEED)
def test_vocab_parallel_embedding_matches_embedding(tp, b, s, vocab, d, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=gen)
    padding_idx = int(ids[0, 0]) if pad else None
    full = full_embedding(vocab, d, padding_idx, seed)
    w = torch.randn(b, s, d, generator=gen)
    assert_vocab_embedding_matches(SimulatedRanks(tp).run(check_vocab_embedding, full, ids, w),
                                   vocab, full, ids, w)


def check_embedding_rejects(ctx, full, ids):
    layer = VocabParallelEmbedding.from_full(copy.deepcopy(full), ctx.group)
    try:
        layer(ids)
    except ConfigurationError as e:
        return str(e)
    return None


@pytest.mark.parametrize("bad", [-1, 7, 8])
def test_vocab_parallel_embedding_rejects_out_of_range_ids(bad):
    full = full_embedding(7, 3, None, 0)  # padded to 8 over tp=4: id 7 is a padding row
    for message in SimulatedRanks(4).run(check_embedding_rejects, full,
                                         torch.tensor([[0, bad, 2]])):
        assert message is not None and f"id {bad}" in message


def test_vocab_range_partitions_the_padded_vocabulary():
    assert padded_vocab_size(50257, 8) == 50264
    ranges = [vocab_range(24, r, 4) for r in range(4)]
    assert ranges == [(0, 6), (6, 12), (12, 18), (18, 24)]
    with pytest.raises(DivisibilityError):
        vocab_range(10, 0, 4)


# ---- construction ----------------------------------------------------------------------

@pytest.mark.parametrize("cls,k,n,name", [(ColumnParallelLinear, 8, 6, "out_features"),
                                          (RowParallelLinear, 6, 8, "in_features")])
def test_indivisible_split_dimension_raises(cls, k, n, name):
    with pytest.raises(DivisibilityError, match=f"{name}=6 does not divide by tp=4") as err:
        cls(k, n, group=idle_group(0, 4))
    assert err.value.fix and "tp" in err.value.fix


def test_meta_construction_allocates_nothing():
    big = 1 << 20  # a full (big, big) fp32 weight would be 4 TiB
    group = idle_group(3, 8)
    col = ColumnParallelLinear(big, big, group=group, device="meta")
    row = RowParallelLinear(big, big, group=group, device="meta")
    emb = VocabParallelEmbedding(big + 1, big, group=group, device="meta")
    assert all(p.is_meta for m in (col, row, emb) for p in m.parameters())
    assert col.weight.shape == (big // 8, big) and col.bias.shape == (big // 8,)
    assert row.weight.shape == (big, big // 8) and row.bias.shape == (big,)
    assert emb.weight.shape == (emb.padded_vocab // 8, big)
    assert emb.vocab_start == 3 * (emb.padded_vocab // 8)


def test_from_full_copies_the_slice():
    full, emb = full_linear(8, 8, True, 0), full_embedding(10, 4, None, 0)
    for layer in (ColumnParallelLinear.from_full(full, idle_group(1, 2)),
                  RowParallelLinear.from_full(full, idle_group(1, 2)),
                  VocabParallelEmbedding.from_full(emb, idle_group(1, 2))):
        for p in layer.parameters():
            storage = p.untyped_storage()
            assert storage.nbytes() == p.numel() * p.element_size()
            assert storage.data_ptr() not in (full.weight.untyped_storage().data_ptr(),
                                              emb.weight.untyped_storage().data_ptr())
            assert p.is_contiguous() and isinstance(p, nn.Parameter)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_direct_construction_is_a_slice_of_torch_init(tp):
    """The same seed gives the same model for every tp."""
    with torch.random.fork_rng():
        torch.manual_seed(5)
        ref_lin = nn.Linear(8, 12)
        torch.manual_seed(5)
        ref_emb = nn.Embedding(10, 3, padding_idx=9)
        for rank in range(tp):
            group = idle_group(rank, tp)
            torch.manual_seed(5)
            col = ColumnParallelLinear(8, 12, group=group)
            torch.manual_seed(5)
            row = RowParallelLinear(8, 12, group=group)
            torch.manual_seed(5)
            emb = VocabParallelEmbedding(10, 3, group=group, padding_idx=-1)
            close(col.weight, ref_lin.weight.chunk(tp, 0)[rank])
            close(col.bias, ref_lin.bias.chunk(tp, 0)[rank])
            close(row.weight, ref_lin.weight.chunk(tp, 1)[rank])
            close(row.bias, ref_lin.bias)
            padded = torch.cat([ref_emb.weight, torch.zeros(emb.padded_vocab - 10, 3)])
            close(emb.weight, padded.chunk(tp)[rank])
            assert emb.padding_idx == 9


def test_from_full_rejects_unsupported_modules():
    with pytest.raises(ConfigurationError, match="nn.Linear"):
        ColumnParallelLinear.from_full(nn.Conv1d(2, 2, 1), idle_group(0, 2))
    with pytest.raises(ConfigurationError, match="max_norm"):
        VocabParallelEmbedding.from_full(nn.Embedding(4, 2, max_norm=1.0), idle_group(0, 2))
