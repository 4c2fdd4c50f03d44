"""Tiny Hugging Face models whose q/k need interleaved or partial rotary (GPT-J, Cohere,
GLM, Helium) or a norm over all heads (OLMo2), and small models of those patterns."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hf_cases import VOCAB, step

FAMILIES = ["gptj", "cohere", "glm", "helium", "olmo2"]


def build_hf(kind: str, heads: int = 4, kv_heads: int | None = None):
    """One layer, hidden 64, ``heads`` heads of 16 (``kv_heads`` K/V heads: as many)."""
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    llama_like = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=heads,
                      num_key_value_heads=kv_heads or heads, intermediate_size=96,
                      max_position_embeddings=64, **common)
    if kind == "gptj":  # partial (rotary_dim 8 of 16), interleaved rotary
        model = tf.GPTJForCausalLM(tf.GPTJConfig(n_layer=1, n_embd=64, n_head=heads,
                                                 rotary_dim=8, n_positions=32, **common))
    elif kind == "cohere":  # interleaved rotary, tied head
        model = tf.CohereForCausalLM(tf.CohereConfig(**llama_like))
    elif kind == "glm":  # partial, interleaved rotary
        model = tf.GlmForCausalLM(tf.GlmConfig(head_dim=16, **llama_like))
    elif kind == "helium":  # interleaved rotary
        model = tf.HeliumForCausalLM(tf.HeliumConfig(head_dim=16, **llama_like))
    else:  # olmo2: RMSNorm of q and k over all heads
        model = tf.Olmo2ForCausalLM(tf.Olmo2Config(**llama_like))
    model.config._attn_implementation = "sdpa"
    model.config.use_cache = False
    return model.eval()


def attention_weights(model) -> dict[str, str]:
    """Parameter name -> the role of each q/k/v/o projection of layer 0."""
    out = {}
    for name, _ in model.named_parameters():
        leaf = name.rsplit(".", 2)[-2]
        if ".0." in name and name.endswith("weight") and leaf in (
                "q_proj", "k_proj", "v_proj", "o_proj", "out_proj"):
            out[name] = "row" if leaf in ("o_proj", "out_proj") else "column"
    return out


def real_step(ctx, kind, kw):
    return step(ctx, build_hf(kind), kw)


# --------------------------------------------------------------------------- small patterns

class RMSNormOverAll(nn.Module):
    """OLMo2's q/k norm: the mean of squares over the whole (all heads) width."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def rotate_every_two(x):
    """GPT-J's interleaved rotation: (a, b) pairs -> (-b, a), via stack and flatten."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class Attention(nn.Module):
    """q, k, v, o over ``heads`` heads of 8; ``rotary``: "interleaved" (partial: the first
    4 of each head rotated with stack/flatten, the rest passed), "complex" (unbind pairs,
    ``polar`` angles, ``view_as_complex``) or "none"; ``qk_norm``: a norm over all heads."""

    def __init__(self, rotary: str = "none", qk_norm: bool = False, dim: int = 32,
                 heads: int = 4):
        super().__init__()
        self.rotary, self.heads, self.hd = rotary, heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.q_norm = RMSNormOverAll(dim) if qk_norm else nn.Identity()
        self.k_norm = RMSNormOverAll(dim) if qk_norm else nn.Identity()
        self.register_buffer("angles", torch.outer(torch.arange(16.0), torch.tensor([1.0, 0.1])))

    def _rotate(self, x):  # [B, T, H, hd]
        t = x.shape[1]
        if self.rotary == "interleaved":
            rot, rest = x[..., :4], x[..., 4:]
            cos, sin = (f(self.angles[:t]).repeat_interleave(2, -1)[None, :, None] for f in
                        (torch.cos, torch.sin))
            return torch.cat([rot * cos + rotate_every_two(rot) * sin, rest], dim=-1)
        if self.rotary == "complex":
            pairs = torch.stack(x.float().unflatten(-1, (-1, 2)).unbind(-1), -1)
            z = torch.view_as_complex(pairs.contiguous())
            a = self.angles[:t].repeat(1, self.hd // 4)
            turned = z * torch.polar(torch.ones_like(a), a)[None, :, None]
            return torch.view_as_real(turned).flatten(-2).type_as(x)
        return x

    def forward(self, x):
        B, T, C = x.shape
        q, k = self.q_norm(self.q(x)), self.k_norm(self.k(x))
        q, k, v = (t.view(B, T, self.heads, self.hd) for t in (q, k, self.v(x)))
        q, k = self._rotate(q), self._rotate(k)
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class NormedMLP(nn.Module):
    """up -> ``norm`` over the (split) hidden dim -> down: a LayerNorm or RMSNorm module,
    the fused ATen op that the planner writes out to run it distributed."""

    def __init__(self, norm: str, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(hidden) if norm == "layer" else nn.RMSNorm(hidden)
        with torch.no_grad():
            for p in self.norm.parameters():
                p.uniform_(0.5, 1.5)

    def forward(self, x):
        return self.down(self.norm(F.gelu(self.up(x))))


class SoftmaxMLP(nn.Module):
    """up -> softmax, log-softmax, logsumexp or a max subtracted, over the split hidden
    dim -> down."""

    def __init__(self, kind: str, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.kind = kind
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.up(x)
        if self.kind == "softmax":
            h = h.softmax(-1) * 8
        elif self.kind == "log_softmax":
            h = F.log_softmax(h, -1)
        elif self.kind == "logsumexp":
            h = h - torch.logsumexp(h, -1, keepdim=True)
        else:  # a max that needs its gradient
            h = h - h.amax(-1, keepdim=True)
        return self.down(h)


class CenteredMLP(nn.Module):
    """up -> subtract the mean over the (split) hidden dim, scale by its sum -> down."""

    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = F.gelu(self.up(x))
        h = h - h.mean(-1, keepdim=True)
        return self.down(h * torch.sigmoid(h.sum(-1, keepdim=True)))


class SharedRotaryKey(nn.Module):
    """DeepSeek's multi-head latent attention key: each head's own part (``k``) joined by
    one rotary part shared by all heads (4 dims of the input scaled by ``k_rope``, kept
    whole, rotated, then expanded to every head)."""

    def __init__(self, dim: int = 32, heads: int = 4, rope: int = 4):
        super().__init__()
        self.heads, self.hd, self.rope = heads, dim // heads, rope
        self.q, self.v = (nn.Linear(dim, heads * (self.hd + rope), bias=False) for _ in range(2))
        self.k = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(heads * (self.hd + rope), dim, bias=False)
        self.k_rope = nn.Parameter(torch.rand(rope) + 0.5)
        self.register_buffer("angles", torch.outer(torch.arange(16.0), torch.tensor([1.0, 0.1])))

    def forward(self, x):
        B, T, C = x.shape
        q, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (self.q(x), self.v(x)))
        k = self.k(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        r = (x[..., :self.rope] * self.k_rope)[:, None]  # [B, 1, T, rope]
        cos, sin = (f(self.angles[:T]).repeat(1, 2) for f in (torch.cos, torch.sin))
        r = r * cos + torch.cat([-r[..., 2:], r[..., :2]], -1) * sin
        k = torch.cat([k, r.expand(B, self.heads, T, self.rope)], -1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))
