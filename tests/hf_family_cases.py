"""Tiny Hugging Face models of the families with MoE experts, fused multi-query
attention, sliced fused QKV and K/V heads fewer than tp (random weights, nothing
downloaded)."""

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
    "gpt_bigcode": ("GPTBigCodeConfig", dict(
        hidden_size=32, num_attention_heads=4, n_inner=32, multi_query=True)),
    "olmo2": ("Olmo2Config", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32)),
}
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
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


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
