"""Model builders and per-rank functions shared by the planner tests (picklable for RealRanks)."""

from __future__ import annotations

import copy

import torch

import shardplan
from shardplan.models import GPT, GPTConfig, Llama, LlamaConfig
from shardplan.planner.rules import load_rules
from shardplan.runtime.ledger import CommLedger
from shardplan.sharded import ShardedModule

from checks import full_gradient
from hf_cases import nonzero_biases


def make_model(family: str, seed: int = 0, **cfg):
    """A bundled GPT or Llama from ``seed``, its biases not zero (``nonzero_biases``)."""
    torch.manual_seed(seed)
    if family == "gpt":
        base = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
        return nonzero_biases(GPT(GPTConfig(**{**base, **cfg})), seed)
    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                max_seq_len=16)
    return nonzero_biases(Llama(LlamaConfig(**{**base, **cfg})), seed)


def batch(vocab: int, b: int, t: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


def reference(model, idx, tgt):
    """Unsharded logits, loss and gradients, by FQN (every alias of a tied weight)."""
    ref = copy.deepcopy(model)
    logits, loss = ref(idx, tgt)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters(remove_duplicate=False)}
    return logits.detach(), loss.detach(), grads


def sharded_step(ctx, model, idx, tgt, gather_output=True, captured=None, recompute=False,
                 sequence_parallel=False):
    """One forward/backward of the parallelized model on this rank.

    ``captured`` (a capture made once for all ranks) skips the per-rank export.
    """
    if captured is None or recompute:
        sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                        example_inputs=(idx, tgt), gather_output=gather_output,
                                        recompute=recompute,
                                        sequence_parallel=sequence_parallel)
    else:
        sharded = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(),
                                example=((idx, tgt), {}), gather_output=gather_output,
                                strict=False, captured=copy.deepcopy(captured),
                                sequence_parallel=sequence_parallel)
    with CommLedger() as ledger:
        logits, loss = sharded(idx, tgt)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in sharded.named_parameters(remove_duplicate=False)}
    return logits.detach(), loss.detach(), grads, sharded.layouts, ledger.records


def gather_grads(results, ref_grads):
    """Each parameter's full gradient from every rank's shard or replica, after checking
    that every replica (and every member of a K/V replica group) holds the same."""
    layouts = results[0][3]
    return {name: full_gradient(layouts[name], [r[2][name] for r in results], g.shape, name)
            for name, g in ref_grads.items()}


def real_rank_step(ctx, family, cfg, b, t):
    """A whole case on one real rank: model and data from fixed seeds."""
    model = make_model(family, **cfg)
    idx, tgt = batch(model.config.vocab_size, b, t)
    return sharded_step(ctx, model, idx, tgt)


def real_rank_count_step(ctx, family, cfg, b, t):
    """Two steps on one real rank: gathered logits without recomputation, and
    vocabulary-sharded logits (``gather_output=False``) with ``recompute=True``."""
    model = make_model(family, **cfg)
    idx, tgt = batch(model.config.vocab_size, b, t)
    return (sharded_step(ctx, model, idx, tgt),
            sharded_step(ctx, model, idx, tgt, gather_output=False, recompute=True))
