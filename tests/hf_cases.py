"""Hugging Face models with random weights (nothing downloaded; biases not zero), for the
HF tests."""

from __future__ import annotations

import copy

import torch

import shardplan
from shardplan.planner.rules import load_rules
from shardplan.runtime.ledger import CommLedger
from shardplan.sharded import ShardedModule

VOCAB = 101  # not divisible by 2 or 4: the vocabulary gets padded


def nonzero_biases(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """``model`` with every bias filled with small random values from a seeded generator.

    The builders (HF's and shardplan's) start biases at zero, where a bias sliced from
    another rank's range (every rank taking rank 0's part) computes as the right one.
    (Here, not in checks.py: ``python -m tests.golden_cases`` imports this module.)
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] == "bias" and not p.is_meta:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    return model


def build(kind: str, attn: str = "sdpa", layers: int = 2, heads: int = 4, kv_heads: int = 2,
          hidden: int = 64):
    import transformers as tf
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=VOCAB,
                            n_positions=32, bos_token_id=0, eos_token_id=0)
        model = tf.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, intermediate_size=96, vocab_size=VOCAB,
                             max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
        model = tf.LlamaForCausalLM(cfg)
    else:
        cfg = tf.BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=64)
        model = tf.BertForMaskedLM(cfg)
    model.config._attn_implementation = attn
    model.config.use_cache = False
    return nonzero_biases(model.eval())


def inputs(b: int = 2, t: int = 6):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    labels = torch.randint(0, VOCAB, (b, t), generator=g)
    labels[0, 0] = -100  # an ignored position
    mask = torch.ones(b, t, dtype=torch.long)
    mask[-1, -2:] = 0  # padding in the last sequence
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def reference(model, kw):
    ref = copy.deepcopy(model)
    out = ref(**kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def step(ctx, model, kw, gather_output=True, captured=None):
    """One forward/backward on this rank; ``captured`` (made once for all ranks) skips
    the per-rank export."""
    if captured is None:
        sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                        example_inputs=kw, gather_output=gather_output)
    else:
        sharded = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(), example=((), kw),
                                gather_output=gather_output, strict=False,
                                captured=copy.deepcopy(captured))
    with CommLedger() as ledger:
        out = sharded(**kw)
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in sharded.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    return (out.logits.detach(), out.loss.detach(), grads, sharded.layouts, ledger.records,
            sharded.plan)


def real_step(ctx, kind, kw):
    return step(ctx, build(kind), kw)


def full_round_trip(ctx, model, file, kw):
    """Load a full HF safetensors file into the sharded model (each rank its slices),
    run it, and gather a full state dict back."""
    from shardplan import checkpoint
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()  # nothing of the original survives but what the file holds
    sharded = shardplan.parallelize(fresh, group=ctx.group, example_inputs=kw)
    checkpoint.load_full_state_dict(sharded, file)
    out = sharded(**kw)
    return out.logits.detach(), checkpoint.gather_full_state_dict(sharded)
