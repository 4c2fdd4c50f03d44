"""Random ops of a tensor-parallel region, drawn from the model-parallel stream as data.

Dropout on a sharded tensor (split activations, attention probabilities of
this rank's heads) draws from the rank's model-parallel stream
(``random.RNGTracker``). Swapping generators, as ``tracker.fork()`` does,
cannot be traced by ``torch.compile``; here the stream's generator state is a
tensor argument of one custom op, ``shardplan::model_parallel_noise``, which
draws the keep-mask (scaled by ``1 / (1 - p)``) and advances the state in
place. Eager and compiled runs therefore call the same op on the same state:
they draw the same masks, and the ones ``aten.dropout`` would draw from that
stream. Activation recomputation replays them by restoring the state tensor
(``RNGTracker.model_parallel_at``). The mask is data (the op reads only the
shape, dtype and device of a detached ``like``), so autograd needs no formula
for the op: the gradient flows through ``x * mask``.

``DRAWS`` maps each random op of the rule file's ``random`` table that has a
traceable form to it; ``graph_ops.ModelParallelRNG`` runs the others under
``tracker.fork()`` (eager only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..torch_compat import safe_softmax


@torch.library.custom_op("shardplan::model_parallel_noise", mutates_args=("state",))
def model_parallel_noise(state: torch.Tensor, like: torch.Tensor, shape: Sequence[int],
                         p: float) -> torch.Tensor:
    """Dropout's scaled keep-mask of ``shape`` (``like``'s dtype and device), drawn as
    ``aten.dropout`` draws it from a generator at ``state``; ``state`` advances."""
    gen = torch.Generator(like.device)
    gen.set_state(state)
    mask = _empty(like, shape).bernoulli_(1 - p, generator=gen).div_(1 - p)
    state.copy_(gen.get_state())
    return mask


@model_parallel_noise.register_fake
def _(state, like, shape, p):
    return _empty(like, shape)


def _empty(like: torch.Tensor, shape) -> torch.Tensor:
    """The tensor the mask is drawn into: ``like``'s layout where it has ``shape``
    (``aten.dropout`` draws into ``empty_like(input)``, and the draw follows memory
    order), else contiguous."""
    if list(shape) == list(like.shape):
        return torch.empty_like(like)
    return like.new_empty(shape)


def dropout(state: torch.Tensor, input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten.dropout`` on the stream at ``state``: one draw per element."""
    return _masked(state, input, p, train, input.shape)


def feature_dropout(state: torch.Tensor, input: torch.Tensor, p: float,
                    train: bool) -> torch.Tensor:
    """``aten.feature_dropout``: one draw per (sample, channel)."""
    return _masked(state, input, p, train,
                   [input.shape[0], input.shape[1], *[1] * (input.dim() - 2)])


def _masked(state, input, p: float, train: bool, shape) -> torch.Tensor:
    """``input`` times a keep-mask of ``shape`` (broadcast), with ``aten.dropout``'s cases:
    nothing drawn for p 0 or 1, or outside training."""
    if p == 0 or not train or input.numel() == 0:
        return input
    if p == 1:
        return input * input.new_zeros(())
    return input * model_parallel_noise(state, input.detach(), shape, p)


def attention(state: torch.Tensor, query, key, value, attn_mask=None, dropout_p: float = 0.0,
              is_causal: bool = False, *, scale=None, enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` with dropout on the probabilities, as its
    documented reference computes it, the mask drawn here (the one torch's CPU kernel
    draws: a bernoulli over the probabilities' shape)."""
    if dropout_p == 0:
        return torch.ops.aten.scaled_dot_product_attention(
            query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    if enable_gqa:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], -3)
    scores = query @ key.transpose(-2, -1) * (query.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        length, keys = scores.shape[-2], scores.shape[-1]
        causal = torch.ones(length, keys, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    probs = safe_softmax(scores, -1)
    return (probs * model_parallel_noise(state, probs.detach(), probs.shape, dropout_p)) @ value


DRAWS = {"aten::dropout": dropout, "aten::feature_dropout": feature_dropout,
         "aten::scaled_dot_product_attention": attention}
