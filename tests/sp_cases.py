"""Sequence-parallel steps run on every rank (module level: real gloo workers import them)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardplan.planner.rules import load_rules
from shardplan.runtime.ledger import CommLedger
from shardplan.sharded import ShardedModule


class SequenceFirst(nn.Module):
    """A tiny pre-norm Transformer whose activations are [T, B, H] (Megatron's layout)."""

    def __init__(self, vocab=64, h=32, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln1=nn.LayerNorm(h), q=nn.Linear(h, h), k=nn.Linear(h, h), v=nn.Linear(h, h),
            proj=nn.Linear(h, h), ln2=nn.LayerNorm(h), fc=nn.Linear(h, 4 * h),
            out=nn.Linear(4 * h, h))) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)

    def forward(self, idx):  # idx [B, T]
        x = self.emb(idx.t())
        t, b, h = x.shape
        for blk in self.blocks:
            y = blk["ln1"](x)
            q, k, v = (blk[n](y).view(t, b, self.heads, h // self.heads).permute(1, 2, 0, 3)
                       for n in "qkv")
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](a.permute(2, 0, 1, 3).reshape(t, b, h))
            x = x + blk["out"](F.gelu(blk["fc"](blk["ln2"](x))))
        return self.head(self.norm(x))


def saved_bytes(fn):
    """``fn()``, and what autograd keeps for backward while it runs: (bytes, each
    storage once; the set of saved shapes)."""
    seen, total, shapes = set(), 0, set()

    def pack(t):
        nonlocal total
        shapes.add(tuple(t.shape))
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, (total, shapes)


def step(ctx, model, args, kwargs, captured, sequence_parallel=True, loss_of=None,
         recompute=False):
    """One forward/backward of the sharded model on this rank: (output, loss, grads,
    layouts, ledger records, plan, annotation, (saved-for-backward bytes, shapes), the
    modules run in the gathered token order)."""
    sharded = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(), example=(args, kwargs),
                            gather_output=True, strict=False, captured=copy.deepcopy(captured),
                            sequence_parallel=sequence_parallel, recompute=recompute)
    loss_of = loss_of or (lambda o: o[1] if isinstance(o, tuple) else o.loss)
    with CommLedger() as ledger:
        out, saved = saved_bytes(lambda: sharded(*args, **kwargs))
        loss = loss_of(out)
        loss.backward()
    logits = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
    grads = {n: p.grad.clone() for n, p in sharded.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    return (logits.detach(), loss.detach(), grads, sharded.layouts, ledger.records,
            sharded.plan, sharded.annotation, saved, stacked_modules(sharded))


def stacked_modules(sharded) -> list[str]:
    """The sequence-parallel modules of ``sharded``'s graph that run in the gathered
    token order (``planner.token_order``)."""
    return [n for n, m in sharded.graph_module.named_modules() if getattr(m, "stacked", False)]


def real_step(ctx, name, args):
    """The bundled model ``name`` built on this rank (as test_sequence_parallel's
    ``_bundled``, biases not zero), one sequence-parallel step: (output,
    loss, grads, layouts, (kind, direction, elements) of each collective, the modules run
    in the gathered token order)."""
    from hf_cases import nonzero_biases
    from shardplan.models import build
    from shardplan.planner.capture import capture
    torch.manual_seed(0)
    model = nonzero_biases(build(name)).eval()
    r = step(ctx, model, args, {}, capture(model, args, {}))
    return (*r[:4], [(c.kind, c.direction, c.elements) for c in r[4]], r[8])


def hf_real_steps(ctx, kinds, b, t):
    """On one real rank, a sequence-parallel step of each tiny Hugging Face model in
    ``kinds``: {kind: (output, loss, grads, layouts, ledger records, plan)}."""
    from hf_cases import build, inputs
    from shardplan.planner.capture import capture
    out = {}
    for kind in kinds:
        model, kw = build(kind, heads=8, kv_heads=4, layers=1), inputs(b, t)
        out[kind] = step(ctx, model, (), kw, capture(model, (), kw))[:6]
    return out


def dropout_step(ctx, recompute: bool):
    """One sequence-parallel step of a dropout GPT (recompute_cases') on this rank:
    (loss, grads, the masks of the dropouts run on this rank's tokens in forward)."""
    import shardplan
    from shardplan.runtime.graph_ops import ModelParallelRNG
    from shardplan.runtime.random import manual_seed, set_rng_tracker
    from recompute_cases import SEED, batch, dropout_gpt
    x, y = batch()
    model = dropout_gpt()
    sharded = shardplan.parallelize(model, group=ctx.group, example_inputs=(x, y),
                                    recompute=recompute, sequence_parallel=True)
    tokens = (x.shape[0], x.shape[1] // ctx.group.size, model.config.n_embd)
    masks = []
    for mod in sharded.graph_module.modules():
        if isinstance(mod, ModelParallelRNG):
            mod.register_forward_hook(lambda m, a, out: masks.append(out == 0)
                                      if tuple(out.shape) == tokens else None)
    manual_seed(SEED, ctx.rank)
    try:
        loss = sharded(x, y)[1]
        drawn = list(masks)
        loss.backward()
    finally:
        set_rng_tracker(None)
    grads = {n: p.grad.clone() for n, p in sharded.named_parameters()}
    return loss.item(), grads, drawn


def dropout_steps(ctx):
    """The dropout step without and with recomputation, on one rank."""
    return dropout_step(ctx, False), dropout_step(ctx, True)


def autocast_step(ctx, model, args, captured, sequence_parallel):
    """One step under CPU bf16 autocast: (loss, the gradients' dtypes)."""
    sharded = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(), example=(args, {}),
                            gather_output=True, strict=False, captured=copy.deepcopy(captured),
                            sequence_parallel=sequence_parallel)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = sharded(*args)[1]
    loss.backward()
    return loss.item(), {p.grad.dtype for p in sharded.parameters()}
