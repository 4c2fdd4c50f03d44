"""Robustness on real model spellings: no raw crash, no wrongful refusal, one plan per model.

- views whose input is a rank's part are rewritten stride-safe (torchtitan's Llama 3);
- a GEMM whose output does not split into tp parts stays replicated (Qwen2-MoE's gate);
- a new way of calling (batch 1, length 1) keeps the first plan's layouts (BLOOM);
- ``plan()`` stamps only block lists that run one after another (a list of ``None``
  places is none), and agrees with ``parallelize``;
- in-place writes into a tensor that a transition reads wait for the writes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardplan
from shardplan.layouts import Shard
from shardplan.models import build
from shardplan.planner.capture import capture
from shardplan.planner.inputs import example_args
from shardplan.planner.rules import load_rules
from shardplan.ranks import SimulatedRanks
from shardplan.sharded import ShardedModule

from planner_models import TinyLM


# --------------------------------------------------------------------------- torchtitan Llama 3

def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    freqs = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    seqlen = xq_.shape[1]
    shape = [d if i in (1, xq_.ndim - 1) else 1 for i, d in enumerate(xq_.shape)]
    freqs_cis = freqs_cis[0:seqlen].view(*shape)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class TitanAttention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_rep, self.head_dim = n_heads // n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous()
        output = output.view(bs, seqlen, -1)
        return self.wo(output)


class TitanBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden):
        super().__init__()
        self.attention = TitanAttention(dim, n_heads, n_kv_heads)
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class TitanLlama(nn.Module):
    """torchtitan's Llama 3 at toy size: complex RoPE, GQA by repeat_kv, SDPA, and the
    ``transpose(1, 2).contiguous().view(bs, seqlen, -1)`` whose ``contiguous`` export drops."""

    def __init__(self, vocab=128, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, hidden=96):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, 64), persistent=False)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim, n_heads, n_kv_heads, hidden)
                                     for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


@pytest.mark.parametrize("tp", [2, 4])
def test_torchtitan_llama_views_of_a_ranks_part_are_stride_safe(tp):
    torch.manual_seed(0)
    model, ids = TitanLlama().eval(), torch.randint(0, 128, (2, 8))
    report = shardplan.verify(model, tp, example_inputs=ids)
    assert report.ok, str(report)
    p = shardplan.plan(model, tp, example_inputs=ids)
    attn = "layers.0.attention"
    assert p.param(f"{attn}.wq.weight").layout == "S(0)"
    assert p.param(f"{attn}.wk.weight").layout.startswith("S(0")
    assert p.param(f"{attn}.wo.weight").layout == "S(1)"
    assert p.param("layers.1.w2.weight").layout == "S(1)"
    assert not p.warnings


class SlicedQueryAttention(nn.Module):
    """The query passes an op with no rule, so it stays replicated and is sliced to this
    rank's heads before SDPA; the slice's strides differ from the full tensor's, and the
    ``view`` after ``transpose(1, 2).contiguous()`` (its ``contiguous`` dropped by export,
    a no-op at full size) must still fit."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, c = x.shape
        q = F.softplus(self.wq(x)).view(b, t, self.heads, -1)
        k = self.wk(x).view(b, t, self.heads, -1)
        v = self.wv(x).view(b, t, self.heads, -1)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(b, t, -1))


@pytest.mark.parametrize("tp", [2, 4])
def test_view_of_a_locally_sliced_attention_output(tp):
    torch.manual_seed(0)
    model, x = SlicedQueryAttention(), torch.randn(2, 5, 32)
    report = shardplan.verify(model, tp, example_inputs=x)
    assert report.ok, str(report)
    p = shardplan.plan(model, tp, example_inputs=x)
    assert p.param("wk.weight").layout == "S(0)" and p.param("wo.weight").layout == "S(1)"
    # softplus has no rule: q is gathered there (cheaper than a whole wq) and sliced at SDPA
    assert p.param("wq.weight").layout == "S(0)"
    assert [c.chosen for c in p.choices] == ["gathered"]


# --------------------------------------------------------------------------- outputs that do not split

class GatedMLP(nn.Module):
    """Qwen2-MoE's shared expert: an MLP scaled by a 1-wide gate ``nn.Linear(hidden, 1)``."""

    def __init__(self, dim=8, hidden=16):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.gate = nn.Linear(dim, 1)

    def forward(self, x):
        return self.down(F.silu(self.up(x))) * torch.sigmoid(self.gate(x))


@pytest.mark.parametrize("tp", [2, 4])
def test_one_wide_gate_stays_replicated(tp):
    torch.manual_seed(0)
    model, x = GatedMLP(), torch.randn(2, 5, 8)
    report = shardplan.verify(model, tp, example_inputs=x)
    assert report.ok, str(report)
    p = shardplan.plan(model, tp, example_inputs=x)
    assert p.param("up.weight").layout == "S(0)" and p.param("down.weight").layout == "S(1)"
    assert p.param("gate.weight").layout == "R"
    gate, = [d for d in p.decisions if d.module == "gate"]
    assert gate.role == "replicated" and f"output size 1 does not divide by tp={tp}" in gate.rule
    assert not p.warnings


def test_width_not_dividing_tp_is_a_replicated_decision():
    """An FFN of 150 at tp=4: its up projections stay whole, each with the reason. The down
    projection's output (the hidden width) still splits, where the plan records the
    choice that makes it pay: the next norm run distributed, cheaper by the plan's own
    cost than keeping that region whole."""
    model = build("llama-tiny", n_kv_heads=4, ffn_hidden=150)
    p = shardplan.plan(model, 4)
    for name in ("w1", "w3"):
        assert p.param(f"layers.0.feed_forward.{name}.weight").layout == "R"
        d, = [d for d in p.decisions if d.module == f"layers.0.feed_forward.{name}"]
        assert d.role == "replicated" and "150 does not divide by tp=4" in d.rule
    assert p.param("layers.0.attention.wq.weight").layout == "S(0)"
    # w2 (150 -> 64): its input width does not split, its output rows do
    assert p.param("layers.0.feed_forward.w2.weight").layout == "S(0)"
    chosen = [c for c in p.choices if c.chosen == "distributed"]
    assert chosen, "the down projection split with no recorded choice"
    for c in chosen:
        assert sum(c.costs["distributed"].values()) <= sum(c.costs["replicated"].values())
    report = shardplan.verify(model, 4)
    assert report.ok, str(report)


def test_fused_qkv_with_kv_heads_fewer_than_tp_holds_each_by_a_pair_of_ranks():
    """[q | k | v] = 32 + 8 + 8 at tp 4 with 2 K/V heads: the 8 query heads split 4 ways,
    each K/V head held by 2 ranks (a count per block), and the sharded model verifies."""
    model = TinyLM(heads=8, kv_heads=2, layers=1)
    p = shardplan.plan(model, 4)
    assert p.param("blocks.0.wqkv.weight").layout == "S(0|32+8+8|x1+2+2)"
    assert p.param("blocks.0.wo.weight").layout == "S(1)"
    report = shardplan.verify(model, 4)
    assert report.ok, str(report)


def test_kv_projection_not_dividing_tp_stays_replicated():
    """6 query heads split 2 per rank at tp=3; the 2 K/V heads do not split (nor can ranks
    share them), so every rank computes both and reads its query heads' copies."""
    model = build("llama-tiny", n_heads=6, n_kv_heads=2, dim=48, ffn_hidden=96)
    report = shardplan.verify(model, 3)
    assert report.ok, str(report)
    p = shardplan.plan(model, 3)
    attn = "layers.0.attention"
    assert p.param(f"{attn}.wq.weight").layout == "S(0)" and p.param(f"{attn}.wo.weight").layout == "S(1)"
    assert p.param(f"{attn}.wk.weight").layout == "R" and p.param(f"{attn}.wv.weight").layout == "R"


def test_qwen2_moe_shared_expert_gate_plans():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.Qwen2MoeConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                            vocab_size=101, max_position_embeddings=64)
    model = tf.Qwen2MoeForCausalLM(cfg).eval()
    p = shardplan.plan(model, 2, example_inputs={"input_ids": torch.randint(0, 101, (2, 6))})
    mlp = "model.layers.0.mlp"
    assert p.param(f"{mlp}.shared_expert_gate.weight").layout == "R"
    assert p.param(f"{mlp}.shared_expert.up_proj.weight").layout == "S(0)"
    assert p.param(f"{mlp}.shared_expert.down_proj.weight").layout == "S(1)"


# --------------------------------------------------------------------------- one layout, many calls

def _bloom():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.BloomConfig(n_layer=1, hidden_size=64, n_head=4, vocab_size=101)
    model = tf.BloomForCausalLM(cfg).eval()
    model.config.use_cache = False
    return model


def _calls(ctx, model, example, calls):
    sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=example)
    first = dict(sharded.layouts)
    outs = []
    for args in calls:
        out = sharded(*args)
        outs.append((out.logits if hasattr(out, "logits") else out).detach())
    assert sharded.layouts == first
    return outs, first


def test_bloom_batch_1_and_length_1_after_batch_3():
    model = _bloom()
    ids = torch.randint(0, 101, (3, 6), generator=torch.Generator().manual_seed(1))
    calls = [(ids,), (ids[:1],), (ids[:, :1],)]
    results = SimulatedRanks(2).run(_calls, model, (ids,), calls)
    for outs, _ in results:
        for (args,), got in zip(calls, outs):
            torch.testing.assert_close(got, model(args).logits, atol=2e-5, rtol=1e-4)
    layouts = results[0][1]
    assert isinstance(layouts["transformer.h.0.mlp.dense_h_to_4h.weight"], Shard)
    assert isinstance(layouts["transformer.h.0.mlp.dense_4h_to_h.weight"], Shard)
    # its attention too (heads merged into the batch dim, at batch 3, 1 and length 1)
    assert str(layouts["transformer.h.0.self_attention.query_key_value.weight"]) == "S(0)"
    assert str(layouts["transformer.h.0.self_attention.dense.weight"]) == "S(1)"


class BranchOnBatchOne(nn.Module):
    """A forward that takes another path at batch 1, through an op with no rule: that
    capture cannot split ``fc1``, so it reads the first plan's shards whole."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc1(x)
        h = F.logsigmoid(h).exp() if x.shape[0] == 1 else torch.sigmoid(h)
        return self.fc2(h)


def _train_calls(ctx, model, x):
    sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=(x,))
    first = dict(sharded.layouts)
    out = sharded(x[:1])
    out.sum().backward()
    assert sharded.layouts == first
    return out.detach(), first, {n: p.grad for n, p in sharded.named_parameters()}


def test_a_call_that_cannot_split_the_first_plans_shards_gathers_them():
    torch.manual_seed(0)
    model, x = BranchOnBatchOne(), torch.randn(3, 5, 8)
    results = SimulatedRanks(2).run(_train_calls, model, x)
    ref = copy.deepcopy(model)
    want = ref(x[:1])
    want.sum().backward()
    layouts = results[0][1]
    assert layouts["fc1.weight"] == Shard(0) and layouts["fc2.weight"] == Shard(1)
    for out, _, _ in results:
        torch.testing.assert_close(out, want.detach())
    for name, p in ref.named_parameters():
        lay, parts = layouts[name], [r[2][name] for r in results]
        got = lay.unshard(parts, p.shape[lay.dim]) if isinstance(lay, Shard) else parts[0]
        torch.testing.assert_close(got, p.grad, msg=name)


# --------------------------------------------------------------------------- plan() == parallelize().plan

class PerHeadNorms(nn.Module):
    """A ModuleList of identical norms applied side by side (split and zip), not in a chain:
    ``plan()`` must not cut it to two."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.up, self.down = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim // heads) for _ in range(heads))

    def forward(self, x):
        parts = self.up(x).chunk(self.heads, dim=-1)
        return self.down(torch.cat([n(p) for n, p in zip(self.norms, parts)], dim=-1))


class PlaceholderSlots(nn.Module):
    """Four identical MLP blocks zipped with a list of ``None`` places, as x-transformers
    keeps its unused per-layer slots: ``plan()`` cuts the blocks and leaves the places."""

    def __init__(self, dim=32, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim),
                                                  nn.GELU(), nn.Linear(2 * dim, dim))
                                    for _ in range(depth))
        self.skips = nn.ModuleList([None] * depth)

    def forward(self, x):
        for layer, skip in zip(self.layers, self.skips):
            x = x + layer(x if skip is None else skip(x))
        return x


def _parallelized_plan(ctx, model, example, captured):
    """``parallelize(model).plan`` on rank 0, from one whole-model capture made for both
    ranks (a ``ShardedModule`` is what ``parallelize`` returns; building it does not
    communicate)."""
    if ctx.group.rank:
        return None
    args, kwargs = example_args(model, example)
    return ShardedModule(model, ctx.group, load_rules(), example=(args, kwargs),
                         gather_output=True, strict=False, captured=captured).plan


def _summary(p):
    params = sorted((q.name, q.layout, tuple(q.local_shape)) for q in p.params)
    colls = sorted((c.kind, c.direction, c.purpose, c.elements, c.module) for c in p.collectives)
    return params, colls


def _hf(kind):
    pytest.importorskip("transformers")
    from hf_cases import build as hf_build, inputs
    return hf_build(kind, layers=4, heads=8, kv_heads=4), inputs()


def _gemma3_sliding_global():
    """Gemma 3's text model at 4 layers, 3 sliding-window (window 3 of 6 tokens) and 1
    global: blocks alike in their parameters, unlike in their masks; the last, global, is
    stamped from the middle one."""
    pytest.importorskip("transformers")
    import transformers as tf
    from hf_cases import VOCAB, inputs
    torch.manual_seed(0)
    cfg = tf.Gemma3TextConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64,
        sliding_window=3, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        pad_token_id=0, bos_token_id=0, eos_token_id=0, use_cache=False)
    cfg._attn_implementation = "eager"
    return tf.Gemma3ForCausalLM(cfg).eval(), inputs()


CASES = {
    "per-head-norms": lambda: (PerHeadNorms(), torch.randn(2, 5, 32)),
    "placeholder-slots": lambda: (PlaceholderSlots(), torch.randn(2, 5, 32)),
    "gpt": lambda: (build("gpt-tiny", n_layer=4), None),
    "llama": lambda: (build("llama-tiny", n_layers=4), None),
    "hf-gpt2": lambda: _hf("gpt2"),
    "hf-llama": lambda: _hf("llama"),
    "hf-bert": lambda: _hf("bert"),
    "hf-gemma3-sliding-global": _gemma3_sliding_global,
}


@pytest.mark.parametrize("case", list(CASES))
def test_plan_agrees_with_parallelize(case):
    torch.manual_seed(0)
    model, example = CASES[case]()
    p = shardplan.plan(model, 2, example_inputs=example)
    args, kwargs = example_args(model, example)
    got = SimulatedRanks(2).run(_parallelized_plan, model, example, capture(model, args, kwargs))[0]
    assert _summary(p) == _summary(got)
    assert p.warnings == got.warnings
    assert any(q.layout != "R" for q in p.params)
    if case == "per-head-norms":
        assert not p.repeated
    else:
        assert list(p.repeated.values()) == [[3, 4]]


# --------------------------------------------------------------------------- in-place writes

class KeysFilledInPlace(nn.Module):
    """Keys built with ``new_empty`` and filled by slice ``copy_`` (halves swapped), as
    some attention code builds them; the tensor is written after a transition reads it.
    The key weight is also read whole (its sum), so the keys stay whole and reach the
    split attention through a local slice."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, c = x.shape
        q, k0, v = (w(x).view(b, t, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        d = k0.shape[-1] // 2
        k = k0.new_empty(k0.shape)
        k[..., :d].copy_(k0[..., d:])
        k[..., d:].copy_(k0[..., :d])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, c)) + self.wk.weight.sum()


def test_in_place_writes_after_a_transition():
    torch.manual_seed(0)
    model, x = KeysFilledInPlace(), torch.randn(2, 5, 32)
    report = shardplan.verify(model, 2, example_inputs=x)
    assert report.ok, str(report)
    p = shardplan.plan(model, 2, example_inputs=x)
    assert p.param("wq.weight").layout == "S(0)" and p.param("wo.weight").layout == "S(1)"
    assert p.param("wk.weight").layout == "R"  # read whole: its keys stay whole


# --------------------------------------------------------------------------- child names

class EncoderDecoder(nn.Module):
    """Top-level children named like ``ShardedModule``'s own attributes (T5's ``decoder``)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        self.decoder = nn.Linear(16, 8)
        self.plan = nn.Linear(8, 8)

    def forward(self, x):
        return self.plan(self.decoder(torch.relu(self.encoder(x))))


def test_children_named_like_sharded_attributes():
    torch.manual_seed(0)
    model, x = EncoderDecoder(), torch.randn(2, 3, 8)
    report = shardplan.verify(model, 2, example_inputs=x)
    assert report.ok, str(report)
    sharded = SimulatedRanks(2).run(
        lambda ctx: shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                          example_inputs=x))[0]
    assert callable(sharded.decode_step) and sharded.plan.param("encoder.weight").layout == "S(0)"
    names = dict(sharded.named_parameters())  # the children are listed, the rank's shards
    assert names["encoder.weight"].shape == (8, 8) and names["decoder.weight"].shape == (8, 8)
