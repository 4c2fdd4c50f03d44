"""Planner rules beyond the bundled models, fallbacks, verify's own failure, and errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import shardplan
from shardplan.layouts import MeshLayout, MeshSizes, Placement, Shard
from shardplan.planner.capture import capture
from shardplan.models import build
from shardplan.ranks import SimulatedRanks

from checks import assert_equivalent
from planner_cases import reference, sharded_step
from planner_models import DataDependent, GroupedSDPA, MaskedSDPA, NoTokens, TinyLM

RULES = Path(__file__).resolve().parent.parent / "shardplan" / "rules" / "megatron.toml"


def _check(model, tp, b=2, t=6):
    idx = torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(3))
    results = SimulatedRanks(tp).run(sharded_step, model, idx, idx, True, capture(model, (idx, idx)))
    assert_equivalent(results, reference(model, idx, idx))  # every rank, every replica
    return results


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_gqa_qkv_is_split_by_blocks(tp):
    """A fused [q | k | v] with fewer K/V heads: each rank holds [q_r | k_r | v_r]."""
    torch.manual_seed(0)
    model = TinyLM(heads=8, kv_heads=4)
    results = _check(model, tp)
    q, kv = 8 * 4, 4 * 4
    assert results[0][3]["blocks.0.wqkv.weight"] == shardplan.Shard(0, (q, kv, kv))
    assert not shardplan.plan(model, tp, example_inputs=torch.zeros(1, 4, dtype=torch.long)).warnings


def test_per_head_norm_weight_gets_its_gradient_all_reduced():
    """A replicated weight applied after the head split sees only this rank's heads."""
    torch.manual_seed(0)
    model = TinyLM(qk_norm=True)
    results = _check(model, 2)
    assert isinstance(results[0][3]["blocks.0.q_norm.weight"], shardplan.Replicate)
    bwd = [r for r in results[0][4] if r.direction == "backward" and r.elements == model.blocks[0].hd]
    assert len(bwd) == 2  # one gradient all-reduce per layer's q_norm weight


def test_per_head_constants_are_sliced_to_this_ranks_heads():
    torch.manual_seed(0)
    _check(TinyLM(heads=8, kv_heads=4, alibi=True), 4)


def test_reshape_follows_heads_through_a_symbolic_batch():
    """Heads merged with a symbolic batch get a period (rank r: its heads of every row) and
    come back out of it; a static batch keeps the blocks it always had; a split sequence
    merged with the batch is no contiguous part and is refused."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from shardplan.layouts import Shard
    from shardplan.planner.reshape import map_reshape
    env = ShapeEnv()
    b, t = (env.create_symintnode(env.create_symbol(h, ConstantSource(n)), hint=h)
            for n, h in (("B", 3), ("T", 5)))
    assert map_reshape(Shard(1), [b, 4, t, 8], [4 * b, t, 8], 2) == Shard(0, period=4)
    assert map_reshape(Shard(0, period=4), [4 * b, t, t], [b, 4, t, t], 2) == Shard(1)
    # [B*4] as [B*2, 2]: head h of row i is at (2i + h // 2, h % 2); rank 0 holds heads 0, 1
    assert map_reshape(Shard(0, period=4), [4 * b, t], [2 * b, 2, t], 2) == Shard(0, period=2)
    assert map_reshape(Shard(1), [2, 4, t], [8, t], 2) == Shard(0, (4, 4))
    assert map_reshape(Shard(1), [b, t, 8], [b * t, 8], 2)[0].startswith("reshape mixes")


def test_region_that_cannot_close_stays_replicated_or_gathers():
    """cumsum has no rule: its region either stays replicated (a warning) or, where that
    costs less, the split hidden activation is all-gathered at the cumsum (the gather
    move: fc stays column parallel, no warning); an error under strict either way, and
    correct on every rank."""
    torch.manual_seed(0)
    model = TinyLM(mlp_op="cumsum")
    results = _check(model, 2)
    assert all(r[3]["blocks.0.fc.weight"] == shardplan.Shard(0) for r in results)
    assert isinstance(results[0][3]["blocks.0.wqkv.weight"], shardplan.Shard)  # attention unaffected
    idx = torch.zeros(2, 4, dtype=torch.long)
    p = shardplan.plan(model, 2, example_inputs=idx)
    assert [c.chosen for c in p.choices if c.nodes == ["cumsum"]] == ["gathered"]
    assert not p.warnings
    # many tokens: gathering them costs more than holding fc whole
    many = shardplan.plan(model, 2, example_inputs=torch.zeros(64, 16, dtype=torch.long))
    assert [c.chosen for c in many.choices if "cumsum" in c.nodes[0]] == ["replicated"] * 2
    assert many.count(purpose="gather") == 0
    kept = [d for d in many.decisions if d.role == "replicated" and d.module == "blocks.0.fc"]
    assert kept and "cumsum" in kept[0].rule
    assert any("blocks.0.fc" in w and "cumsum" in w for w in many.warnings)
    with pytest.raises(shardplan.LayoutError, match="cumsum"):
        shardplan.plan(model, 2, example_inputs=idx, strict=True)


def test_softmax_over_the_split_dim_runs_distributed():
    """A softmax over the split hidden dim runs distributed (its max and sum of exps
    all-reduced): the MLP stays split, no warning, correct, also under strict."""
    torch.manual_seed(0)
    model = TinyLM(mlp_op="softmax")
    results = _check(model, 2)
    assert all(r[3]["blocks.0.fc.weight"] == shardplan.Shard(0) for r in results)
    idx = torch.zeros(2, 4, dtype=torch.long)
    p = shardplan.plan(model, 2, example_inputs=idx, strict=True)
    assert not p.warnings
    assert {c.chosen for c in p.choices} == {"distributed"}
    assert p.count(purpose="stat") == 2 * 2  # max and sum, in each of the 2 blocks


def test_fallback_warns_beside_a_region_that_does_not_close():
    """A region reaching a softmax over the split dim (no warning) and, on another branch,
    an op without a rule still warns about the missing rule."""
    p = shardplan.plan(TinyLM(mlp_op="softmax+cumsum"), 2,
                       example_inputs=torch.zeros(2, 4, dtype=torch.long))
    assert p.param("blocks.0.fc.weight").layout == "R"
    assert any("blocks.0.fc" in w and "cumsum" in w for w in p.warnings)


def test_verify_catches_a_wrong_rule_and_names_the_node(tmp_path):
    """A rule set that wrongly calls softmax elementwise gives a silently wrong model;
    verify must say so and point at the softmax."""
    text = RULES.read_text()
    text = text.replace('"aten.softmax.int" = { dim = "1" }\n', "")
    text = text.replace('elementwise = [\n', 'elementwise = [\n  "aten.softmax.int",\n')
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    torch.manual_seed(0)
    model = TinyLM(mlp_op="softmax")
    idx = torch.randint(0, 64, (2, 6))
    good = shardplan.verify(model, 2, example_inputs=(idx, idx))
    wrong = shardplan.verify(model, 2, example_inputs=(idx, idx), rules=bad)
    assert good.ok and good.first_divergent_node is None
    assert not wrong.ok
    assert wrong.first_divergent_node.startswith("softmax")
    assert "MISMATCH" in str(wrong)


def test_heads_not_divisible_names_module_line_and_fix():
    """6 heads at tp=4: strict refuses, naming the module, the line and the tps that
    divide; otherwise the attention stays whole (warned) and the MLP splits."""
    model = build("gpt-tiny", n_head=6, n_embd=48)
    with pytest.raises(shardplan.DivisibilityError) as e:
        shardplan.plan(model, 4, strict=True)
    msg = str(e.value)
    assert "transformer.h.0.attn" in msg and "gpt.py:" in msg and "tp=4" in msg
    assert "fix: choose a tp dividing 6: 2, 3, 6 (tp=4 does not)" in msg
    p = shardplan.plan(model, 4)
    assert p.param("transformer.h.0.attn.c_attn.weight").layout == "R"
    assert p.param("transformer.h.0.mlp.c_fc.weight").layout == "S(0)"
    assert any("c_attn) kept replicated: split of a sharded dim into [6, 8] does not divide "
               "by tp=4" in w for w in p.warnings), p.warnings


def test_kv_heads_not_dividing_tp_nor_divided_by_it():
    """12 query heads on 4 ranks need K/V heads 0,0,0 | 0,1,1 | ...: with 3 K/V heads no
    rank can hold whole heads of its own, so K and V stay whole (never mis-sliced) and
    the result is the unsharded model's; strict refuses."""
    torch.manual_seed(0)
    model = build("llama-tiny", n_heads=12, n_kv_heads=3, dim=96)
    with pytest.raises(shardplan.DivisibilityError, match="layers.0.attention"):
        shardplan.plan(model, 4, strict=True)
    p = shardplan.plan(model, 4)
    for name in ("wk", "wv"):
        assert p.param(f"layers.0.attention.{name}.weight").layout == "R"
    assert p.param("layers.0.feed_forward.w1.weight").layout == "S(0)"
    assert shardplan.verify(model, 4).ok


@pytest.mark.parametrize("kv,heads,tp", [(2, 4, 4), (2, 8, 8)])
def test_kv_heads_fewer_than_tp_are_held_by_rank_groups(kv, heads, tp):
    """Each rank holds the K/V head its query heads use; the ranks sharing a head sum its
    gradient (one backward all-reduce of the K and V weights per layer)."""
    torch.manual_seed(0)
    model = build("llama-tiny", n_heads=heads, n_kv_heads=kv, dim=16 * heads)
    idx = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(3))
    report = shardplan.verify(model, tp, example_inputs=(idx, idx))
    assert report.ok, str(report)
    p = shardplan.plan(model, tp, example_inputs=(idx, idx))
    wk = p.param("layers.0.attention.wk.weight")
    assert wk.layout == f"S(0|x{tp // kv})" and wk.local_shape == [16, 16 * heads]
    sums = [c for c in p.collectives if c.purpose == "replica_grad"]
    assert len(sums) == 2 * 2 and all(c.elements == kv * 16 * 16 * heads for c in sums)
    assert not p.warnings


@pytest.mark.parametrize("mask_shape", ["TT", "11TT", "B1TT", "BHTT"])
@pytest.mark.parametrize("tp", [2, 4])
def test_sdpa_mask_broadcasts_or_is_sliced_to_this_ranks_heads(tp, mask_shape):
    """A mask with fewer dims, or size 1 on the heads, is used whole on every rank;
    one with a head dim of its own is sliced like the query heads."""
    B, H, T = 2, 4, 5
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, 32, generator=g)
    sizes = {"B": B, "H": H, "T": T, "1": 1}
    mask = torch.randn([sizes[c] for c in mask_shape], generator=g)  # differs per head
    torch.manual_seed(0)
    model = MaskedSDPA(heads=H)
    report = shardplan.verify(model, tp, example_inputs=(x, mask))
    assert report.ok, str(report)
    p = shardplan.plan(model, tp, example_inputs=(x, mask))
    assert p.param("wq.weight").layout == "S(0)" and p.param("wo.weight").layout == "S(1)"
    assert not p.warnings


@pytest.mark.parametrize("project_kv", [True, False])
@pytest.mark.parametrize("tp", [2, 4])
def test_sdpa_grouped_kv_heads_are_split_with_the_query_heads(tp, project_kv):
    """enable_gqa with 2 K/V heads for 4 query heads: at tp=2 each rank pairs its query
    heads with its K/V head (sliced when K/V are replicated). At tp=4 the K/V heads do not
    split: projected ones stay whole (strict refuses); with replicated ones the attention
    runs replicated on the queries all-gathered for it (cheaper here than holding wq
    whole; an error under strict)."""
    torch.manual_seed(0)
    model, x = GroupedSDPA(project_kv), torch.randn(2, 5, 16)
    if tp == 4 and project_kv:
        with pytest.raises(shardplan.LayoutError, match="scaled_dot_product_attention"):
            shardplan.plan(model, tp, example_inputs=x, strict=True)
        assert shardplan.verify(model, tp, example_inputs=x).ok
        p = shardplan.plan(model, tp, example_inputs=x)
        assert p.param("wkv.weight").layout == "R" and p.warnings
        return
    report = shardplan.verify(model, tp, example_inputs=x)
    assert report.ok, str(report)
    p = shardplan.plan(model, tp, example_inputs=x)
    if tp == 2:
        assert p.param("wq.weight").layout == "S(0)" and not p.warnings
        return
    assert p.param("wq.weight").layout == "S(0)" and not p.warnings
    assert [c.chosen for c in p.choices] == ["gathered"] and p.count(purpose="gather") == 1
    with pytest.raises(shardplan.LayoutError, match="sharded factor 'h'"):
        shardplan.plan(model, tp, example_inputs=x, strict=True)


def test_untraceable_forward_names_the_line():
    with pytest.raises(shardplan.CaptureError) as e:
        shardplan.plan(DataDependent(), 2)
    msg = str(e.value)
    assert "DataDependent" in msg and "planner_models.py:" in msg and "if x.sum() > 0" in msg
    assert "fix:" in msg


def test_no_token_input_needs_example_inputs():
    with pytest.raises(shardplan.CaptureError, match="example_inputs"):
        shardplan.plan(NoTokens(), 2)
    p = shardplan.plan(NoTokens(), 2, example_inputs=torch.randn(3, 8))
    assert p.param("fc1.weight").layout == "S(0)" and p.param("fc2.weight").layout == "S(1)"


def test_parallelize_without_process_group():
    with pytest.raises(shardplan.ConfigurationError, match="init_process_group"):
        shardplan.parallelize(build("gpt-tiny"), tp=2)


def test_parallelize_twice_and_wrong_tp():
    idx = torch.zeros(2, 4, dtype=torch.long)

    model = build("gpt-tiny")

    def body(ctx):
        s = shardplan.parallelize(model, group=ctx.group, example_inputs=idx)
        with pytest.raises(shardplan.ConfigurationError, match="already parallelized"):
            shardplan.parallelize(s, group=ctx.group)
        with pytest.raises(shardplan.ConfigurationError, match="tp=4"):
            shardplan.parallelize(model, tp=4, group=ctx.group)

    SimulatedRanks(2).run(body)


def test_bad_rule_file(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text("name = 'x'\nversion = [\n")
    with pytest.raises(shardplan.RuleError, match="does not parse"):
        shardplan.plan(build("gpt-tiny"), 2, rules=broken)
    invalid = tmp_path / "invalid.toml"
    invalid.write_text("name = 'x'\nversion = 1\n[strategy]\nopen = [{ op = 'x' }]\n")
    with pytest.raises(shardplan.RuleError, match="not a valid rule set"):
        shardplan.plan(build("gpt-tiny"), 2, rules=invalid)


def test_plan_json_round_trip_and_schema():
    p = shardplan.plan(build("gpt-tiny"), 2)
    again = shardplan.Plan.from_json(p.to_json())
    assert again == p
    schema = shardplan.Plan.model_json_schema()
    assert "schema_version" in schema["properties"]
    c = p.collectives[0]
    assert c.source and ".py:" in c.source and c.node and c.module is not None
    assert {d.role for d in p.decisions} >= {"column", "row", "vocab_embedding"}


def test_different_models_on_ranks_are_refused():
    """Each rank initializing its own random model: shards of different models."""
    idx = torch.zeros(2, 4, dtype=torch.long)

    def body(ctx):
        torch.manual_seed(ctx.rank)  # simulated ranks share one generator: seed explicitly
        model = build("gpt-tiny")
        with pytest.raises(shardplan.CommunicationError, match="not the same model") as e:
            shardplan.parallelize(model, group=ctx.group, example_inputs=idx)
        assert "transformer.wte.weight" in str(e.value)
        shardplan.parallelize(model, group=ctx.group, example_inputs=idx, check_model=False)

    SimulatedRanks(2).run(body)


def test_replica_drift_is_named():
    model = build("gpt-tiny")
    idx = torch.zeros(2, 4, dtype=torch.long)

    def body(ctx):  # each rank its own copy: threads would share replicated parameters
        s = shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=idx)
        shardplan.check_replicas(s)  # identical after parallelize
        if ctx.rank == 1:
            with torch.no_grad():
                s.get_parameter("transformer.h.1.ln_2.weight").add_(1e-3)
        with pytest.raises(shardplan.CommunicationError, match="h.1.ln_2.weight"):
            shardplan.check_replicas(s)

    SimulatedRanks(2).run(body)


def test_meta_sharded_model_refuses_to_run_before_loading():
    model = build("gpt-tiny", device="meta")

    def body(ctx):
        s = shardplan.parallelize(model, group=ctx.group)
        with pytest.raises(shardplan.CheckpointError, match="never loaded"):
            s(torch.zeros(1, 4, dtype=torch.long))

    SimulatedRanks(2).run(body)


def test_parameters_on_several_devices():
    model = build("gpt-tiny")
    model.lm_head.to("meta")
    with pytest.raises(shardplan.ConfigurationError, match="several devices"):
        SimulatedRanks(1).run(lambda ctx: shardplan.parallelize(model, group=ctx.group))


def test_plan_entries_say_their_mesh_dims():
    p = shardplan.plan(build("gpt-tiny"), 2)
    data = json.loads(p.to_json())
    assert data["schema_version"] == 2 and data["mesh"] == {"tp": 2}
    assert data["tp"] == 2  # still written, for readers of schema 1
    assert p.dims == MeshSizes.of(tp=2) and p.tp == 2
    for e in p.params:
        lay = MeshLayout.parse(e.mesh_layout)
        assert lay.names == ("tp",) and lay["tp"] == Placement.parse(e.layout)
    assert any(isinstance(MeshLayout.parse(e.mesh_layout)["tp"], Shard) for e in p.params)
    assert p.collectives and {c["mesh_dim"] for c in data["collectives"]} == {"tp"}
