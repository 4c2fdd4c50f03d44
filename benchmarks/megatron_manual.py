"""A hand-written Megatron-LM tensor-parallel copy of the bundled GPT: the floor.

What a code-generating planner should reach: plain tensors, plain
``torch.distributed`` collectives issued in place (no copies, no ledger, no
call-site lookup), and exactly Megatron's communication:

    forward   1 all-reduce after the vocab-parallel embedding lookup        (b·s·h)
              per layer: g after the attention output projection (b·s·h)
                         g after the MLP output projection        (b·s·h)
              3 all-reduces in the vocab-parallel cross-entropy   (b·s each)
    backward  per layer: f before q/k/v (one, shared) and before the MLP (b·s·h)
              f before the (tied) LM head                          (b·s·h)

``ManualGPT(gpt, pg)`` copies this rank's shards out of a
``shardplan.models.GPT`` (fused or separate q/k/v, tied or untied head), so
every contender starts from the same weights; ``forward(idx, targets)``
returns ``(local logits (b, s, V/tp), loss)``. The vocabulary must divide by
tp (the floor does not pad). Dropout is taken as 0 (the benchmarks use 0).

Used by ``benchmarks.step_time`` and ``benchmarks.comm_volume``; not a part
of shardplan.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ManualGPT", "megatron_optimum"]


class _F(torch.autograd.Function):
    """Megatron's f: identity forward, in-place all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.pg)
        return grad, None


class _G(torch.autograd.Function):
    """Megatron's g: in-place all-reduce forward (on a fresh GEMM output), identity backward."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=pg)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy from this rank's vocabulary slice (Megatron's):
    all-reduce the max, the target logit and the sum of exponentials; no backward comms."""

    @staticmethod
    def forward(ctx, logits, target, start, pg):
        end = start + logits.shape[-1]
        lmax = logits.max(-1).values
        dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=pg)
        shifted = logits - lmax.unsqueeze(-1)
        outside = (target < start) | (target >= end)
        idx = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(picked, group=pg)
        probs = shifted.exp_()
        sumexp = probs.sum(-1)
        dist.all_reduce(sumexp, group=pg)
        probs.div_(sumexp.unsqueeze(-1))
        ctx.save_for_backward(probs, idx, outside)
        return sumexp.log_() - picked

    @staticmethod
    def backward(ctx, grad):
        probs, idx, outside = ctx.saved_tensors
        g = probs  # used once: modified in place, as Megatron does
        g.scatter_add_(-1, idx.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        g.mul_(grad.unsqueeze(-1))
        return g, None, None, None


def _shard(t: torch.Tensor, dim: int, rank: int, tp: int) -> nn.Parameter:
    return nn.Parameter(t.detach().chunk(tp, dim)[rank].clone())


class _Block(nn.Module):
    def __init__(self, block, rank: int, tp: int, pg):
        super().__init__()
        attn, mlp = block.attn, block.mlp
        self.pg, self.n_head = pg, attn.n_head // tp
        self.hd = attn.n_embd // attn.n_head
        self.ln_1, self.ln_2 = copy.deepcopy(block.ln_1), copy.deepcopy(block.ln_2)
        C = attn.n_embd
        if attn.fused_qkv:  # this rank's heads of q, k and v, as three column shards
            ws = attn.c_attn.weight.split(C, 0)
            bs = attn.c_attn.bias.split(C, 0) if attn.c_attn.bias is not None else (None,) * 3
        else:
            ws = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
            bs = (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)
        self.wq, self.wk, self.wv = (_shard(w, 0, rank, tp) for w in ws)
        self.bq, self.bk, self.bv = (None if b is None else _shard(b, 0, rank, tp) for b in bs)
        self.w_o = _shard(attn.c_proj.weight, 1, rank, tp)
        self.b_o = None if attn.c_proj.bias is None else nn.Parameter(attn.c_proj.bias.detach().clone())
        self.w_fc = _shard(mlp.c_fc.weight, 0, rank, tp)
        self.b_fc = None if mlp.c_fc.bias is None else _shard(mlp.c_fc.bias, 0, rank, tp)
        self.w_p = _shard(mlp.c_proj.weight, 1, rank, tp)
        self.b_p = None if mlp.c_proj.bias is None else nn.Parameter(mlp.c_proj.bias.detach().clone())
        self.gelu_approx = mlp.gelu.approximate

    def forward(self, x):
        B, T, _ = x.shape
        h = _F.apply(self.ln_1(x), self.pg)  # one f for q, k and v
        q, k, v = (F.linear(h, w, b).view(B, T, self.n_head, self.hd).transpose(1, 2)
                   for w, b in ((self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = _G.apply(F.linear(y.transpose(1, 2).reshape(B, T, -1), self.w_o), self.pg)
        x = x + (y if self.b_o is None else y + self.b_o)
        h = _F.apply(self.ln_2(x), self.pg)
        h = F.gelu(F.linear(h, self.w_fc, self.b_fc), approximate=self.gelu_approx)
        y = _G.apply(F.linear(h, self.w_p), self.pg)
        return x + (y if self.b_p is None else y + self.b_p)


class ManualGPT(nn.Module):
    """This rank's Megatron shard of a ``shardplan.models.GPT`` (see the module docstring)."""

    def __init__(self, gpt, pg=None):
        super().__init__()
        self.pg = pg
        rank, tp = dist.get_rank(pg), dist.get_world_size(pg)
        cfg = gpt.config
        if cfg.vocab_size % tp or cfg.n_head % tp:
            raise ValueError(f"ManualGPT needs vocab ({cfg.vocab_size}) and heads ({cfg.n_head}) "
                             f"divisible by tp={tp}")
        if cfg.dropout:
            raise ValueError("ManualGPT implements dropout=0 only")
        self.vocab = cfg.vocab_size
        self.start = rank * cfg.vocab_size // tp
        t = gpt.transformer
        self.wte = _shard(t.wte.weight, 0, rank, tp)
        self.lm_head = self.wte if cfg.tie_weights else _shard(gpt.lm_head.weight, 0, rank, tp)
        self.wpe = nn.Parameter(t.wpe.weight.detach().clone())
        self.h = nn.ModuleList(_Block(b, rank, tp, pg) for b in t.h)
        self.ln_f = copy.deepcopy(t.ln_f)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        outside = (idx < self.start) | (idx >= self.start + self.wte.shape[0])
        rows = F.embedding((idx - self.start).masked_fill(outside, 0), self.wte)
        x = _G.apply(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.pg)
        x = x + self.wpe[:T]
        for block in self.h:
            x = block(x)
        h = _F.apply(self.ln_f(x), self.pg)
        logits = F.linear(h, self.lm_head)  # (B, T, V/tp): this rank's vocabulary slice
        loss = None
        if targets is not None:
            t = targets.reshape(-1)
            per_token = _VocabParallelCE.apply(logits.reshape(B * T, -1), t, self.start, self.pg)
            keep = t != -1  # the bundled GPT's ignore_index
            loss = per_token.masked_fill(~keep, 0.0).sum() / keep.sum()
        return logits, loss


def megatron_optimum(n_layers: int, b: int, s: int, h: int) -> dict:
    """Megatron's per-step communication for a decoder with a vocab-parallel embedding,
    LM head and loss: ``{direction: [(kind, elements), ...]}`` (bytes: elements times the
    element size)."""
    return {
        "forward": [("all_reduce", b * s * h)] * (2 * n_layers + 1) + [("all_reduce", b * s)] * 3,
        "backward": [("all_reduce", b * s * h)] * (2 * n_layers + 1),
    }
