"""Hugging Face Mixtral, Qwen2-MoE, Falcon, Phi-3, GPT-BigCode, BLOOM, XGLM, DeBERTa-v2,
GPT-OSS, DeepSeek-V3 and DBRX (tiny, random weights) at tp 2 and 4, OLMo2 at tp 4, on
simulated ranks: every rank's logits, loss and every gradient copy equal the unsharded
model's, the experts, MLPs, fused projections, attention with heads merged into the batch
dim, attention sinks and latent attention's b-projections are really split (layouts, and
the parameter elements each rank holds), and every rank's ledger is the plan's
collectives."""

from __future__ import annotations

import math
from collections import Counter

import pytest

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from shardplan.layouts import Shard  # noqa: E402
from shardplan.ranks import SimulatedRanks  # noqa: E402

from checks import assert_equivalent  # noqa: E402
from hf_cases import inputs, reference, step  # noqa: E402
from hf_family_cases import build, captured, real_steps  # noqa: E402


def kv(tp: int) -> str:
    """2 K/V heads: split at tp 2, each held by 2 ranks at tp 4."""
    return "S(0)" if tp == 2 else "S(0|x2)"


def expected(family: str, tp: int) -> dict:
    """The layouts Megatron gives the layer's weights (R: held whole, by design)."""
    a = "model.layers.0.self_attn."
    attention = {a + "q_proj.weight": "S(0)", a + "k_proj.weight": kv(tp),
                 a + "v_proj.weight": kv(tp), a + "o_proj.weight": "S(1)"}
    experts = {"model.layers.0.mlp.experts.gate_up_proj": "S(1|32+32)",  # (E, 2I, H): gate | up
               "model.layers.0.mlp.experts.down_proj": "S(2)",  # (E, H, I)
               "model.layers.0.mlp.gate.weight": "R"}  # the router
    m = "model.layers.0.mlp.shared_expert"
    b, x, d = "transformer.h.0.", "model.layers.0.", "deberta.encoder.layer.0."
    return {
        "mixtral": {**attention, **experts},
        "mixtral_batched_mm": {**attention, **experts},
        "qwen2_moe": {**attention, **experts, m + ".gate_proj.weight": "S(0)",
                      m + ".up_proj.weight": "S(0)", m + ".down_proj.weight": "S(1)",
                      m + "_gate.weight": "R"},  # 1 wide: does not split
        # the fused [q: 4 heads | k: 1 | v: 1]: queries split, the K and V head whole on
        # every rank
        "falcon_mqa": {"transformer.h.0.mlp.dense_h_to_4h.weight": "S(0)",
                       "transformer.h.0.mlp.dense_4h_to_h.weight": "S(1)",
                       "transformer.h.0.self_attention.query_key_value.weight":
                           f"S(0|32+8+8|x1+{tp}+{tp})",
                       "transformer.h.0.self_attention.dense.weight": "S(1)"},
        "falcon_gqa": {"transformer.h.0.mlp.dense_h_to_4h.weight": "S(0)",
                       "transformer.h.0.mlp.dense_4h_to_h.weight": "S(1)",
                       "transformer.h.0.self_attention.query_key_value.weight": "S(0)",
                       "transformer.h.0.self_attention.dense.weight": "S(1)"},
        # [q: 4 heads | k: 2 | v: 2]: at tp 4 each K/V head on 2 ranks, each query head on 1
        "phi3": {a + "qkv_proj.weight": "S(0|32+16+16)" if tp == 2 else "S(0|32+16+16|x1+2+2)",
                 a + "o_proj.weight": "S(1)",
                 "model.layers.0.mlp.gate_up_proj.weight": "S(0|32+32)",
                 "model.layers.0.mlp.down_proj.weight": "S(1)"},
        # heads interleaved per head in the fused QKV: a plain split by heads
        "bloom": {b + "self_attention.query_key_value.weight": "S(0)",
                  b + "self_attention.dense.weight": "S(1)",
                  b + "mlp.dense_h_to_4h.weight": "S(0)", b + "mlp.dense_4h_to_h.weight": "S(1)"},
        "xglm": {x + "self_attn.q_proj.weight": "S(0)", x + "self_attn.k_proj.weight": "S(0)",
                 x + "self_attn.v_proj.weight": "S(0)", x + "self_attn.out_proj.weight": "S(1)",
                 x + "fc1.weight": "S(0)", x + "fc2.weight": "S(1)"},
        # the MLM transform (dense -> gelu -> LayerNorm) stays whole, as for BERT
        "deberta_v2": {d + "attention.self.query_proj.weight": "S(0)",
                       d + "attention.self.key_proj.weight": "S(0)",
                       d + "attention.self.value_proj.weight": "S(0)",
                       d + "attention.output.dense.weight": "S(1)",
                       d + "intermediate.dense.weight": "S(0)", d + "output.dense.weight": "S(1)",
                       "cls.predictions.transform.dense.weight": "R"},
        "gpt_oss": {
            **attention, a + "q_proj.bias": "S(0)", a + "k_proj.bias": kv(tp),
            a + "o_proj.bias": "R",
            a + "sinks": "S(0)",  # a logit per head: split with the heads, not sliced per step
            "model.layers.0.mlp.router.weight": "R",
            # (E, H, 2I), gate and up interleaved: each rank whole (gate, up) pairs
            "model.layers.0.mlp.experts.gate_up_proj": "S(2)",
            "model.layers.0.mlp.experts.gate_up_proj_bias": "S(1)",
            "model.layers.0.mlp.experts.down_proj": "S(1)",  # (E, I, H)
            "model.layers.0.mlp.experts.down_proj_bias": "R"},
        "deepseek_v3": {
            # Megatron's MLA: the low-rank a-projections whole, the b-projections by heads
            a + "q_a_proj.weight": "R", a + "kv_a_proj_with_mqa.weight": "R",
            a + "q_b_proj.weight": "S(0)", a + "kv_b_proj.weight": "S(0)",
            a + "o_proj.weight": "S(1)",
            **{k: v.replace("32+32", "16+16") for k, v in experts.items()},
            "model.layers.0.mlp.shared_experts.gate_proj.weight": "S(0)",
            "model.layers.0.mlp.shared_experts.up_proj.weight": "S(0)",
            "model.layers.0.mlp.shared_experts.down_proj.weight": "S(1)"},
        "dbrx": {  # (E * F, H): every expert's F rows split alike
            "transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight": "S(0|32+32+32)",
            "transformer.blocks.0.norm_attn_norm.attn.out_proj.weight": "S(1)",
            "transformer.blocks.0.ffn.router.layer.weight": "R",
            **{f"transformer.blocks.0.ffn.experts.mlp.{w}": "S(0|32+32+32+32)"
               for w in ("w1", "v1", "w2")}},
        # multi-query: the fused [q | k: 1 head | v: 1 head] viewed after unsqueeze and split
        "gpt_bigcode": {"transformer.h.0.attn.c_attn.weight": f"S(0|32+8+8|x1+{tp}+{tp})",
                        "transformer.h.0.attn.c_attn.bias": f"S(0|32+8+8|x1+{tp}+{tp})",
                        "transformer.h.0.attn.c_proj.weight": "S(1)",
                        "transformer.h.0.mlp.c_fc.weight": "S(0)",
                        "transformer.h.0.mlp.c_proj.weight": "S(1)"},
        # the k RMSNorm over both K heads, each held by 2 ranks at tp 4: distributed
        "olmo2": {**attention, a + "q_norm.weight": "S(0)", a + "k_norm.weight": kv(tp)},
    }[family]


CASES = [(f, tp) for f in ("mixtral", "qwen2_moe", "falcon_mqa", "falcon_gqa", "phi3",
                           "mixtral_batched_mm", "gpt_bigcode", "bloom", "xglm", "deberta_v2",
                           "gpt_oss", "deepseek_v3", "dbrx") for tp in (2, 4)] + [("olmo2", 4)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,tp", CASES)
def test_family_is_sharded_and_equal(family, tp):
    model, kw = build(family), inputs()
    results = SimulatedRanks(tp).run(step, model, kw, True, captured(family))
    assert_equivalent(results, reference(model, kw))
    want = expected(family, tp)
    full = dict(model.named_parameters())
    for rank, r in enumerate(results):
        layouts, grads = r[3], r[2]
        assert {n: str(layouts[n]) for n in want} == want, f"rank {rank}"
        for name, lay in layouts.items():  # each rank holds its 1/tp (x replicas) and no more
            if isinstance(lay, Shard) and not lay.padded and name in full:
                per_block = [b * r // tp for b, r in zip(lay.blocks or full[name].shape[lay.dim:][:1],
                                                         lay.block_replicas())]
                assert grads[name].shape[lay.dim] == sum(per_block), name
    plan = results[0][5]
    # what stays whole is the plan's decision, with its reason: never a silent replica
    assert all(d.rule for d in plan.decisions if d.role == "replicated"), plan.decisions
    assert not plan.warnings, plan.warnings
    # what ranks ran is what the plan says (a replica sum of the blocks held by several
    # ranks only; the padded logits' gather aside: the plan counts it unpadded)
    for records in (r[4] for r in results):
        assert Counter((r.kind, r.direction, r.elements) for r in records
                       if r.kind != "all_gather") == \
            Counter((c.kind, c.direction, c.elements) for c in plan.collectives
                    if c.purpose != "gather_output")
    if family == "olmo2":  # weighed against keeping k whole, the distributed norm wins
        assert {c.module.rsplit(".", 1)[-1]: c.chosen for c in plan.choices} == \
            {"q_norm": "distributed", "k_norm": "distributed"}
    if family.startswith(("mixtral", "qwen2_moe")):
        assert_params_per_rank(model, plan, tp)
    if family == "deepseek_v3":  # the shared rotary key's f before its expand to the heads
        rope = model.config.qk_rope_head_dim
        assert [c.elements for c in plan.collectives if c.purpose == "f"].count(
            plan.tokens * rope) == 1
    if family.startswith(("mixtral", "qwen2_moe", "deepseek_v3", "dbrx", "gpt_oss")):
        # Megatron's one g per MoE layer (b*s*h), after the experts' combine and the
        # shared expert's sum (GPT-OSS: its experts' biases carried beside the partial
        # sum): not one per top-k copy, nor one per expert kind
        g = [c for c in plan.collectives
             if c.purpose == "g" and (".mlp" in c.module or ".ffn" in c.module)]
        assert [c.elements for c in g] == [plan.tokens * model.config.hidden_size], g
        # and its f before the tokens are copied k times: no f is larger than b*s*h
        f = [c.elements for c in plan.collectives if c.purpose == "f"]
        assert max(f) == plan.tokens * model.config.hidden_size, f


@pytest.mark.real
@pytest.mark.timeout(400)
def test_tp2_real_gloo(real_ranks):
    """The experts' grouped GEMMs, Falcon's ``x @ W.T`` and its fused multi-query QKV (a
    replica sum of the blocks every rank holds) and BLOOM's heads merged into the batch dim
    (its ALiBi sliced by the period) on two gloo processes, one launch for all."""
    families = ("qwen2_moe", "falcon_mqa", "bloom")
    results = real_ranks(2).run(real_steps, families)
    for i, family in enumerate(families):
        per_rank = [r[i] for r in results]
        assert_equivalent(per_rank, reference(build(family), inputs()))
        want = expected(family, 2)
        for rank, r in enumerate(per_rank):
            assert {n: str(r[3][n]) for n in want} == want, f"{family}, rank {rank}"


def assert_params_per_rank(model, plan, tp: int) -> None:
    """Parameters per rank: 1/tp of everything but the norms, the router, the 1-wide
    shared-expert gate, the K/V heads (2 heads: each on tp/2 ranks) and the vocabulary's
    padding, within 3% of that."""
    whole = ("norm", "mlp.gate.weight", "shared_expert_gate")
    want = 0.0
    for name, p in model.named_parameters():
        n = p.numel()
        want += n if any(w in name for w in whole) else \
            n * max(1, tp // 2) / tp if name.endswith(("k_proj.weight", "v_proj.weight")) \
            else n / tp
    got = plan.memory.param_bytes_per_rank / next(model.parameters()).element_size()
    assert math.isclose(got, want, rel_tol=0.03), (got, want)

