"""A plain Llama style decoder (RMSNorm, RoPE, GQA, SwiGLU), single device."""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._checks import counts, divides, require


@dataclass
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_hidden: int
    n_kv_heads: Optional[int] = None  # None means n_heads (plain multi-head attention)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        counts(self, ("vocab_size", "dim", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"),
               ("n_layers",))
        divides(self, "dim", "n_heads")
        divides(self, "n_heads", "n_kv_heads")
        head_dim = self.dim // self.n_heads
        require(self, head_dim % 2 == 0,
                f"the head dim dim/n_heads = {self.dim}/{self.n_heads} = {head_dim} is odd",
                "rotary embeddings rotate pairs of channels: pick dim and n_heads whose "
                "quotient is even")
        require(self, self.norm_eps > 0 and self.rope_theta > 0,
                f"norm_eps={self.norm_eps} and rope_theta={self.rope_theta} must be > 0",
                "pass positive values, e.g. norm_eps=1e-5, rope_theta=10000.0")


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_cache(head_dim: int, max_seq_len: int, theta: float):
    """cos/sin tables of shape (max_seq_len, head_dim) for the rotate-half RoPE."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """Rotate x of shape (B, T, H, hd) by position; cos/sin broadcast as (1, T, 1, hd)."""
    return (x * cos + rotate_half(x) * sin).type_as(x)


def repeat_kv(x, n_rep: int):
    """(B, T, n_kv, hd) -> (B, T, n_kv * n_rep, hd), each kv head repeated n_rep times."""
    if n_rep == 1:
        return x
    B, T, n_kv, hd = x.shape
    return x[:, :, :, None, :].expand(B, T, n_kv, n_rep, hd).reshape(B, T, n_kv * n_rep, hd)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-RMSNorm block: attention then SwiGLU, each with a residual."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama language model: forward(tokens, targets=None) -> (logits, loss)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rope_cache(config.dim // config.n_heads, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Megatron init: N(0, 0.02), residual output projections N(0, 0.02/sqrt(2L)).

        Nothing to fill on ``meta`` (shapes only), so nothing is done there.
        """
        if self.tok_embeddings.weight.is_meta:
            return
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for layer in self.layers:
            nn.init.normal_(layer.attention.wo.weight, std=std)
            nn.init.normal_(layer.feed_forward.w2.weight, std=std)

    def forward(self, tokens, targets=None):
        T = tokens.size(1)
        cos, sin = self.rope_cos[None, :T, None, :], self.rope_sin[None, :T, None, :]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss
