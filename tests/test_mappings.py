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


def gathered_order(t, tp, dim):
    """``t`` with its positions along ``dim`` in the order a stacked all-gather leaves
    them: the ``tp`` parts one after another."""
    return torch.stack(t.chunk(tp, dim)).reshape(t.shape)


def check_stacked_scatter(ctx, x, w):
    """``reduce_scatter_to_sequence(stacked=True)`` along dim 1 of this rank's input,
    backward ``(y * w_rank).sum()``."""
    xr = x[ctx.rank].clone().requires_grad_()
    with CommLedger() as led:
        y = reduce_scatter_to_sequence(xr, ctx.group, dim=1, stacked=True)
        (y * w[ctx.rank]).sum().backward()
    return y.detach(), xr.grad, comm(led)


def stacked_scatter_case(gen, tp, b, s, h):
    """(inputs in the gathered order, upstream gradients, check(rank, y, grad, records))
    against the sums written out in sequence order."""
    x, w = randn(gen, tp, b, s * tp, h), randn(gen, b, s * tp, h)
    stacked = torch.stack([gathered_order(x[r], tp, 1) for r in range(tp)])

    def check(rank, y, grad, records):
        close(y, x.sum(0).chunk(tp, 1)[rank])
        close(grad, gathered_order(w, tp, 1))
        assert records == [("reduce_scatter", "forward", w.numel()),
                           ("all_gather", "backward", w.numel())]
    return stacked, torch.stack(w.chunk(tp, 1)), check


@SETTINGS
@given(tp=TP, b=DIM, s=DIM, h=DIM, seed=SEED)
def test_stacked_reduce_scatter_reads_the_gathered_order(tp, b, s, h, seed):
    """Tokens in the order a stacked gather left them (dim 1, not the outermost): each
    rank gets the same sum of its tokens as from the sequence order, and the gradient's
    all-gather leaves them in the gathered order again."""
    x, w, check = stacked_scatter_case(torch.Generator().manual_seed(seed), tp, b, s, h)
    for rank, result in enumerate(SimulatedRanks(tp).run(check_stacked_scatter, x, w)):
        check(rank, *result)


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
