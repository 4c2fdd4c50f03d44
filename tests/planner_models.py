"""Small models that exercise planner rules the bundled GPT and Llama do not."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-norm block: attention with optional twists, then an MLP with optional twists."""

    def __init__(self, dim=32, heads=4, kv_heads=2, qk_norm=False, alibi=False, mlp_op=None):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wqkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.hd)  # fused, GQA
        self.wo = nn.Linear(heads * self.hd, dim)
        self.fc, self.proj = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.q_norm = nn.RMSNorm(self.hd) if qk_norm else None
        self.head_bias = nn.Parameter(torch.randn(heads) * 0.1) if alibi else None
        self.mlp_op = mlp_op

    def attention(self, x):
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).split(
            [self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], dim=-1)
        q = q.view(B, T, self.heads, self.hd)
        if self.q_norm is not None:
            q = self.q_norm(q)  # per-head norm: a replicated weight inside the region
        k = k.view(B, T, self.kv_heads, 1, self.hd).expand(
            B, T, self.kv_heads, self.heads // self.kv_heads, self.hd).reshape(B, T, self.heads, self.hd)
        v = v.view(B, T, self.kv_heads, 1, self.hd).expand(
            B, T, self.kv_heads, self.heads // self.kv_heads, self.hd).reshape(B, T, self.heads, self.hd)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / self.hd ** 0.5
        if self.head_bias is not None:  # per-head constants: computed slopes and a learned bias
            slopes = torch.arange(1, self.heads + 1, dtype=x.dtype, device=x.device) / self.heads
            dist = torch.arange(T, device=x.device)[None, :] - torch.arange(T, device=x.device)[:, None]
            scores = scores + (slopes[:, None, None] + self.head_bias[:, None, None]) * dist
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, self.heads * self.hd)
        return self.wo(y)

    def mlp(self, x):
        h = F.gelu(self.fc(x))
        if self.mlp_op == "cumsum":
            h = torch.cumsum(h, dim=-1)  # no rule: not local on a split hidden dim
        elif self.mlp_op == "softmax":
            h = h.softmax(-1)  # a reduction across the split hidden dim
        elif self.mlp_op == "softmax+cumsum":
            h = h.softmax(-1) + torch.cumsum(h, dim=-1)  # both, on branches of one region
        return self.proj(h)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, dim=32, layers=2, **block):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, **block) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class MaskedSDPA(nn.Module):
    """SDPA with an additive mask passed in, of any shape that broadcasts to [B, H, T, T]."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim) for _ in range(3))
        self.wo = nn.Linear(dim, dim)

    def forward(self, x, mask):
        B, T, D = x.shape
        q, k, v = (w(x).view(B, T, self.heads, self.hd).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, D))


class GroupedSDPA(nn.Module):
    """SDPA's own grouped-query attention: 4 query heads, 2 K/V heads (enable_gqa).
    K/V are projected (sharded with the queries) or taken from the input (replicated)."""

    def __init__(self, project_kv=True):
        super().__init__()
        self.wq, self.wo = nn.Linear(16, 16), nn.Linear(16, 16)
        self.wkv = nn.Linear(16, 16) if project_kv else None

    def forward(self, x):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, 4, 4).transpose(1, 2)
        kv = self.wkv(x) if self.wkv is not None else x
        k, v = kv.view(B, T, 2, 8).transpose(1, 2).split(4, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, 16))


class DataDependent(nn.Module):
    """Python control flow on a tensor value: not capturable."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, idx):
        x = self.embed(idx)
        if x.sum() > 0:
            x = self.fc(x)
        return x


class NoTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))
