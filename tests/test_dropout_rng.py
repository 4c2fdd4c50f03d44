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
