"""Dropout masks: different across TP ranks inside sharded regions, identical outside."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rng_cases import SEED, masks


@pytest.mark.real
@pytest.mark.timeout(120)
def test_masks_differ_inside_regions_and_agree_outside(real_ranks):
    (in0, out0, code), (in1, out1, _) = real_ranks(2).run(masks)
    assert "tp_rng" in code  # the split-activation dropout runs on the model-parallel stream
    assert not torch.equal(in0, in1)
    assert torch.equal(out0, out1)
    for rank, got in enumerate((in0, in1)):  # Megatron's seeding: seed + 2718 + tp rank
        torch.manual_seed(SEED + 2718 + rank)
        want = F.dropout(torch.ones(got.shape), 0.5, True) == 0
        assert torch.equal(got, want), rank


@pytest.mark.parametrize("kind", ["dropout", "feature_dropout"])
def test_region_draw_is_the_one_aten_draws_from_that_state(kind):
    """``region_random``'s dropouts take the generator state as data: from one state they
    draw aten's own masks (``F.dropout`` / ``F.dropout2d`` on a generator set to it), and
    advance the state as far as aten advances the generator."""
    from shardplan.runtime import region_random
    x = torch.randn(3, 4, 5, 6)
    state = torch.Generator().manual_seed(7).get_state()
    ours = getattr(region_random, kind)(state, x, 0.3, True)
    saved = torch.get_rng_state()
    try:
        torch.set_rng_state(torch.Generator().manual_seed(7).get_state())
        want = (F.dropout if kind == "dropout" else F.dropout2d)(x, 0.3, training=True)
        after = torch.get_rng_state()
    finally:
        torch.set_rng_state(saved)
    assert torch.equal(ours, want) and not torch.equal(ours, x)
    assert torch.equal(state, after)
