"""The planner end to end: parallelize == unsharded, Megatron's communication, memory."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import shardplan
from shardplan.errors import ConfigurationError
from shardplan.layouts import MeshDim, MeshSizes
from shardplan.planner.annotate import annotate
from shardplan.planner.capture import capture
from shardplan.planner.plan import build_plan
from shardplan.planner.purposes import PURPOSES
from shardplan.planner.rewrite import rewrite
from shardplan.planner.rules import load_rules
from shardplan.planner.transitions import Purpose
from shardplan.runtime.comm import Group
from shardplan.ranks import SimulatedRanks
from shardplan.models import build

from checks import (assert_equivalent, assert_grads, assert_megatron_layouts,
                    assert_megatron_ledger, megatron_count)
from planner_cases import (batch, make_model, real_rank_count_step, reference,
                           sharded_step)
from planner_models import TinyLM

ATOL = 2e-5


# a fixed sample in CI; SHARDPLAN_FUZZ_RANDOM=1 draws new examples (as tests/test_fuzz.py)
RANDOM = os.environ.get("SHARDPLAN_FUZZ_RANDOM", "") not in ("", "0")

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
        # K/V heads fewer than tp too: groups of ranks hold one K/V head (replicas)
        # (a single K/V head at tp > 1 is replicated: test_single_kv_head_is_sharded)
        kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0 and (
            k % tp == 0 or (tp % k == 0 and k > 1))]))
        cfg.update(n_layers=draw(st.integers(1, 2)), n_heads=heads, n_kv_heads=kv,
                   dim=heads * head_dim, ffn_hidden=tp * draw(st.integers(2, 12)))
    b = draw(st.integers(1, 3))
    sp = draw(st.booleans())  # sequence parallel: the length divides by tp, differs from b
    t = draw(st.sampled_from([m for m in (2, 4, 6, 8) if m % tp == 0 and m != b]) if sp
             else st.integers(1, 8))
    return family, cfg, tp, b, t, sp


# 17 examples (the fixed sample is seeded by this test's source: an edit draws another):
# today 12 at tp > 1, every one checked for Megatron's layouts, 6 of them with a padded
# vocabulary and one with a one-token example
@settings(max_examples=17, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize=not RANDOM, database=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # shrinking: minutes of exports
@given(configs())
def test_sharded_equals_unsharded_simulated(case):
    family, cfg, tp, b, t, sp = case
    model = make_model(family, **cfg)
    idx, tgt = batch(cfg["vocab_size"], b, t)
    captured = capture(model, (idx, tgt))  # once for all ranks: export is the slow part
    results = SimulatedRanks(tp).run(sharded_step, model, idx, tgt, False, captured, False, sp)
    logits, loss, grads = reference(model, idx, tgt)
    head = "lm_head.weight" if family == "gpt" else "output.weight"
    sharded_head = isinstance(results[0][3][head], shardplan.Shard)
    vocab_shard = shardplan.Shard(-1, padded=-(-cfg["vocab_size"] // tp) * tp)
    for rank, r in enumerate(results):  # gather_output=False: this rank's vocabulary slice
        n = _real(cfg["vocab_size"], rank, tp) if sharded_head else cfg["vocab_size"]
        want = vocab_shard.slice(logits, rank, tp) if sharded_head else logits
        if sp and r[0].shape[1] != t:  # the head kept replicated: logits on this rank's tokens
            want = want.chunk(tp, 1)[rank]
        torch.testing.assert_close(r[0].narrow(-1, 0, n), want.narrow(-1, 0, n),
                                   atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(r[1], loss, atol=2e-5, rtol=1e-4)
    assert_grads(results[0][3], [r[2] for r in results], grads)
    # what was sharded, from the model's description alone: on every example, the LM head
    # vocab-parallel (padded or not) and every block's GEMMs by Megatron's rule
    assert_megatron_layouts(model, _but_known_gaps(results[0][3], cfg, tp), tp)
    assert tp == 1 or sharded_head, f"{head} kept whole at tp={tp}: {results[0][3][head]}"
    if t == 1 or cfg["vocab_size"] % tp:  # the count below does not model the gathered
        return  # logits of a one-token example nor the replicated padded embedding (no g)
    # the communication, from the model's description alone
    layers, h = cfg.get("n_layer", cfg.get("n_layers")), cfg.get("n_embd", cfg.get("dim"))
    kv = cfg.get("n_kv_heads", tp)
    kv_weight = kv * (h // cfg.get("n_heads", 1)) * h if kv < tp else 0
    if tp > 1 and not sp:  # tp=1: no vocabulary split; SP: test_sequence_parallel counts
        assert_megatron_ledger([r[4] for r in results],
                               megatron_count(layers, b, t, h, kv_weight=kv_weight), tp)


def _but_known_gaps(layouts: dict, cfg: dict, tp: int) -> dict:
    """``layouts`` without what a known planner gap keeps replicated: the untied token
    embedding of a padded vocabulary (the strict xfail test_padded_vocab_embedding_...)."""
    if not cfg["vocab_size"] % tp or cfg.get("tie_weights", False):
        return layouts
    return {k: v for k, v in layouts.items()
            if k not in ("transformer.wte.weight", "tok_embeddings.weight")}


def test_single_kv_head_is_sharded():
    model = make_model("llama", n_heads=4, n_kv_heads=1)
    p = shardplan.plan(model, 2, example_inputs=batch(64, 2, 5))
    assert p.param("layers.0.attention.wq.weight").layout.startswith("S(0")
    assert p.param("layers.0.attention.wk.weight").layout.startswith("S(0")
    assert p.param("layers.0.attention.wo.weight").layout.startswith("S(1")


@pytest.mark.xfail(strict=True, reason="planner gap: a padded vocabulary (35 at tp=4) keeps "
                   "the untied token embedding replicated, with no warning")
def test_padded_vocab_embedding_is_sharded():
    model = make_model("llama", vocab_size=35, n_layers=1, n_heads=8, n_kv_heads=8, dim=64,
                       ffn_hidden=36)
    p = shardplan.plan(model, 4, example_inputs=batch(35, 3, 5))
    assert p.param("tok_embeddings.weight").layout.startswith("S(0")


def test_one_token_example_shards_a_padded_lm_head():
    """A one-token example reshapes the padded vocabulary dim, which has no rule: the
    planner gathers the logits there (cheaper than keeping the LM head whole), so the
    head stays vocab-parallel, and the sharded model equals the unsharded one."""
    model = make_model("llama", vocab_size=61)
    example = batch(61, 2, 1)
    p = shardplan.plan(model, 2, example_inputs=example)
    assert p.param("output.weight").layout.startswith("S(0")
    assert [c.chosen for c in p.choices] == ["gathered"]
    assert shardplan.verify(model, 2, example_inputs=example).ok


def _real(vocab: int, rank: int, tp: int) -> int:
    """How many of rank ``rank``'s vocabulary rows are real (not padding)."""
    per = -(-vocab // tp)
    return max(0, min(per, vocab - rank * per))


REAL_CASES = [
    ("gpt", dict(vocab_size=61, n_head=4, n_embd=32, fused_qkv=True, tie_weights=True), 2),
    ("gpt", dict(vocab_size=64, n_head=4, n_embd=32, fused_qkv=False, tie_weights=False), 4),
    ("llama", dict(vocab_size=61, n_heads=4, n_kv_heads=2), 2),
    ("llama", dict(vocab_size=64, n_heads=8, n_kv_heads=2, dim=64), 4),  # K/V replica groups
]


@pytest.mark.real
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,cfg,tp", REAL_CASES)
def test_sharded_equals_unsharded_and_megatron_count_real_gloo(real_ranks, family, cfg, tp):
    """On real gloo processes, whole bundled models: gathered outputs, loss and every copy
    of every gradient equal the unsharded model's, and the ledger equals Megatron's
    count; then with ``gather_output=False`` (each rank's logits are its vocabulary
    slice) and ``recompute=True`` (each block's forward re-run in backward)."""
    b, t = 2, 5
    per_rank = real_ranks(tp).run(real_rank_count_step, family, cfg, b, t)
    model = make_model(family, **cfg)
    idx, tgt = batch(cfg["vocab_size"], b, t)
    logits, loss, grads = ref = reference(model, idx, tgt)
    plain, recomputed = [r[0] for r in per_rank], [r[1] for r in per_rank]
    assert_equivalent(plain, ref)
    assert_megatron_layouts(model, plain[0][3], tp)
    layers, h = model.config.n_layer if family == "gpt" else model.config.n_layers, \
        model.config.n_embd if family == "gpt" else model.config.dim
    padded = -(-cfg["vocab_size"] // tp) * tp
    kv = cfg.get("n_kv_heads", tp)  # K/V heads held by groups of ranks: their weight grads
    kv_weight = kv * (h // cfg["n_heads"]) * h if kv < tp else 0
    assert_megatron_ledger([r[4] for r in plain], megatron_count(
        layers, b, t, h, gathered_vocab=padded, kv_weight=kv_weight), tp)
    vocab_shard = shardplan.Shard(-1, padded=padded)
    for rank, r in enumerate(recomputed):
        n = _real(cfg["vocab_size"], rank, tp)
        torch.testing.assert_close(r[0].narrow(-1, 0, n),
                                   vocab_shard.slice(logits, rank, tp).narrow(-1, 0, n),
                                   atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(r[1], loss, atol=2e-5, rtol=1e-4)
    assert_grads(recomputed[0][3], [r[2] for r in recomputed], grads)
    assert_megatron_ledger([r[4] for r in recomputed],
                           megatron_count(layers, b, t, h, recompute=True,
                                          kv_weight=kv_weight), tp)


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
    assert p.repeated == {"layers": [3, 80]}  # first, middle and last block
    assert p.count(kind="all_reduce", direction="forward", purpose="g") == 2 * 80 + 1
    assert p.count(kind="all_reduce", direction="backward", purpose="f") == 2 * 80 + 1
    wq = p.param("layers.79.attention.wq.weight")
    assert (wq.layout, wq.local_shape) == ("S(0)", [1024, 8192])
    total = sum(x.numel() for x in model.parameters()) * 4
    assert p.memory.param_bytes_unsharded == total
    assert not p.warnings



class _Ranks(Group):
    """Rank 0 of ``size`` ranks, only to be handed to the rewriter (nothing runs on it)."""

    def __init__(self, size: int):
        self.rank, self.size = 0, size


def _moved_to_dp_shard(purpose: Purpose):
    """gpt-tiny annotated on a dp_shard=2 x tp=2 mesh, with its transitions of ``purpose``
    moved onto dp_shard (as a later planner of that dim would make them)."""
    model = build("gpt-tiny")
    idx = torch.zeros(2, 8, dtype=torch.long)
    captured = capture(model, (idx, idx))
    rules = load_rules("megatron")
    ann = annotate(captured.gm, MeshSizes.of(dp_shard=2, tp=2), rules)
    assert {t.mesh_dim for t in ann.transitions} == {MeshDim.TP}  # the engine plans tp
    moved = [replace(t, mesh_dim=MeshDim.DP_SHARD) if t.purpose is purpose else t
             for t in ann.transitions]
    return model, captured, rules, (idx, idx), replace(ann, transitions=moved)


def test_each_collective_runs_over_the_group_of_its_transitions_mesh_dim():
    model, captured, rules, args, ann = _moved_to_dp_shard(Purpose.G)
    tp, dp = _Ranks(2), _Ranks(2)
    gm = rewrite(ann, {MeshDim.TP: tp, MeshDim.DP_SHARD: dp})
    mods = dict(gm.named_children())
    g = [m for n, m in mods.items() if n.startswith("tp_g_")]
    f = [m for n, m in mods.items() if n.startswith("tp_f_")]
    assert len(g) == sum(t.purpose is Purpose.G for t in ann.transitions) > 0 and f
    assert all(m.group is dp for m in g) and all(m.group is tp for m in f)
    others = {type(m).__name__ for n, m in mods.items()
              if n.startswith("tp_") and not n.startswith("tp_g_")
              and getattr(m, "group", None) is tp}
    assert others >= {"CopyToRegion", "GatherShard", "VocabCrossEntropy"}
    assert not [n for n, m in mods.items() if getattr(m, "group", tp) not in (tp, dp)]
    plan = build_plan(model, captured, ann, rules, args, {})
    assert {c.mesh_dim for c in plan.collectives if c.purpose == "g"} == {MeshDim.DP_SHARD}
    assert {c.mesh_dim for c in plan.collectives if c.purpose != "g"} == {MeshDim.TP}


@pytest.mark.parametrize("name,sp", [("gpt-tiny", True), ("softmax-mlp", False)])
def test_the_rewriter_inserts_each_purposes_module_from_the_table(name, sp):
    """Every purpose has a row, and each module the rewriter inserts under a row's name is
    the class that row gives for one of the annotation's transitions (gpt-tiny with sequence
    parallelism: the sequence scatters, the linears' re-gather, the bucket, the loss, the
    logits' gather, a split; a softmax over the split hidden dim: f, g, the distributed max
    and sum)."""
    assert set(PURPOSES) == set(Purpose)
    model = build("gpt-tiny") if name == "gpt-tiny" else TinyLM(mlp_op="softmax")
    idx = torch.zeros(2, 8, dtype=torch.long)
    captured = capture(model, (idx, idx) if name == "gpt-tiny" else (idx,))
    ann = annotate(captured.gm, MeshSizes.of(tp=2), load_rules("megatron"), sequence_parallel=sp)
    gm = rewrite(ann, {MeshDim.TP: _Ranks(2)})
    table: dict = {}  # name -> the classes the table gives this annotation's transitions
    for t in ann.transitions:
        kind, module = PURPOSES[t.purpose].realised_by(t.forward)
        table.setdefault(kind, set()).add(module)
    names = {row.name for row in PURPOSES.values()} | {f"{row.name}_max" for row in PURPOSES.values()}
    inserted: dict = {}  # name -> the classes inserted under it
    for n, m in gm.named_children():
        kind = n[3:].rpartition("_")[0]
        if n.startswith("tp_") and kind in names:
            inserted.setdefault(kind, set()).add(type(m))
    assert all(modules <= table.get(kind, set()) for kind, modules in inserted.items()), inserted
    want = ({"seq_scatter", "seq_linear", "seq_grad_bucket", "vocab_loss", "gather", "shard"} if sp else
            {"f", "g", "stat", "stat_max"})
    assert want <= set(inserted), sorted(inserted)


def test_rewrite_refuses_a_missing_or_wrong_sized_group():
    *_, ann = _moved_to_dp_shard(Purpose.F)
    with pytest.raises(ConfigurationError, match="no group for mesh dimension dp_shard") as e:
        rewrite(ann, {MeshDim.TP: _Ranks(2)})
    assert "MeshDim.DP_SHARD" in e.value.fix
    with pytest.raises(ConfigurationError, match="dp_shard has 4 ranks, but the annotation "
                                                 "planned dp_shard=2"):
        rewrite(ann, {MeshDim.TP: _Ranks(2), MeshDim.DP_SHARD: _Ranks(4)})
