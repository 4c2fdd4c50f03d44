"""Loading a full checkpoint costs each rank about 1/tp of the model plus one tensor."""

from __future__ import annotations

import sys

import pytest
import safetensors.torch

from memory_cases import CONFIG, load_peak
from shardplan.models import build


@pytest.mark.real
@pytest.mark.timeout(240)
@pytest.mark.skipif(sys.platform != "linux", reason="reads peak RSS from /proc (Linux only)")
def test_peak_memory_while_loading_is_a_shard_plus_one_tensor(real_ranks, tmp_path):
    model = build("gpt-tiny", **CONFIG)
    file = tmp_path / "full.safetensors"
    safetensors.torch.save_model(model, file)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    del model
    for grown, held in real_ranks(2).run(load_peak, str(file)):
        assert held < 0.6 * full  # the shard itself: about half the model
        assert grown >= 0.5 * held  # the measurement sees the shard being allocated
        assert grown <= held + largest + 16 * 2**20, (grown, held, largest, full)
        assert grown < 0.8 * full  # never the whole model
