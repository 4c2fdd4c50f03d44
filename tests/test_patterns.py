"""Real-model patterns that Megatron shards: each sharded equals unsharded on every rank
(outputs, loss, every gradient copy) and is really sharded (the plan's layouts)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardplan

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


def assert_sharded_and_equal(model, tp, example, layouts: dict) -> None:
    """``verify`` (every rank's outputs and gradients equal the unsharded model's) and
    the plan's parameter layouts (``name -> layout string``; ``R`` would mean a fallback)."""
    report = shardplan.verify(model, tp, example_inputs=example)
    assert report.ok, str(report)
    plan = shardplan.plan(model, tp, example_inputs=example)
    assert {n: plan.param(n).layout for n in layouts} == layouts
    assert not plan.warnings, plan.warnings


class ViewedQKV(nn.Module):
    """A fused QKV taken apart by a view with the 3 as its own dim: timm's ViT
    (``reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)``) or indexing."""

    def __init__(self, how: str, dim: int = 16, heads: int = 4):
        super().__init__()
        self.how, self.heads = how, heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        if self.how == "timm":
            q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads) \
                .permute(2, 0, 3, 1, 4).unbind(0)
        else:
            qkv = self.qkv(x).view(B, N, 3, self.heads, C // self.heads)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, N, C))


@pytest.mark.parametrize("how", ["timm", "index"])
@pytest.mark.parametrize("tp", [2, 4])
def test_fused_qkv_separated_by_a_view_is_blocked(how, tp):
    """Each rank holds [q_r | k_r | v_r] of the fused weight; the projection is row parallel."""
    torch.manual_seed(0)
    assert_sharded_and_equal(ViewedQKV(how), tp, (torch.randn(2, 5, 16),), {
        "qkv.weight": "S(0|16+16+16)", "qkv.bias": "S(0|16+16+16)", "proj.weight": "S(1)"})


class EinsumAttention(nn.Module):
    """Attention written with ``torch.einsum``, its output projection an einsum over
    (heads, head_dim) with a parameter: row parallel without a linear."""

    def __init__(self, dim: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim) for _ in range(3))
        self.out = nn.Parameter(torch.randn(heads, dim // heads, dim) / dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (w(x).view(B, T, self.heads, -1) for w in (self.wq, self.wk, self.wv))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(C // self.heads)
        y = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
        return torch.einsum("...hd,hdc->...c", y, self.out)


@pytest.mark.parametrize("tp", [2, 4])
def test_einsum_attention_is_sharded(tp):
    torch.manual_seed(0)
    assert_sharded_and_equal(EinsumAttention(), tp, (torch.randn(2, 5, 16),), {
        "wq.weight": "S(0)", "wk.weight": "S(0)", "wv.weight": "S(0)", "out": "S(0)"})


class ParallelBranches(nn.Module):
    """GPT-J / PaLM's parallel block without biases: ``mlp(x) + proj(x) + x``."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)
        self.fc, self.proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x))) + self.proj(torch.tanh(self.fc(x))) + x


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_branches_share_one_g(tp):
    """Two row-parallel results added together are one partial sum: one g of b*s*h after
    the sum, not one per branch (strategy.partial_sums)."""
    torch.manual_seed(0)
    example = (torch.randn(2, 5, 16),)
    assert_sharded_and_equal(ParallelBranches(), tp, example, {
        "up.weight": "S(0)", "down.weight": "S(1)", "fc.weight": "S(0)", "proj.weight": "S(1)"})
    plan = shardplan.plan(ParallelBranches(), tp, example_inputs=example)
    assert [c.elements for c in plan.collectives if c.purpose == "g"] == [2 * 5 * 16]


class SinkAttention(nn.Module):
    """GPT-OSS's attention sinks: a learned logit per head joined to the scores along the
    keys (``sinks.reshape(1, -1, 1, 1).expand(...)``, then ``cat``), dropped after the
    softmax; and its interleaved gate | up (``h[..., ::2]``, ``h[..., 1::2]``).
    ``shared``: the sinks are also read whole elsewhere, so they cannot be held split."""

    def __init__(self, shared: bool, dim: int = 16, heads: int = 4):
        super().__init__()
        self.shared, self.heads = shared, heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj, self.fc, self.down = nn.Linear(dim, dim), nn.Linear(dim, 4 * dim), \
            nn.Linear(2 * dim, dim)
        self.sinks = nn.Parameter(torch.randn(heads))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (f(x).view(B, T, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(2, 3)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, T, -1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
        x = x + self.proj((probs @ v).transpose(1, 2).reshape(B, T, C))
        h = self.fc(x)
        out = x + self.down(F.silu(h[..., ::2]) * h[..., 1::2])
        return out + self.sinks.sum() if self.shared else out


@pytest.mark.parametrize("shared, tp", [(False, 2), (False, 4), (True, 2)])
def test_sinks_split_with_the_heads_and_interleaved_gate_up(shared, tp):
    """The per-head sinks parameter is held split like the heads (each rank binds its
    heads' sinks, no all-reduce of their gradient); read whole elsewhere too, it stays
    whole and its view is sliced per rank. The interleaved gate | up splits contiguously:
    each rank holds whole (gate, up) pairs."""
    torch.manual_seed(0)
    example = (torch.randn(2, 5, 16),)
    assert_sharded_and_equal(SinkAttention(shared), tp, example, {
        "q.weight": "S(0)", "proj.weight": "S(1)", "sinks": "R" if shared else "S(0)",
        "fc.weight": "S(0)", "fc.bias": "S(0)", "down.weight": "S(1)"})
    plan = shardplan.plan(SinkAttention(shared), tp, example_inputs=example)
    f = [c for c in plan.collectives if c.purpose == "f"]
    # one f before the MLP (the input needs no gradient); whole sinks sliced after their
    # view per rank need one more, for their gradient
    assert len(f) == 1 + shared, f
