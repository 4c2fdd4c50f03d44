"""Real-model patterns that Megatron shards: each sharded equals unsharded on every rank
(outputs, loss, every gradient copy) and is really sharded (the plan's layouts)."""

from __future__ import annotations

import pytest
import torch

from shardplan.layouts import Shard
from shardplan.planner.capture import capture
from shardplan.ranks import SimulatedRanks

from checks import assert_equivalent, assert_megatron_layouts
from planner_cases import batch, make_model, reference, sharded_step


@pytest.mark.parametrize("tp", [2, 4])
def test_multi_query_attention_shards_the_queries(tp):
    """One K/V head (multi-query attention): every rank holds it whole (its gradient
    summed over tp) and its own query heads; attention and MLP are split."""
    model = make_model("llama", n_layers=1, n_heads=4, n_kv_heads=1)
    idx, tgt = batch(64, 2, 5)
    captured = capture(model, (idx, tgt))  # once for all ranks: export is the slow part
    results = SimulatedRanks(tp).run(sharded_step, model, idx, tgt, True, captured)
    assert_equivalent(results, reference(model, idx, tgt))
    layouts = results[0][3]
    assert_megatron_layouts(model, layouts, tp)
    for name in ("layers.0.attention.wk.weight", "layers.0.attention.wv.weight"):
        assert layouts[name] == Shard(0, replicas=tp), layouts[name]
    assert layouts["layers.0.attention.wq.weight"] == Shard(0)
    assert results[0][2]["layers.0.attention.wq.weight"].shape[0] == 32 // tp
