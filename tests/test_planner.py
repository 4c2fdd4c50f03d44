"""The planner end to end: parallelize == unsharded, Megatron's communication, memory."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardplan
from shardplan.planner.capture import capture
from shardplan.layouts import Shard
from shardplan.ranks import SimulatedRanks
from shardplan.models import build

from planner_cases import batch, gather_grads, make_model, real_rank_step, reference, sharded_step

ATOL = 2e-5


def assert_equivalent(results, ref):
    logits, loss, grads = ref
    for r in results:
        torch.testing.assert_close(r[0], logits, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(r[1], loss, atol=ATOL, rtol=1e-4)
    got = gather_grads(results, grads)
    for name, g in grads.items():
        torch.testing.assert_close(got[name], g, atol=ATOL, rtol=1e-4, msg=name)
        lay = results[0][3][name]
        if not isinstance(lay, Shard):  # replicas must stay identical on every rank
            for r in results[1:]:
                assert torch.equal(r[2][name], results[0][2][name]), name


@st.composite
def configs(draw):
    family = draw(st.sampled_from(["gpt", "llama"]))
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    heads = draw(st.sampled_from([h for h in (2, 4, 8) if h % tp == 0] or [tp]))
    head_dim = draw(st.sampled_from([4, 8]))
    vocab = draw(st.sampled_from([64, 61, 8 * tp + 3]))
    cfg = {"vocab_size": vocab}
    if family == "gpt":
        cfg.update(n_layer=draw(st.integers(1, 2)), n_head=heads, n_embd=heads * head_dim,
                   bias=draw(st.booleans()), fused_qkv=draw(st.booleans()),
                   tie_weights=draw(st.booleans()))
    else:
        kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0 and k % tp == 0]))
        cfg.update(n_layers=draw(st.integers(1, 2)), n_heads=heads, n_kv_heads=kv,
                   dim=heads * head_dim, ffn_hidden=tp * draw(st.integers(2, 12)))
    b = draw(st.integers(1, 3))
    sp = draw(st.booleans())  # sequence parallel: the length divides by tp, differs from b
    t = draw(st.sampled_from([m for m in (2, 4, 6, 8) if m % tp == 0 and m != b]) if sp
             else st.integers(1, 8))
    return family, cfg, tp, b, t, sp


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_sharded_equals_unsharded_simulated(case):
    family, cfg, tp, b, t, sp = case
    model = make_model(family, **cfg)
    idx, tgt = batch(cfg["vocab_size"], b, t)
    captured = capture(model, (idx, tgt))  # once for all ranks: export is the slow part
    results = SimulatedRanks(tp).run(sharded_step, model, idx, tgt, True, captured, sp)
    assert_equivalent(results, reference(model, idx, tgt))


REAL_CASES = [
    ("gpt", dict(vocab_size=61, n_head=4, n_embd=32, fused_qkv=True, tie_weights=True), 2),
    ("gpt", dict(vocab_size=64, n_head=4, n_embd=32, fused_qkv=False, tie_weights=False), 4),
    ("llama", dict(vocab_size=61, n_heads=4, n_kv_heads=2), 2),
    ("llama", dict(vocab_size=64, n_heads=8, n_kv_heads=4, dim=64), 4),
]


@pytest.mark.real
@pytest.mark.timeout(240)
@pytest.mark.parametrize("family,cfg,tp", REAL_CASES)
def test_sharded_equals_unsharded_real_gloo(real_ranks, family, cfg, tp):
    results = real_ranks(tp).run(real_rank_step, family, cfg, 2, 5)
    model = make_model(family, **cfg)
    idx, tgt = batch(cfg["vocab_size"], 2, 5)
    assert_equivalent(results, reference(model, idx, tgt))


@pytest.mark.parametrize("family,extra", [("gpt", {"fused_qkv": True}), ("gpt", {"fused_qkv": False}),
                                          ("llama", {})])
@pytest.mark.parametrize("layers", [1, 3])
def test_ledger_equals_megatron_count(family, extra, layers):
    """Forward: 2L all-reduces of b*s*h, 1 for the embedding, 3 of b*s for the loss;
    backward: 2L, plus 1 where the LM head's input enters the vocabulary region."""
    key = "n_layer" if family == "gpt" else "n_layers"
    model = make_model(family, **{key: layers}, **extra)
    b, t, h, tp = 2, 5, 32, 2
    idx, tgt = batch(64, b, t)
    results = SimulatedRanks(tp).run(sharded_step, model, idx, tgt, False)
    for records in (r[4] for r in results):
        fwd = [(r.kind, r.elements) for r in records if r.direction == "forward"]
        bwd = [(r.kind, r.elements) for r in records if r.direction == "backward"]
        assert sorted(fwd) == sorted([("all_reduce", b * t * h)] * (2 * layers + 1)
                                     + [("all_reduce", b * t)] * 3)
        assert sorted(bwd) == sorted([("all_reduce", b * t * h)] * (2 * layers + 1))
        assert all(r.group_size == tp for r in records)


def test_plan_counts_match_the_ledger():
    model = make_model("gpt", n_layer=2)
    idx, tgt = batch(64, 2, 5)
    p = shardplan.plan(model, 2, example_inputs=(idx, tgt))
    results = SimulatedRanks(2).run(sharded_step, model, idx, tgt, True)
    records = results[0][4]
    for direction in ("forward", "backward"):
        planned = sorted((c.kind, c.elements) for c in p.collectives if c.direction == direction)
        seen = sorted((r.kind, r.elements) for r in records if r.direction == direction)
        assert planned == seen


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_per_rank_parameter_bytes(tp):
    """Per-rank bytes = sharded params / tp + replicated params, by Megatron's split."""
    model = make_model("gpt", n_layer=2, vocab_size=64, tie_weights=True)
    megatron_sharded = ("c_attn", "mlp.c_fc", "attn.c_proj.weight", "mlp.c_proj.weight", "wte")
    expected = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        expected += n // tp if any(k in name for k in megatron_sharded) else n
    idx, tgt = batch(64, 2, 5)
    results = SimulatedRanks(tp).run(
        lambda ctx: sum(p.numel() * p.element_size() for p in shardplan.parallelize(
            model, group=ctx.group, example_inputs=(idx, tgt)).parameters()))
    assert results == [expected] * tp
    assert shardplan.plan(model, tp, example_inputs=(idx, tgt)).memory.param_bytes_per_rank == expected


def test_other_shapes_modes_and_signatures():
    """One parallelize serves other batch/sequence sizes (1 included), eval, and no targets."""
    model = make_model("gpt", dropout=0.0)
    idx, tgt = batch(64, 2, 6)
    calls = [((3, 4), True), ((1, 5), True), ((2, 1), False), ((1, 1), False)]

    def body(ctx):
        s = shardplan.parallelize(model, group=ctx.group, example_inputs=(idx, tgt))
        out = []
        for (b, t), with_targets in calls:
            x, y = batch(64, b, t, seed=b * 10 + t)
            s.eval() if b == 1 else s.train()
            logits, loss = s(x, y) if with_targets else s(x)
            out.append((logits, loss))
        return out

    results = SimulatedRanks(2).run(body)
    for ((b, t), with_targets), (logits, loss) in zip(calls, results[0]):
        x, y = batch(64, b, t, seed=b * 10 + t)
        model.eval() if b == 1 else model.train()
        ref_logits, ref_loss = model(x, y) if with_targets else model(x)
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=1e-4)
        if with_targets:
            torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=1e-4)
        else:
            assert loss is None


def test_eval_mode_model_with_dropout_stays_in_eval():
    """A model parallelized in eval mode runs in eval mode (no dropout) until told otherwise."""
    model = make_model("gpt", dropout=0.5).eval()
    idx, tgt = batch(64, 2, 5)
    results = SimulatedRanks(2).run(sharded_step, model, idx, tgt)
    assert_equivalent(results, reference(model, idx, tgt))


def test_code_shows_communication_and_tying_survives():
    model = make_model("gpt", tie_weights=True)
    idx, tgt = batch(64, 2, 5)

    def body(ctx):
        s = shardplan.parallelize(model, group=ctx.group, example_inputs=(idx, tgt))
        return s.code, s.transformer.wte.weight is s.lm_head.weight, tuple(s.lm_head.weight.shape)

    code, tied, shp = SimulatedRanks(2).run(body)[0]
    assert code.count("self.tp_f_") == 2 * 2 + 1  # 2 per layer + the LM head's input
    assert code.count("self.tp_g_") == 2 * 2 + 1  # 2 per layer + the embedding
    assert "tp_vocab_loss" in code
    assert tied and shp == (32, 32)


def test_meta_model_plans_and_shards_without_memory():
    model = build("gpt-tiny", device="meta")
    results = SimulatedRanks(2).run(
        lambda ctx: [p.is_meta for p in shardplan.parallelize(model, group=ctx.group).parameters()])
    assert all(all(r) for r in results)


def test_llama_70b_plans_on_meta():
    model = build("llama-70b", device="meta")
    p = shardplan.plan(model, 8)
    assert p.repeated == {"layers": [2, 80]}
    assert p.count(kind="all_reduce", direction="forward", purpose="g") == 2 * 80 + 1
    assert p.count(kind="all_reduce", direction="backward", purpose="f") == 2 * 80 + 1
    wq = p.param("layers.79.attention.wq.weight")
    assert (wq.layout, wq.local_shape) == ("S(0)", [1024, 8192])
    total = sum(x.numel() for x in model.parameters()) * 4
    assert p.memory.param_bytes_unsharded == total
    assert not p.warnings

