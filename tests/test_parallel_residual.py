"""Parallel-residual blocks pay one forward all-reduce per layer, as Megatron's do.

``x + attn(h) + mlp(h)`` sums two row-parallel outputs into the residual stream;
the planner regroups the sum as ``x + (attn + mlp)`` so that one g serves both
(``planner/reassociate.py``), row biases added once after it. Every spelling
(``x + a + m``, ``a + m + x``, ``x + (a + m)``, in place ``+=``), with and without
biases, equals the unsharded model on every rank and has Megatron's count:
the embedding's g and one g per layer forward, one f per layer backward (the
one norm's output enters both regions) and the head's. HF GPT-J and GPT-NeoX
likewise.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardplan
from shardplan.layouts import Shard
from shardplan.ranks import SimulatedRanks
from shardplan.runtime.ledger import CommLedger

from checks import assert_equivalent

D, VOCAB, LAYERS = 32, 64, 2
SPELLINGS = ["x + a + m", "a + m + x", "x + (a + m)", "x += a; x += m"]


class Block(nn.Module):
    def __init__(self, spelling: str, bias: bool):
        super().__init__()
        self.spelling = spelling
        self.norm = nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D, bias=bias), nn.Linear(D, D, bias=bias)
        self.gate, self.up = nn.Linear(D, 4 * D, bias=bias), nn.Linear(D, 4 * D, bias=bias)
        self.down = nn.Linear(4 * D, D, bias=bias)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm(x)
        q, k, v = self.qkv(h).view(b, t, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = self.proj(y.transpose(1, 2).reshape(b, t, D))
        m = self.down(F.silu(self.gate(h)) * self.up(h))
        if self.spelling == "x + a + m":
            return x + a + m
        if self.spelling == "a + m + x":
            return a + m + x
        if self.spelling == "x + (a + m)":
            return x + (a + m)
        x = x.clone()
        x += a
        x += m
        return x


class ParallelResidualLM(nn.Module):
    def __init__(self, spelling: str, bias: bool):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(spelling, bias) for _ in range(LAYERS))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def _model(spelling: str, bias: bool) -> nn.Module:
    torch.manual_seed(0)
    model = ParallelResidualLM(spelling, bias)
    with torch.no_grad():  # non-zero biases: one added twice, or on one rank only, shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    return model


IDS = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


def _step(ctx, model):
    sharded = shardplan.parallelize(model, group=ctx.group, example_inputs=(IDS,))
    with CommLedger() as ledger:
        out = sharded(IDS)
        loss = out.float().pow(2).mean()
        loss.backward()
    grads = {n: p.grad for n, p in sharded.named_parameters(remove_duplicate=False)}
    counts = Counter((r.kind, r.direction, r.elements) for r in ledger.records)
    return out.detach(), loss.detach(), grads, sharded.layouts, counts


def _reference(model):
    out = model(IDS)
    loss = out.float().pow(2).mean()
    loss.backward()
    return out.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_one_g_per_parallel_residual_layer(spelling, bias):
    model = _model(spelling, bias)
    results = SimulatedRanks(2).run(_step, model)
    assert_equivalent(results, _reference(model))
    bsh = IDS.numel() * D
    for *_, layouts, counts in results:
        assert isinstance(layouts["blocks.0.proj.weight"], Shard)
        assert isinstance(layouts["blocks.1.down.weight"], Shard)
        # the embedding's g, then one g per layer; one f per layer (the norm's output
        # enters both regions) and the LM head's
        assert counts[("all_reduce", "forward", bsh)] == 1 + LAYERS, counts
        assert counts[("all_reduce", "backward", bsh)] == LAYERS + 1, counts


@pytest.mark.real
def test_one_g_per_parallel_residual_layer_on_real_ranks(real_ranks):
    model = _model("x + a + m", True)
    results = real_ranks(2).run(_step, model)
    assert_equivalent(results, _reference(model))
    for *_, counts in results:
        assert counts[("all_reduce", "forward", IDS.numel() * D)] == 1 + LAYERS, counts


def _hf(kind: str):
    tf = pytest.importorskip("transformers", reason="needs the hf extra (pip install -e '.[hf]')")
    torch.manual_seed(0)
    if kind == "gptj":
        cfg = tf.GPTJConfig(n_layer=LAYERS, n_embd=64, n_head=4, rotary_dim=8, vocab_size=101,
                            n_positions=32, bos_token_id=0, eos_token_id=0)
    else:
        cfg = tf.GPTNeoXConfig(num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4,
                               intermediate_size=128, vocab_size=101, max_position_embeddings=32,
                               use_parallel_residual=True, bos_token_id=0, eos_token_id=0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    model.config.use_cache = False
    return model


@pytest.mark.parametrize("kind", ["gptj", "gpt_neox"])
def test_hf_parallel_residual_families_reduce_once_per_layer(kind):
    model = _hf(kind)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(2))
    kw = {"input_ids": ids, "labels": ids}
    report = shardplan.verify(model, 2, example_inputs=kw)
    assert report.ok, str(report)
    plan = shardplan.plan(model, 2, example_inputs=kw)
    g = [c for c in plan.collectives if c.purpose == "g" and c.direction == "forward"]
    assert len(g) == 1 + LAYERS, [c.module for c in g]  # the embedding's, one per layer
    assert all(c.elements == ids.numel() * 64 for c in g)
