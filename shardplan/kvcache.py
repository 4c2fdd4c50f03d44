"""Incremental greedy decoding of the bundled GPT with a key/value cache.

``GPTDecodeStep`` wraps a ``GPT`` (sharing its parameters) and holds one K
and one V cache buffer per layer, (batch, heads, max length, head dim). Its
forward takes token ids and their positions as a tensor, writes their keys
and values into the caches at those positions (a 0/1 placement matrix, so
the writes are exact) and attends over the cache, causally masked to the
filled positions. The cache shapes are static: one capture serves the
prompt (prefill) and one every decode position (a single token); both read
the same buffers. Parallelized, the caches are buffers the planner splits
along heads like the k/v projections they meet, so each rank holds only its
own heads.

``decode`` generates greedily with such a step (plain or sharded). Slots
past the current position are masked, so a cache needs no clearing between
calls.
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
        self.batch, self.max_len = batch, max_len or cfg.block_size
        shape = (batch, cfg.n_head, self.max_len, cfg.n_embd // cfg.n_head)
        weight = model.transformer.wte.weight
        for i in range(cfg.n_layer):
            self.register_buffer(f"k_cache_{i}", weight.new_zeros(shape), persistent=False)
            self.register_buffer(f"v_cache_{i}", weight.new_zeros(shape), persistent=False)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits (batch, tokens, vocab) after ``ids`` (batch, tokens) at positions ``pos``
        (tokens,), the earlier positions already in the cache."""
        t = self.model.transformer
        slots = torch.arange(self.max_len, device=ids.device)
        place = (slots[:, None] == pos[None, :]).to(t.wte.weight.dtype)  # slot <- token
        written = place.sum(-1).bool().view(1, 1, -1, 1)
        seen = (slots[None, :] <= pos[:, None]).view(1, 1, len(pos), -1)  # causal over slots
        x = t.wte(ids) + t.wpe(pos)
        for i, block in enumerate(t.h):
            x = x + self._attend(block.attn, block.ln_1(x), i, place, written, seen)
            x = x + block.mlp(block.ln_2(x))
        return self.model.lm_head(t.ln_f(x))

    def _attend(self, attn, x, layer: int, place, written, seen) -> torch.Tensor:
        """Self-attention of the tokens over the cache of ``layer``, after storing their k/v."""
        B, T, C = x.shape
        if attn.fused_qkv:
            q, k, v = attn.c_attn(x).split(C, dim=2)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q, k, v = (z.view(B, T, attn.n_head, C // attn.n_head).transpose(1, 2) for z in (q, k, v))
        k_cache = getattr(self, f"k_cache_{layer}")
        v_cache = getattr(self, f"v_cache_{layer}")
        k_cache.copy_(torch.where(written, torch.einsum("st,bhtd->bhsd", place, k), k_cache))
        v_cache.copy_(torch.where(written, torch.einsum("st,bhtd->bhsd", place, v), v_cache))
        y = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=seen)
        return attn.c_proj(y.transpose(1, 2).reshape(B, T, C))

def decode(step: nn.Module, input_ids: torch.Tensor, *, max_new_tokens: int,
           group: Group | None = None) -> torch.Tensor:
    """``input_ids`` (batch, prompt) followed by ``max_new_tokens`` greedy tokens from
    ``step`` (a ``GPTDecodeStep``, or one parallelized with ``gather_output=True``);
    ``group``: the ranks that must agree on every token (rank 0 picks, as ``generate``)."""
    batch, prompt = input_ids.shape
    cache = getattr(step, "source", step)
    if batch != cache.batch or prompt == 0 or prompt + max_new_tokens > cache.max_len:
        raise ConfigurationError(
            f"{batch} prompts of {prompt} tokens and {max_new_tokens} new ones do not fit a "
            f"cache of {cache.batch} sequences of {cache.max_len} positions",
            fix="pass non-empty prompts, as many as the cache's batch, and a larger max_len")
    ids = input_ids
    with torch.no_grad():
        logits = step(ids, torch.arange(prompt, device=ids.device))  # prefill
        for pos in range(prompt, prompt + max_new_tokens):
            token = _pick(logits[:, -1].float(), False, {}, None, group)
            ids = torch.cat([ids, token[:, None]], 1)
            if pos < prompt + max_new_tokens - 1:
                logits = step(token[:, None], torch.tensor([pos], device=ids.device))
    return ids
