"""Heads that do not divide tp, and K/V heads repeated outside them, still shard.

- SmolLM2's shape (9 query heads, 3 K/V heads) at tp 2 and 4: the attention stays
  whole on every rank, with a warning naming the head split that does not divide;
  the MLP and the vocabulary split; equal to the unsharded model on every rank
  (simulated, and on real gloo ranks); ``strict=True`` refuses with the tps that do;
- interleaved grouped-query attention (query head h reads K/V head h % kv_heads,
  x-transformers' ``repeat(t, 'b kvh n d -> b (r kvh) n d')``): the queries, the
  output projection and the MLP split, K/V stay whole or are gathered, at tp 2 and 4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardplan
from shardplan.errors import DivisibilityError
from shardplan.layouts import Replicate, Shard
from shardplan.ranks import SimulatedRanks

pytest.importorskip("transformers", reason="needs the hf extra (pip install -e '.[hf]')")

from checks import assert_equivalent  # noqa: E402
from hf_cases import build, inputs, reference, step  # noqa: E402


def smollm():
    """SmolLM2-135M's head counts (9 query, 3 K/V heads) at a tiny width."""
    return build("llama", heads=9, kv_heads=3, hidden=72)


def _check_uneven(results, model, tp: int) -> None:
    layouts, plan = results[0][3], results[0][5]
    attn = "model.layers.0.self_attn"
    for proj in ("q_proj", "k_proj", "v_proj"):  # no split keeps 9 heads whole
        assert isinstance(layouts[f"{attn}.{proj}.weight"], Replicate), proj
    assert isinstance(layouts["model.layers.1.mlp.gate_proj.weight"], Shard)
    assert isinstance(layouts["model.layers.1.mlp.down_proj.weight"], Shard)
    assert isinstance(layouts["lm_head.weight"], Shard)
    assert any(f"q_proj) kept replicated: split of a sharded dim into [9, 8] does not divide "
               f"by tp={tp}" in w for w in plan.warnings), plan.warnings
    full = sum(p.numel() for p in model.parameters())
    local = sum(g.numel() for g in results[0][2].values())
    assert local < 0.6 * full  # the MLP and the vocabulary are split


@pytest.mark.parametrize("tp", [2, 4])
def test_nine_heads_shard_the_rest_and_keep_attention_whole(tp):
    model, kw = smollm(), inputs()
    results = SimulatedRanks(tp).run(step, model, kw)
    assert_equivalent(results, reference(model, kw))
    _check_uneven(results, model, tp)


def _real_step(ctx, kw):
    return step(ctx, smollm(), kw)


@pytest.mark.real
def test_nine_heads_on_real_ranks(real_ranks):
    kw = inputs()
    results = real_ranks(2).run(_real_step, kw)
    assert_equivalent(results, reference(smollm(), kw))
    _check_uneven(results, smollm(), 2)


def test_nine_heads_strict_refuses_naming_the_tps_that_divide():
    with pytest.raises(DivisibilityError, match=r"choose a tp dividing 3: 3 \(tp=2 does not\)"):
        shardplan.plan(smollm(), 2, example_inputs=inputs(), strict=True)


class InterleavedGQA(nn.Module):
    """Causal attention whose K/V heads are repeated outside them, then an MLP."""

    def __init__(self, dim=64, heads=4, kv_heads=2, vocab=64):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.emb = nn.Embedding(vocab, dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        r = self.heads // self.kv_heads

        def repeat(z):  # [B, KV, T, D] -> [B, r*KV, T, D]: head h reads K/V head h % KV
            z = z.view(b, t, self.kv_heads, self.hd).transpose(1, 2)
            return z.unsqueeze(1).expand(b, r, self.kv_heads, t, self.hd).reshape(
                b, r * self.kv_heads, t, self.hd)
        y = F.scaled_dot_product_attention(q, repeat(self.k(x)), repeat(self.v(x)), is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, -1))
        x = x + self.down(F.gelu(self.up(x)))
        return self.head(x)


@pytest.mark.parametrize("tp", [2, 4])
def test_interleaved_gqa_splits_queries_and_mlp(tp):
    torch.manual_seed(0)
    model = InterleavedGQA()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    report = shardplan.verify(model, tp, example_inputs=(ids,))
    assert report.ok, str(report)
    plan = shardplan.plan(model, tp, example_inputs=(ids,))
    lay = {p.name: p.layout for p in plan.params}
    for name in ("q.weight", "o.weight", "up.weight", "down.weight"):
        assert lay[name] != "R", (name, lay[name])
    # K/V: whole on every rank, or split and gathered before the repeat (the plan's choice)
    gathered = [c for c in plan.collectives if c.purpose == "gather"]
    kept = [w for w in plan.warnings if "K/V heads repeated outside them" in w]
    assert kept or (gathered and lay["k.weight"] != "R"), (plan.warnings, lay)
