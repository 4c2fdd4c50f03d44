"""Each f/g mapping against the unsharded math it stands for, and its ledger.

The ``check_*`` functions run on one rank (``fn(ctx, *args)``) and return
tensors, so the same functions can run on simulated or real ranks. Each
rank's loss is ``(y * w_rank).sum()``; the tests compare values and input
gradients with the plain torch expression the collectives implement.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from shardplan.errors import DivisibilityError
from shardplan.ranks import SimulatedRanks
from shardplan.runtime import (CommLedger, copy_to_region, f, g, gather_from_region,
                               gather_from_sequence, reduce_from_region,
                               reduce_scatter_to_sequence, scatter_to_region)

from runtime_helpers import DIM, SEED, SETTINGS, TP, close, comm  # noqa: F401


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def check_mapping(ctx, x, w, name):
    """Apply mapping ``name`` to this rank's input, backward ``(y * w_rank).sum()``.

    ``x`` and ``w`` are stacks over ranks (dim 0) of each rank's input and
    upstream gradient.
    """
    mapping = {"copy": copy_to_region, "reduce": reduce_from_region,
               "scatter": scatter_to_region, "gather": gather_from_region,
               "gather_seq": gather_from_sequence,
               "reduce_scatter_seq": reduce_scatter_to_sequence}[name]
    xr = x[ctx.rank].clone().requires_grad_()
    with CommLedger() as led:
        y = mapping(xr, ctx.group)
        (y * w[ctx.rank]).sum().backward()
    return y.detach(), xr.grad, comm(led)


def _stack(t, tp):
    return t.unsqueeze(0).expand(tp, *t.shape).clone()


@SETTINGS
@given(tp=TP, b=DIM, s=DIM, h=DIM, seed=SEED)
def test_copy_to_region_is_identity_forward_all_reduce_backward(tp, b, s, h, seed):
    gen = torch.Generator().manual_seed(seed)
    x, w = randn(gen, b, s, h), randn(gen, tp, b, s, h)
    for y, grad, records in SimulatedRanks(tp).run(check_mapping, _stack(x, tp), w, "copy"):
        close(y, x)
        close(grad, w.sum(0))
        assert records == [("all_reduce", "backward", b * s * h)]


@SETTINGS
@given(tp=TP, b=DIM, s=DIM, h=DIM, seed=SEED)
def test_reduce_from_region_sums_forward_identity_backward(tp, b, s, h, seed):
    gen = torch.Generator().manual_seed(seed)
    x, w = randn(gen, tp, b, s, h), randn(gen, b, s, h)
    for y, grad, records in SimulatedRanks(tp).run(check_mapping, x, _stack(w, tp), "reduce"):
        close(y, x.sum(0))
        close(grad, w)
        assert records == [("all_reduce", "forward", b * s * h)]


@SETTINGS
@given(tp=TP, b=DIM, s=DIM, h=DIM, seed=SEED)
def test_scatter_to_region_keeps_slice_and_gathers_gradient(tp, b, s, h, seed):
    gen = torch.Generator().manual_seed(seed)
    x, w = randn(gen, b, s, h * tp), randn(gen, b, s, h * tp)
    w_slices = torch.stack(w.chunk(tp, -1))
    results = SimulatedRanks(tp).run(check_mapping, _stack(x, tp), w_slices, "scatter")
    for rank, (y, grad, records) in enumerate(results):
        close(y, x.chunk(tp, -1)[rank])
        close(grad, w)
        assert records == [("all_gather", "backward", b * s * h * tp)]


@SETTINGS
@given(tp=TP, b=DIM, s=DIM, h=DIM, seed=SEED)
def test_gather_from_region_concatenates_and_splits_gradient(tp, b, s, h, seed):
    gen = torch.Generator().manual_seed(seed)
    full, w = randn(gen, b, s, h * tp), randn(gen, b, s, h * tp)
    x = torch.stack(full.chunk(tp, -1))
    for rank, (y, grad, records) in enumerate(
            SimulatedRanks(tp).run(check_mapping, x, _stack(w, tp), "gather")):
        close(y, full)
        close(grad, w.chunk(tp, -1)[rank])
        assert records == [("all_gather", "forward", b * s * h * tp)]


@SETTINGS
@given(tp=TP, b=DIM, s=DIM, h=DIM, seed=SEED)
def test_gather_from_sequence_and_reduce_scatter_gradient(tp, b, s, h, seed):
    gen = torch.Generator().manual_seed(seed)
    full, w = randn(gen, s * tp, b, h), randn(gen, tp, s * tp, b, h)
    x = torch.stack(full.chunk(tp, 0))
    for rank, (y, grad, records) in enumerate(
            SimulatedRanks(tp).run(check_mapping, x, w, "gather_seq")):
        close(y, full)
        close(grad, w.sum(0).chunk(tp, 0)[rank])
        assert records == [("all_gather", "forward", full.numel()),
                           ("reduce_scatter", "backward", full.numel())]


@SETTINGS
@given(tp=TP, b=DIM, s=DIM, h=DIM, seed=SEED)
def test_reduce_scatter_to_sequence_and_gather_gradient(tp, b, s, h, seed):
    gen = torch.Generator().manual_seed(seed)
    x, w = randn(gen, tp, s * tp, b, h), randn(gen, s * tp, b, h)
    w_slices = torch.stack(w.chunk(tp, 0))
    for rank, (y, grad, records) in enumerate(
            SimulatedRanks(tp).run(check_mapping, x, w_slices, "reduce_scatter_seq")):
        close(y, x.sum(0).chunk(tp, 0)[rank])
        close(grad, w)
        assert records == [("reduce_scatter", "forward", w.numel()),
                           ("all_gather", "backward", w.numel())]


def check_forward_only(ctx, x):
    """f forward and g backward are identities: they record nothing."""
    with CommLedger() as led:
        f(x, ctx.group)
        xr = x.clone().requires_grad_()
        g(xr, ctx.group).sum().backward()
    return comm(led)


def test_identity_directions_do_not_communicate():
    for records in SimulatedRanks(2).run(check_forward_only, torch.ones(3, 4)):
        assert records == [("all_reduce", "forward", 12)]


def test_aliases():
    assert f is copy_to_region and g is reduce_from_region


def check_scatter_indivisible(ctx, x):
    try:
        scatter_to_region(x, ctx.group)
    except DivisibilityError as e:
        return str(e)
    return None


def test_scatter_of_indivisible_dim_raises():
    for message in SimulatedRanks(2).run(check_scatter_indivisible, torch.ones(2, 3)):
        assert message is not None and "tp=2" in message


@pytest.mark.parametrize("tp", [1, 2])
def test_ledger_site_is_the_callers_line(tp):
    def check(ctx, x):
        with CommLedger() as led:
            reduce_from_region(x, ctx.group)
        return led.records[0].site

    for site in SimulatedRanks(tp).run(check, torch.ones(2)):
        assert site.startswith(__file__) and "shardplan/runtime" not in site


def check_carried_regather(ctx, full_x, w, w_out, carried):
    """A sequence-parallel region on one rank: linears on the gathered shard of
    ``full_x`` (the opener), a row linear (the closer) reduce-scattered back onto the
    tokens; with ``carried`` the closer's backward gathers the opener's shard too."""
    from shardplan.runtime.mappings import RegatherLink, linears_on_gathered_sequence
    shard = full_x.chunk(ctx.group.size, 1)[ctx.rank].clone().requires_grad_()
    wr = w.chunk(ctx.group.size, 0)[ctx.rank].clone().requires_grad_()
    wo = w_out.chunk(ctx.group.size, 1)[ctx.rank].clone().requires_grad_()
    link = RegatherLink(1) if carried else None
    with CommLedger() as led:
        (y,) = linears_on_gathered_sequence(None, shard, (wr, None), ctx.group, dim=1,
                                            link=link, slot=0)
        out = reduce_scatter_to_sequence(torch.nn.functional.linear(y.relu(), wo), ctx.group,
                                         dim=1, link=link, shards=(shard,) if carried else ())
        out.square().sum().backward()
    return out.detach(), shard.grad, wr.grad, wo.grad, comm(led)


def test_carried_regather_matches_own_regather():
    """The closer's backward all-gather carries the opener's shard (one call of gradient
    and shard) and the gradients are the same as with the opener's own re-gather, which
    equal the unsharded region's; every rank."""
    tp, b, s, h = 2, 2, 4, 6
    gen = torch.Generator().manual_seed(0)
    x, w, wo = randn(gen, b, s, h), randn(gen, 8, h), randn(gen, h, 8)
    ref_x, ref_w, ref_wo = (t.clone().requires_grad_() for t in (x, w, wo))
    ref = torch.nn.functional.linear(torch.nn.functional.linear(ref_x, ref_w).relu(), ref_wo)
    ref.square().sum().backward()
    own = SimulatedRanks(tp).run(check_carried_regather, x, w, wo, False)
    carried = SimulatedRanks(tp).run(check_carried_regather, x, w, wo, True)
    n = b * s * h
    for rank, (a, c) in enumerate(zip(own, carried)):
        for got in (a, c):
            close(got[0], ref.detach().chunk(tp, 1)[rank])
            close(got[1], ref_x.grad.chunk(tp, 1)[rank])
            close(got[2], ref_w.grad.chunk(tp, 0)[rank])
            close(got[3], ref_wo.grad.chunk(tp, 1)[rank])
        backward = lambda recs: sorted(r for r in recs if r[1] == "backward")  # noqa: E731
        assert backward(a[4]) == [("all_gather", "backward", n), ("all_gather", "backward", n),
                                  ("reduce_scatter", "backward", n)]
        assert backward(c[4]) == [("all_gather", "backward", 2 * n),
                                  ("reduce_scatter", "backward", n)]


def check_all_gather_many(ctx):
    """Tensors of three dtypes, one not contiguous, gathered in one call and apart."""
    r = ctx.rank
    a = torch.arange(30.).view(2, 3, 5) + 100 * r
    b = (torch.arange(30).view(2, 3, 5) + 100 * r).to(torch.bfloat16)
    c = torch.arange(7, dtype=torch.float64)[:, None].expand(7, 3) + r
    with CommLedger() as led:
        together = ctx.group.all_gather_many([a, b, c], [1, 1, 0])
    return together, comm(led)


def test_all_gather_many_is_each_all_gather_in_one_call():
    tp = 3
    for together, records in SimulatedRanks(tp).run(check_all_gather_many):
        a, b, c = together
        want_a = torch.cat([torch.arange(30.).view(2, 3, 5) + 100 * r for r in range(tp)], 1)
        assert torch.equal(a, want_a)
        assert b.dtype == torch.bfloat16 and torch.equal(b, want_a.to(torch.bfloat16))
        assert c.dtype == torch.float64 and torch.equal(
            c, torch.cat([torch.arange(7.)[:, None].expand(7, 3) + r for r in range(tp)], 0)
            .double())
        assert records == [("all_gather", "none", tp * (30 + 30 + 21))]
