"""Decode steps: a causal LM with a static key/value cache, one module per model family.

``decode_step(model, batch, max_len)`` wraps ``model`` (sharing its
parameters) in a module holding one K and one V cache buffer per layer,
(batch, K/V heads, max_len, head dim), whose forward is

    step(input_ids, position_ids, cache_position, attention_mask) -> logits

``input_ids``/``position_ids`` (batch, tokens) are the new tokens and their
positions in their sequence (left padding counts none), ``cache_position``
(tokens,) the cache slots they are written to, ``attention_mask`` (batch,
max_len) 1 for every slot holding (or about to hold) a real token. The
writes are exact (a 0/1 placement matrix, ``where`` + ``copy_``, both ordinary
rules of the planner), and each token attends to the filled, unpadded slots
up to its own. The cache shapes are static and the token count is
symbolic, so a parallelized step captures once (``sharded.parallel_step``): the
prompt's graph also runs every later single token. The planner splits the caches along heads like the
k/v projections they meet: each rank holds its own K/V heads, and K/V heads
shared by a group of ranks (fewer K/V heads than tp) once per rank. A sharded
model's steps (``DecodeSteps``, its ``decode_step``) keep its plan and read its
own shards.

Families: the bundled ``GPT`` and ``Llama``, and Hugging Face causal LMs
that declare static-cache support (``_can_compile_fullgraph``: GPT-2, Llama,
Mistral, Qwen2, OPT, Gemma, ...), driven through their own code with
this module's cache object and a 4-D mask. Anything else raises
``UnsupportedDecode`` with the reason (``generate`` then recomputes the prefix).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Generic, TypeVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import ConfigurationError, UnsupportedDecode
from .layouts import set_spec, spec_of
from .models.gpt import GPT
from .models.llama import Llama, apply_rope, repeat_kv
from .planner.capture import PLANNING_LOCK


def decode_step(model: nn.Module, batch: int, max_len: int) -> "DecodeStep":
    """The decode step of ``model`` for ``batch`` sequences of up to ``max_len`` tokens."""
    if isinstance(model, GPT):
        return GPTDecodeStep(model, batch, max_len)
    if isinstance(model, Llama):
        return LlamaDecodeStep(model, batch, max_len)
    return HFDecodeStep(model, batch, max_len)


def cache_length(model: nn.Module, needed: int) -> int:
    """Slots for ``needed`` positions, rounded up to a power of two (at least 16) so that
    generations of similar lengths share one step, but no further than the model's
    own limit on positions."""
    length = max(16, 1 << (needed - 1).bit_length())
    cfg = getattr(model, "config", None)
    for name in ("block_size", "max_seq_len", "max_position_embeddings", "n_positions"):
        limit = getattr(cfg, name, None)
        if isinstance(limit, int) and limit >= needed:
            return min(length, limit)
    return length


M = TypeVar("M", bound=nn.Module)


class DecodeSteps(Generic[M]):
    """A sharded model's parallelized decode steps, one per (batch, max_len), made on first
    use: each keeps replicated what the model's plan does and reads the model's own shards
    (not copies)."""

    def __init__(self, parallelize: Callable[..., M]):
        #: ``parallelize(step, captured=, keep=)``: a step parallelized as the model was
        #: (``sharded.parallel_step``)
        self._parallelize = parallelize
        self._steps: dict[tuple[int, int], M] = {}

    def get(self, model: nn.Module, batch: int, max_len: int, captured=None) -> M:
        """The step of ``model`` (a ``ShardedModule``) for ``batch`` sequences of up to
        ``max_len`` tokens; raises ``UnsupportedDecode`` where the model has none.
        ``captured``: the step's capture, if made already (``capture(step, step.example(2))``)."""
        key = (batch, max_len)
        if key not in self._steps:
            keep = {"model." + fqn: lay for fqn, lay in model.layouts.items()}
            with PLANNING_LOCK:
                step = decode_step(model.source, batch, max_len)
            sharded = self._parallelize(step, captured=captured, keep=keep)
            _adopt(sharded, model, prefix="model.")
            self._steps[key] = sharded
        return self._steps[key]

    def clear(self) -> None:
        """Forget every step: they read tensors the model no longer holds."""
        self._steps.clear()


def _adopt(step: nn.Module, model: nn.Module, prefix: str) -> None:
    """The parallelized ``step`` reads ``model``'s tensors (the step's FQN = ``prefix`` +
    theirs) in place of its copies of them; caches still on ``meta`` become zeros on
    ``model``'s device. A tensor the step splits otherwise is ``UnsupportedDecode``."""
    theirs, device = model.rank_tensors, model.device
    adopted = {}
    for fqn, mine in step.rank_tensors.items():
        same = theirs.get(fqn.removeprefix(prefix)) if fqn.startswith(prefix) else None
        if same is None:
            if mine.is_meta:
                zeros = torch.zeros(mine.shape, dtype=mine.dtype, device=device)
                adopted[fqn] = set_spec(zeros, spec_of(mine))
            continue
        if spec_of(same) != spec_of(mine) or same.shape != mine.shape:
            raise UnsupportedDecode(
                f"the decode step splits {fqn.removeprefix(prefix)} as "
                f"{spec_of(mine).layout} but the model as {spec_of(same).layout}")
        adopted[fqn] = same
    step.share_tensors_(adopted)


def placement(cache_position: torch.Tensor, max_len: int, dtype: torch.dtype):
    """(slots x tokens) 0/1 matrix putting token t in slot ``cache_position[t]``, and
    which slots are written, broadcastable over (batch, heads, slots, dim)."""
    slots = torch.arange(max_len, device=cache_position.device)
    place = (slots[:, None] == cache_position[None, :]).to(dtype)
    return place, place.sum(-1).bool().view(1, 1, -1, 1)


def write(cache: torch.Tensor, new: torch.Tensor, place, written) -> torch.Tensor:
    """Store ``new`` (batch, heads, tokens, dim) in its slots of ``cache``, in place."""
    cache.copy_(torch.where(written, torch.einsum("st,bhtd->bhsd", place, new), cache))
    return cache


def visible(cache_position: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(batch, 1, tokens, slots) bool: a token sees the real tokens up to its own slot,
    and always itself (a padding token's row is never empty, so it stays finite)."""
    slots = torch.arange(attention_mask.shape[-1], device=cache_position.device)
    causal = slots[None, :] <= cache_position[:, None]
    own = slots[None, :] == cache_position[:, None]
    return ((causal[None] & attention_mask[:, None, :].bool()) | own[None]).unsqueeze(1)


class DecodeStep(nn.Module):
    """A model and its K/V caches (buffers ``k_cache_{i}``, ``v_cache_{i}``)."""

    def __init__(self, model: nn.Module, batch: int, max_len: int, shapes: list[tuple],
                 like: torch.Tensor):
        super().__init__()
        if batch < 1 or max_len < 1:
            raise ConfigurationError(f"a cache of {batch} sequences of {max_len} positions",
                                     fix="pass batch >= 1 and max_len >= 1")
        self.model, self.batch, self.max_len = model, batch, max_len
        self.training = model.training  # the model's mode (dropout) is the step's
        for i, (heads, dim) in enumerate(shapes):
            shape = (batch, heads, max_len, dim)
            self.register_buffer(f"k_cache_{i}", like.new_zeros(shape), persistent=False)
            self.register_buffer(f"v_cache_{i}", like.new_zeros(shape), persistent=False)

    def example(self, tokens: int, device=None) -> tuple:
        """Inputs of a call on ``tokens`` new tokens per sequence (on the model's device)."""
        device = device or next(self.model.parameters()).device
        ids = torch.zeros(self.batch, tokens, dtype=torch.long, device=device)
        return (ids, ids.clone(), torch.arange(tokens, device=device),
                torch.ones(self.batch, self.max_len, dtype=torch.long, device=device))

    def release_caches(self) -> None:
        """Keep the full-size caches as shapes only (``meta``): once parallelized, each rank
        runs on its own shards of them (``sharded.parallel_step``)."""
        for name, buf in list(self.named_buffers()):
            if name.startswith(("k_cache_", "v_cache_")):
                self.register_buffer(name, buf.to("meta"), persistent=False)

    def caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"k_cache_{layer}"), getattr(self, f"v_cache_{layer}")


class GPTDecodeStep(DecodeStep):
    """The bundled ``GPT`` (learned positions, multi-head attention)."""

    def __init__(self, model: GPT, batch: int, max_len: int | None = None):
        cfg = model.config
        super().__init__(model, batch, max_len or cfg.block_size,
                         [(cfg.n_head, cfg.n_embd // cfg.n_head)] * cfg.n_layer,
                         model.transformer.wte.weight)

    def forward(self, input_ids, position_ids, cache_position, attention_mask):
        t = self.model.transformer
        place, written = placement(cache_position, self.max_len, t.wte.weight.dtype)
        seen = visible(cache_position, attention_mask)
        x = t.wte(input_ids) + t.wpe(position_ids)
        for i, block in enumerate(t.h):
            x = x + self._attend(block.attn, block.ln_1(x), i, place, written, seen)
            x = x + block.mlp(block.ln_2(x))
        return self.model.lm_head(t.ln_f(x))

    def _attend(self, attn, x, layer: int, place, written, seen) -> torch.Tensor:
        B, T, C = x.shape
        if attn.fused_qkv:
            q, k, v = attn.c_attn(x).split(C, dim=2)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q, k, v = (z.view(B, T, attn.n_head, C // attn.n_head).transpose(1, 2) for z in (q, k, v))
        k_cache, v_cache = self.caches(layer)
        k, v = write(k_cache, k, place, written), write(v_cache, v, place, written)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen)
        return attn.c_proj(y.transpose(1, 2).reshape(B, T, C))


class LlamaDecodeStep(DecodeStep):
    """The bundled ``Llama`` (RoPE, grouped-query attention: caches hold K/V heads)."""

    def __init__(self, model: Llama, batch: int, max_len: int | None = None):
        cfg = model.config
        super().__init__(model, batch, max_len or cfg.max_seq_len,
                         [(cfg.n_kv_heads, cfg.dim // cfg.n_heads)] * cfg.n_layers,
                         model.tok_embeddings.weight)

    def forward(self, input_ids, position_ids, cache_position, attention_mask):
        m = self.model
        place, written = placement(cache_position, self.max_len, m.tok_embeddings.weight.dtype)
        seen = visible(cache_position, attention_mask)
        # the rows of the RoPE tables at each token's position, by a 0/1 matrix (exact)
        rows = F.one_hot(position_ids, m.rope_cos.shape[0]).to(m.rope_cos.dtype)
        cos, sin = (rows @ table for table in (m.rope_cos, m.rope_sin))
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        h = m.tok_embeddings(input_ids)
        for i, layer in enumerate(m.layers):
            h = h + self._attend(layer.attention, layer.attention_norm(h), i, cos, sin,
                                 place, written, seen)
            h = h + layer.feed_forward(layer.ffn_norm(h))
        return m.output(m.norm(h))

    def _attend(self, attn, x, layer: int, cos, sin, place, written, seen) -> torch.Tensor:
        B, T, _ = x.shape
        q = attn.wq(x).view(B, T, attn.n_heads, attn.head_dim)
        k = attn.wk(x).view(B, T, attn.n_kv_heads, attn.head_dim)
        v = attn.wv(x).view(B, T, attn.n_kv_heads, attn.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = self.caches(layer)
        k = write(k_cache, k.transpose(1, 2), place, written)
        v = write(v_cache, v.transpose(1, 2), place, written)
        n_rep = attn.n_heads // attn.n_kv_heads
        # repeat_kv works on (B, T, H, D): the cache's slots stand in for T
        k, v = (repeat_kv(z.transpose(1, 2), n_rep).transpose(1, 2) for z in (k, v))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=seen)
        return attn.wo(y.transpose(1, 2).reshape(B, T, -1))


class HFDecodeStep(DecodeStep):
    """A Hugging Face causal LM run by its own code with a ``StaticCache``-like cache whose
    layers are this module's buffers, and a 4-D mask (HF uses a 4-D mask as given)."""

    def __init__(self, model: nn.Module, batch: int, max_len: int):
        self._check(model, max_len)
        takes = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in takes else "past_key_values"
        self._keep = "logits_to_keep" in takes
        weight = model.get_input_embeddings().weight
        super().__init__(model, batch, max_len, self._probe(model, weight.device), weight)

    @staticmethod
    def _check(model: nn.Module, max_len: int) -> None:
        name = type(model).__name__
        if not getattr(model, "_can_compile_fullgraph", False) or \
                not hasattr(model, "get_input_embeddings"):
            raise UnsupportedDecode(f"{name} does not declare static K/V cache support "
                                    "(a Hugging Face model with _can_compile_fullgraph)")
        if not {"attention_mask", "position_ids"} <= set(inspect.signature(model.forward).parameters):
            raise UnsupportedDecode(f"{name}.forward takes no attention_mask and position_ids")
        cfg = model.config
        types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if types != {"full_attention"}:
            raise UnsupportedDecode(f"{name} has {sorted(types)} layers; only full attention "
                                    "layers have a cached decode step")
        window = getattr(cfg, "sliding_window", None)
        if window is not None and max_len > window:
            raise UnsupportedDecode(f"{name} attends within a sliding window of {window} "
                                    f"tokens, shorter than the {max_len} cached")
        if cfg._attn_implementation not in ("sdpa", "eager"):
            raise UnsupportedDecode(f"{name} uses attention {cfg._attn_implementation!r}; the "
                                    "decode step's mask is built for 'sdpa' and 'eager'")

    def _probe(self, model: nn.Module, device: torch.device) -> list[tuple]:
        """(K/V heads, head dim) of each layer, read off a one-token forward's cache."""
        from transformers import DynamicCache
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                  **{self._cache_arg: cache}, use_cache=True)
        shapes = [(layer.keys.shape[1], layer.keys.shape[-1]) for layer in cache.layers]
        if any(layer.values.shape[-1] != layer.keys.shape[-1] for layer in cache.layers):
            raise UnsupportedDecode(f"{type(model).__name__} has keys and values of different "
                                    "head dims")
        return shapes

    def forward(self, input_ids, position_ids, cache_position, attention_mask):
        place, written = placement(cache_position, self.max_len, self.k_cache_0.dtype)
        mask = visible(cache_position, attention_mask)
        if self.model.config._attn_implementation == "eager":
            low = torch.finfo(self.k_cache_0.dtype).min
            mask = torch.zeros(mask.shape, dtype=self.k_cache_0.dtype,
                               device=mask.device).masked_fill(~mask, low)
        extra = {"logits_to_keep": 1} if self._keep else {}
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                         use_cache=True, **{self._cache_arg: _placed_cache(self, place, written)},
                         **extra)
        return out.logits


def _placed_cache(step: DecodeStep, place, written):
    """An HF ``Cache`` whose layers write into ``step``'s buffers through ``place``."""
    from transformers.cache_utils import Cache
    n = sum(1 for name, _ in step.named_buffers() if name.startswith("k_cache_"))
    return Cache(layers=[_placed_layer()(step.max_len, *step.caches(i), place, written)
                         for i in range(n)])


@functools.cache
def _placed_layer() -> type:
    """HF's ``StaticLayer`` over given buffers, written through a placement matrix
    (made on first use: transformers is imported only for HF models)."""
    from transformers.cache_utils import StaticLayer

    class PlacedLayer(StaticLayer):
        def __init__(self, max_len: int, keys, values, place, written):
            super().__init__(max_len)
            self.keys, self.values, self.is_initialized = keys, values, True
            self.place, self.written = place, written

        def update(self, key_states, value_states, *args, **kwargs):
            return (write(self.keys, key_states, self.place, self.written),
                    write(self.values, value_states, self.place, self.written))

    return PlacedLayer
