"""Small models of ops over a split dim, run the same way on simulated and real ranks:
ops with no rule over a split dim (a sort over a wide projection's features: the planner
weighs gathering the shard there) and reductions written out to run distributed
(variance, standard deviation, F.normalize, a LayerNorm over two trailing dims, a max
whose gradient is needed, with ties), and GroupNorm over channels split by whole groups."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardplan
from shardplan.runtime.ledger import CommLedger

REDUCTIONS = ["var", "std", "normalize", "layer_norm_2d", "amax", "amax_ties"]


class SparseCoder(nn.Module):
    """A top-k sparse autoencoder (OpenAI's TopK SAE): a wide encoder, the k largest
    latents of each token kept (a descending ``sort`` over the encoder's features, its
    first k, scattered into zeros), a decoder back. The sort has no rule over the split
    features (a fallback; ``topk`` itself is a reduction, where Megatron's answer, an
    MoE router kept whole, stands)."""

    def __init__(self, dim: int = 16, latents: int = 256, k: int = 8):
        super().__init__()
        self.k, self.latents = k, latents
        self.enc, self.dec = nn.Linear(dim, latents), nn.Linear(latents, dim)

    def forward(self, x):
        vals, idx = self.enc(x).sort(-1, descending=True)
        vals, idx = vals[..., :self.k], idx[..., :self.k]
        sparse = torch.zeros(*x.shape[:-1], self.latents).scatter(-1, idx, F.relu(vals))
        return self.dec(sparse)


class ReducedMLP(nn.Module):
    """up -> an op over the (split) hidden dim -> down (``kind`` in REDUCTIONS, or
    "group_norm" with ``groups`` groups over the hidden channels)."""

    def __init__(self, kind: str, dim: int = 32, hidden: int = 64, groups: int = 4):
        super().__init__()
        self.kind = kind
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.norm = nn.GroupNorm(groups, hidden) if kind == "group_norm" else None
        if self.norm is not None:
            with torch.no_grad():
                self.norm.weight.uniform_(0.5, 1.5)
                self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        h, kind = self.up(x), self.kind
        if kind == "var":  # unbiased (correction 1)
            h = h / (h.var(-1, keepdim=True) + 1)
        elif kind == "std":
            h = (h - h.mean(-1, keepdim=True)) / (h.std(-1, correction=0, keepdim=True) + 1e-3)
        elif kind == "normalize":
            h = F.normalize(h, dim=-1)
        elif kind == "layer_norm_2d":  # normalized over (4 groups, hidden / 4)
            h = F.layer_norm(h.unflatten(-1, (4, -1)), (4, h.shape[-1] // 4)).flatten(-2)
        elif kind == "amax":
            h = h - h.amax(-1, keepdim=True)
        elif kind == "amax_ties":  # many features tie at the clamp, on every rank
            h = h.clamp(max=0.2)
            h = h * h.amax(-1, keepdim=True)
        elif kind == "group_norm":
            h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return self.down(h)


def build(name: str, **kw) -> nn.Module:
    torch.manual_seed(0)
    return SparseCoder(**kw) if name == "sparse_coder" else ReducedMLP(name, **kw)


def example(tokens: int = 6, dim: int = 32, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, tokens, dim, generator=torch.Generator().manual_seed(1))


def reference(model: nn.Module, x: torch.Tensor):
    ref = copy.deepcopy(model)
    out = ref(x)
    loss = out.pow(2).mean()
    loss.backward()
    return out.detach(), loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def step(ctx, model: nn.Module, x: torch.Tensor):
    """One forward/backward of (a copy of) ``model`` on this rank: (output, loss, grads,
    layouts, ledger records, plan)."""
    sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=(x,))
    with CommLedger() as ledger:
        out = sharded(x)
        loss = out.pow(2).mean()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in sharded.named_parameters() if p.grad is not None}
    return out.detach(), loss.detach(), grads, sharded.layouts, ledger.records, sharded.plan
