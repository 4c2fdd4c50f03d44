"""Text generation with a (sharded) causal language model: greedy or sampled.

    out = sharded.generate(ids, max_new_tokens=20)                      # greedy
    out = sharded.generate(ids, max_new_tokens=20, do_sample=True, top_k=50,
                           generator=torch.Generator().manual_seed(0))
    out = generate(model, ids, max_new_tokens=20)                      # a plain module
    out = generate(model, ids, max_new_tokens=20, step=decode_step(model, 1, 32))  # cached

With a decode step (``step=``, see ``shardplan.kvcache``; the sharded
module's ``generate``, ``generate_sharded``, passes its parallelized one) the
prompt runs once and every later call feeds only the newest token, its keys and
values kept in the step's cache. Without one, each step recomputes the whole
prefix: one forward of the model on batch x (prompt + generated) tokens.

Every rank computes the same gathered logits; rank 0 picks the next tokens
(argmax, or a draw from its ``generator``, default the global RNG) and
broadcasts them, so the ranks never diverge. The result is what Hugging Face's
``model.generate`` returns for the same arguments on the unsharded model
(same logits processing: temperature, then top-k, then top-p; finished
sequences padded with ``pad_token_id``), and for HF models the defaults
(``eos_token_id``, ``pad_token_id``, ``top_k``, ...) are the model's
``generation_config``'s, as there. Left-padded batches need an
``attention_mask`` and a model whose forward takes ``attention_mask`` and
``position_ids``; positions are counted over the unmasked tokens.
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn as nn

from . import arguments
from .errors import ConfigurationError, ShardplanError
from .kvcache import cache_length
from .layouts import Shard
from .runtime.comm import Group
from .torch_compat import pytree

_UNSET = object()


def generate(model: nn.Module, input_ids: torch.Tensor, *, max_new_tokens: int,
             do_sample: bool = False, temperature=_UNSET, top_k=_UNSET, top_p=_UNSET,
             eos_token_id=_UNSET, pad_token_id=_UNSET, attention_mask: torch.Tensor | None = None,
             generator: torch.Generator | None = None, group: Group | None = None,
             source: nn.Module | None = None, gather=None,
             step: nn.Module | None = None) -> torch.Tensor:
    """``input_ids`` (batch, prompt) followed by up to ``max_new_tokens`` generated tokens.

    ``model`` returns logits (batch, length, vocab): as a tensor, as the first
    element of a tuple (the bundled models) or as ``.logits`` (HF). ``source``
    is the module whose forward signature and ``generation_config`` apply
    (default ``model``); ``group``: ranks that must agree on every token;
    ``gather``: turns this rank's part of the last position's logits into all
    of them (for a sharded model that keeps its output split); ``step``: a decode
    step (``kvcache.decode_step``, plain or parallelized with ``parallel_step``)
    with room for ``input_ids``' batch and prompt + ``max_new_tokens`` - 1 positions,
    used instead of ``model``'s forward on the whole prefix.
    Stops early once every sequence has produced ``eos_token_id``. Every argument is
    checked first (``check_arguments``: the allowed values).
    """
    source = model if source is None else source
    opts = check_arguments(source, input_ids, max_new_tokens=max_new_tokens, do_sample=do_sample,
                           temperature=temperature, top_k=top_k, top_p=top_p,
                           eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                           attention_mask=attention_mask, generator=generator)
    takes = set(inspect.signature(source.forward).parameters)
    masked = attention_mask is not None and not bool(attention_mask.all())
    if masked and step is None and not {"attention_mask", "position_ids"} <= takes:
        raise ConfigurationError(f"{type(source).__name__}.forward takes no attention_mask and "
                                 "position_ids, so padded prompts cannot be generated from",
                                 fix="pass prompts of equal length without padding")
    eos = opts["eos_token_id"]
    eos = torch.tensor([eos] if isinstance(eos, int) else (eos or []), dtype=torch.long)
    pad = opts["pad_token_id"] if opts["pad_token_id"] is not None else \
        (int(eos[0]) if len(eos) else None)
    ids = input_ids
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool)
    next_logits = _Recompute(model, takes, masked) if step is None else \
        _Cached(step, input_ids.shape, max_new_tokens)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            scores = next_logits(ids, mask)
            scores = (scores if gather is None else gather(scores)).to(torch.float32)
            token = _pick(scores, do_sample, opts, generator, group)
            if len(eos) and pad is not None:
                token = torch.where(unfinished, token, torch.full_like(token, pad))
            ids = torch.cat([ids, token[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            if len(eos):
                unfinished &= ~torch.isin(token, eos)
                if not unfinished.any():
                    break
    return ids


def generate_sharded(sharded: nn.Module, input_ids: torch.Tensor, *, kv_cache: bool = True,
                     **kwargs) -> torch.Tensor:
    """``generate`` on a ``ShardedModule`` (its ``generate``), the same tokens on every rank
    (collective); ``kwargs``: ``generate``'s sampling arguments.

    With ``kv_cache`` (the default) the model runs as its decode step
    (``sharded.decode_step``): the prompt once, then one token per step, each rank
    holding its heads of the K/V cache. A model with no decode step recomputes the
    whole prefix for every token, with a warning saying why. The arguments are checked
    (``check_arguments``) before a step is built.
    """
    check_arguments(sharded.source, input_ids, **kwargs)  # before a decode step is built
    arguments.flag("kv_cache", kv_cache, where=_WHERE)
    step = _decode_step_for(sharded, input_ids, kwargs["max_new_tokens"]) if kv_cache else None
    gather = None if sharded.gather_output or step is not None else vocab_gather(sharded)
    return generate(sharded, input_ids, group=sharded.group, source=sharded.source,
                    gather=gather, step=step, **kwargs)


def vocab_gather(sharded: nn.Module):
    """For a ``ShardedModule`` parallelized with gather_output=False: the function that
    turns this rank's part of the last position's logits (batch, vocab part) into the
    full, unpadded (batch, vocab); None where the logits are not split."""
    annotation, group = sharded.annotation, sharded.group
    out = next(n for n in annotation.gm.graph.nodes if n.op == "output")
    logits = pytree.tree_leaves(out.args[0])[0]
    lay, full = annotation.layouts.get(logits), logits.meta["val"].shape
    if not isinstance(lay, Shard):
        return None
    if lay.dim % len(full) != len(full) - 1:
        raise ConfigurationError(f"the logits are split along dim {lay.dim}, not the vocabulary",
                                 fix="parallelize with gather_output=True to generate")

    def gather(part: torch.Tensor) -> torch.Tensor:
        parts = group.all_gather(part.unsqueeze(0), 0, site="generate.logits").unbind(0)
        return Shard(part.dim() - 1, lay.blocks, lay.padded, lay.replicas).unshard(
            list(parts), int(full[-1]))
    return gather


def check_arguments(source: nn.Module, input_ids, *, max_new_tokens, do_sample=False,
                    temperature=_UNSET, top_k=_UNSET, top_p=_UNSET, eos_token_id=_UNSET,
                    pad_token_id=_UNSET, attention_mask=None, generator=None) -> dict:
    """The sampling options ``generate`` runs with (the unset ones ``source``'s
    ``generation_config``'s); a ``ConfigurationError`` naming the first bad argument.

    ``input_ids``: a 2-D integer tensor of ids in ``[0, vocab)`` (the token embedding's
    size), the ``attention_mask`` its shape; ``max_new_tokens`` >= 0 (0: the prompt);
    ``temperature`` finite, > 0 when sampling (greedy decoding ignores it); ``top_k`` >=
    0 (0: no top-k); ``top_p`` in (0, 1]; ``eos_token_id`` an id or a list of them,
    ``pad_token_id`` an id. None, where allowed, means "not used".
    """
    vocab = vocab_size(source)
    _check_ids(input_ids, vocab)
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != input_ids.shape):
        got = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else \
            type(attention_mask).__name__
        raise ConfigurationError(f"attention_mask is {got}, input_ids {list(input_ids.shape)}",
                                 where=_WHERE, fix="pass a mask of input_ids' shape: 1 for a "
                                                   "token, 0 for padding; or None")
    arguments.integer("max_new_tokens", max_new_tokens, 0, where=_WHERE)
    arguments.flag("do_sample", do_sample, where=_WHERE)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ConfigurationError(f"generator={generator!r} is not a torch.Generator",
                                 where=_WHERE, fix="pass torch.Generator().manual_seed(seed), "
                                                   "or None for the global RNG")
    opts = _options(source, temperature=temperature, top_k=top_k, top_p=top_p,
                    eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    arguments.number("temperature", opts["temperature"], 0, where=_WHERE, low_open=do_sample,
                     optional=True, fix="pass temperature > 0 to sample (1: the model's "
                                        "distribution), or do_sample=False for greedy decoding")
    arguments.integer("top_k", opts["top_k"], 0, where=_WHERE, optional=True,
                      fix="pass top_k >= 1 to sample from the k likeliest tokens, or 0 / None "
                          "for no top-k filtering")
    arguments.number("top_p", opts["top_p"], 0, 1, where=_WHERE, low_open=True, optional=True,
                     fix="pass top_p in (0, 1] (1: no nucleus filtering), or None")
    eos = opts["eos_token_id"]
    if isinstance(eos, (list, tuple)):
        for i, token in enumerate(eos):
            arguments.integer(f"eos_token_id[{i}]", token, 0, high=vocab, where=_WHERE)
    else:
        arguments.integer("eos_token_id", eos, 0, high=vocab, where=_WHERE, optional=True)
    arguments.integer("pad_token_id", opts["pad_token_id"], 0, high=vocab, where=_WHERE,
                      optional=True)
    return opts


def vocab_size(model: nn.Module) -> int | None:
    """The token embedding's size (an HF model's input embeddings, else the largest
    ``nn.Embedding``), or None for a model with none."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except NotImplementedError:
        embedding = None
    if isinstance(embedding, nn.Embedding):
        return embedding.num_embeddings
    return max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)),
               default=None)


_WHERE = "generate"


def _check_ids(ids, vocab: int | None) -> None:
    """A (batch, prompt length >= 1) tensor of integer ids in ``[0, vocab)``."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or \
            ids.dtype.is_complex or ids.dtype == torch.bool:
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ConfigurationError(f"input_ids is {got}, not a tensor of integer token ids",
                                 where=_WHERE, fix="pass a 2-D torch.long tensor of token ids "
                                                   "(a tokenizer's return_tensors='pt')")
    if ids.dim() != 2 or 0 in ids.shape:
        raise ConfigurationError(f"input_ids must be (batch >= 1, prompt length >= 1), got "
                                 f"{list(ids.shape)}", where=_WHERE,
                                 fix="pass a 2-D tensor of token ids, e.g. ids[None] for one "
                                     "prompt")
    if vocab is None or ids.is_meta:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise ConfigurationError(f"input_ids holds id {low if low < 0 else high}, outside the "
                                 f"vocabulary [0, {vocab})", where=_WHERE,
                                 fix="check the tokenizer: it must be the model's")


def _decode_step_for(sharded: nn.Module, input_ids: torch.Tensor, max_new_tokens: int):
    """The sharded model's decode step that fits this generation, or None (warned) where
    there is none."""
    batch, prompt = input_ids.shape
    if max_new_tokens < 1:
        return None  # the prompt is the result
    try:
        length = cache_length(sharded.source, prompt + max_new_tokens - 1)
        return sharded.decode_step(batch, length)
    except ShardplanError as e:  # no step, or one that cannot be captured or planned
        warnings.warn(f"generate: no K/V cache, the prefix is recomputed for every token: "
                      f"{e.what}", stacklevel=4)
        return None


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position in its sequence, counted over unmasked tokens (HF's rule)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


class _Recompute:
    """The last position's logits from a forward of the model on the whole prefix."""

    def __init__(self, model: nn.Module, takes: set, masked: bool):
        self.model, self.takes, self.masked = model, takes, masked

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.takes >= {"input_ids"}:
            kw = {"input_ids": ids}
            if self.masked:
                kw.update(attention_mask=mask, position_ids=positions(mask))
            return _logits(self.model(**kw))[:, -1, :]
        return _logits(self.model(ids))[:, -1, :]


class _Cached:
    """The last position's logits from a decode step (``shardplan.kvcache``): the prompt
    first (prefill), then only the newest token, written into the next cache slot."""

    def __init__(self, step: nn.Module, shape: torch.Size, max_new_tokens: int):
        cache = getattr(step, "source", step)  # a parallelized step's own decode step
        batch, prompt = shape
        if batch != cache.batch or prompt + max_new_tokens - 1 > cache.max_len:
            raise ConfigurationError(
                f"{batch} prompts of {prompt} tokens and {max_new_tokens} new ones do not fit a "
                f"cache of {cache.batch} sequences of {cache.max_len} positions",
                fix="build the decode step with as many sequences as prompts and max_len >= "
                    "prompt length + max_new_tokens - 1")
        self.step, self.max_len, self.filled = step, cache.max_len, 0

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        start, end = self.filled, ids.shape[1]
        slots = torch.nn.functional.pad(mask, (0, self.max_len - end))
        logits = _logits(self.step(ids[:, start:], positions(mask)[:, start:],
                                   torch.arange(start, end, device=ids.device), slots))
        self.filled = end
        return logits[:, -1, :]


def _options(source: nn.Module, **given) -> dict:
    """The given sampling options; the unset ones from an HF ``generation_config``."""
    config = getattr(source, "generation_config", None)
    return {k: (getattr(config, k, None) if v is _UNSET else v) for k, v in given.items()}


def _logits(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[0]
    return out.logits


def _pick(scores: torch.Tensor, do_sample: bool, opts: dict, generator, group) -> torch.Tensor:
    """The next token of each sequence: chosen on rank 0, the same on every rank."""
    if group is None or group.rank == 0:
        if do_sample:
            probs = torch.softmax(_filtered(scores, opts), -1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            token = scores.argmax(-1)
    else:
        token = torch.empty(scores.shape[0], dtype=torch.long)
    if group is not None and group.size > 1:
        token = group.broadcast(token, 0, site="generate.next_token")
    return token


def _filtered(scores: torch.Tensor, opts: dict) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering of (batch, vocab) scores."""
    if opts["temperature"] not in (None, 1.0):
        scores = scores / opts["temperature"]
    if opts["top_k"]:
        k = min(int(opts["top_k"]), scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if opts["top_p"] is not None and opts["top_p"] < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - opts["top_p"]
        drop[..., -1:] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return scores
