"""Incremental greedy decoding of the bundled GPT with a key/value cache.

``GPTDecodeStep`` wraps a ``GPT`` (sharing its parameters) and holds one K
and one V cache buffer per layer, (batch, heads, max length, head dim). Its
forward takes the ids of one new token per sequence and that token's
position as a tensor, writes the token's keys and values into the caches at
that position and attends over the cache, masked to the filled positions.
Every shape is static, so one capture serves every position; parallelized,
the caches are buffers the planner splits along heads like the k/v
projections they meet, so each rank holds only its own heads.

``decode`` generates greedily with such a step (plain or sharded): the
prompt is fed one token at a time (prefill fills the cache through the same
step and capture), then each new token. Slots past the current position are
masked, so a cache needs no clearing between calls.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import ConfigurationError
from .generate import _pick
from .models.gpt import GPT
from .runtime.comm import Group


class GPTDecodeStep(nn.Module):
    """One decode step of ``model`` for ``batch`` sequences of up to ``max_len`` tokens."""

    def __init__(self, model: GPT, batch: int, max_len: int | None = None):
        super().__init__()
        cfg = model.config
        self.model = model
        self.max_len = max_len or cfg.block_size
        shape = (batch, cfg.n_head, self.max_len, cfg.n_embd // cfg.n_head)
        weight = model.transformer.wte.weight
        for i in range(cfg.n_layer):
            self.register_buffer(f"k_cache_{i}", weight.new_zeros(shape), persistent=False)
            self.register_buffer(f"v_cache_{i}", weight.new_zeros(shape), persistent=False)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits (batch, 1, vocab) of the token after ``ids`` (batch, 1) at ``pos`` (1,)."""
        t = self.model.transformer
        slots = torch.arange(self.max_len, device=ids.device)
        write = (slots == pos).view(1, 1, -1, 1)  # the slot this token fills
        seen = (slots <= pos).view(1, 1, 1, -1)  # the slots it attends to
        x = t.wte(ids) + t.wpe(pos)
        for i, block in enumerate(t.h):
            x = x + self._attend(block.attn, block.ln_1(x), i, write, seen)
            x = x + block.mlp(block.ln_2(x))
        return self.model.lm_head(t.ln_f(x))

    def _attend(self, attn, x, layer: int, write, seen) -> torch.Tensor:
        """Self-attention of one token over the cache of ``layer``, after storing its k/v."""
        B, T, C = x.shape
        if attn.fused_qkv:
            q, k, v = attn.c_attn(x).split(C, dim=2)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q, k, v = (z.view(B, T, attn.n_head, C // attn.n_head).transpose(1, 2) for z in (q, k, v))
        k_cache = getattr(self, f"k_cache_{layer}")
        v_cache = getattr(self, f"v_cache_{layer}")
        k_cache.copy_(torch.where(write, k, k_cache))
        v_cache.copy_(torch.where(write, v, v_cache))
        y = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=seen)
        return attn.c_proj(y.transpose(1, 2).reshape(B, T, C))


def decode(step: nn.Module, input_ids: torch.Tensor, *, max_new_tokens: int,
           group: Group | None = None) -> torch.Tensor:
    """``input_ids`` (batch, prompt) followed by ``max_new_tokens`` greedy tokens from
    ``step`` (a ``GPTDecodeStep``, or one parallelized with ``gather_output=True``);
    ``group``: the ranks that must agree on every token (rank 0 picks, as ``generate``)."""
    batch, prompt = input_ids.shape
    cache = getattr(step, "source", step).max_len
    if prompt == 0 or prompt + max_new_tokens > cache:
        raise ConfigurationError(
            f"a prompt of {prompt} tokens and {max_new_tokens} new ones do not fit a cache of "
            f"{cache} positions", fix="pass a non-empty prompt and a larger max_len")
    ids = input_ids
    with torch.no_grad():
        for pos in range(prompt + max_new_tokens - 1):
            logits = step(ids[:, pos:pos + 1], torch.tensor([pos], device=ids.device))
            if pos >= prompt - 1:
                token = _pick(logits[:, -1].float(), False, {}, None, group)
                ids = torch.cat([ids, token[:, None]], 1)
    return ids
