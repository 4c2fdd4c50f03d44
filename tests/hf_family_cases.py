"""Tiny Hugging Face models of the families with MoE experts, fused multi-query
attention, sliced fused QKV, K/V heads fewer than tp, attention with its heads merged into
the batch dim, attention sinks, multi-head latent attention and experts looped over in
eager (random weights, nothing downloaded)."""

from __future__ import annotations

import functools

import torch

from hf_cases import VOCAB, inputs

# family -> (config class, its sizes): 1 layer, hidden 32 or 64, 4 experts with top-2
CONFIGS = {
    "mixtral": ("MixtralConfig", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])),
    "falcon_mqa": ("FalconConfig", dict(
        hidden_size=32, num_attention_heads=4, multi_query=True, new_decoder_architecture=False,
        parallel_attn=True, bias=False)),
    "falcon_gqa": ("FalconConfig", dict(
        hidden_size=64, num_attention_heads=8, num_kv_heads=4, new_decoder_architecture=True,
        bias=False)),
    "phi3": ("Phi3Config", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        pad_token_id=0)),
    # heads merged into the batch dim ([B*H, T, D], bmm): BLOOM with its ALiBi bias,
    # XGLM, DeBERTa-v2 with relative positions (its position keys repeated per batch row)
    "bloom": ("BloomConfig", dict(hidden_size=32, n_head=4)),
    "xglm": ("XGLMConfig", dict(d_model=32, attention_heads=4, ffn_dim=32, pad_token_id=1)),
    "deberta_v2": ("DebertaV2Config", dict(
        hidden_size=32, num_attention_heads=4, intermediate_size=32, relative_attention=True,
        pos_att_type=["p2c", "c2p"], position_buckets=8, share_att_key=True,
        position_biased_input=False)),
    # attention sinks (a logit per head joined to the scores), interleaved gate | up experts
    "gpt_oss": ("GptOssConfig", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["full_attention"], rope_parameters={"rope_type": "default",
                                                        "rope_theta": 10000.0})),
    # multi-head latent attention (low-rank q and k/v, interleaved rotary), routed and
    # shared experts
    "deepseek_v3": ("DeepseekV3Config", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32,
        moe_intermediate_size=16, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0,
        n_shared_experts=1)),
    # experts in 2-D weights (each expert's rows in turn) looped over in eager: captured
    # in shardplan's capturable form; 4 K/V heads (a fused QKV with fewer K/V heads than
    # tp is a known limit)
    "dbrx": ("DbrxConfig", dict(
        d_model=32, n_heads=4,  # its own names: hidden_size would not reach its ffn_config
        attn_config=dict(kv_n_heads=4, clip_qkv=8.0),
        ffn_config=dict(hidden_size=32, ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2))),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(
        hidden_size=32, num_attention_heads=4, n_inner=32, multi_query=True)),
    "olmo2": ("Olmo2Config", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32)),
}
MASKED_LM = {"deberta_v2"}
FAMILIES = list(CONFIGS)


def build(family: str) -> torch.nn.Module:
    """``family`` of CONFIGS; ``mixtral_batched_mm``: Mixtral with HF's other capturable
    experts implementation (each token's expert weights gathered, then ``bmm``)."""
    import transformers as tf
    if family == "mixtral_batched_mm":
        model = build("mixtral")
        model.set_experts_implementation("batched_mm")
        return model
    cls, sizes = CONFIGS[family]
    cfg = getattr(tf, cls)(num_hidden_layers=1, vocab_size=VOCAB, max_position_embeddings=64,
                           bos_token_id=0, eos_token_id=0, use_cache=False, **sizes)
    cfg._attn_implementation = "eager"
    if family == "dbrx":  # its attention reads a rope_theta its own config lacks
        cfg.attn_config.rope_theta = cfg.rope_parameters["rope_theta"]
    torch.manual_seed(0)
    auto = tf.AutoModelForMaskedLM if family in MASKED_LM else tf.AutoModelForCausalLM
    return auto.from_config(cfg).eval()


@functools.lru_cache(maxsize=None)
def captured(family: str):
    """One capture of ``build(family)`` on ``inputs()``, shared by the family's tp cases
    (export is the slow part)."""
    from shardplan.planner.capture import capture
    return capture(build(family), (), inputs())


def real_steps(ctx, families: tuple[str, ...]) -> list:
    """On a real rank: ``hf_cases.step`` (parallelize, forward, backward) of each family,
    one process group for all; (logits, loss, grads, layouts) each."""
    from hf_cases import step
    return [step(ctx, build(f), inputs())[:4] for f in families]
