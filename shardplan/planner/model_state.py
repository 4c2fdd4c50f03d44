"""Capture leaves the user's model exactly as it was.

Non-strict ``torch.export`` runs the model's own ``forward`` in Python on fake
tensors, so whatever that forward does to ``self`` happens for real: a buffer
registered or a tensor cached on first use (x-transformers caches its ALiBi
bias so) is left holding a fake tensor, a call counter moves on, a list grows.
``preserved(model)`` snapshots every module's attributes before a capture and
puts them back after it; ``check_real(model)`` refuses a model that already
holds a fake tensor (left by a plain ``torch.export`` of it) instead of baking
that into a graph.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn

from ..errors import CaptureError
from ..torch_compat import FakeTensor

# containers a forward may grow in place; their copies are restored (tensors in
# them are the same objects: export never writes into the model's real tensors)
_CONTAINERS = (dict, list, set)


@contextlib.contextmanager
def preserved(model: nn.Module):
    """Every module of ``model`` gets back its attributes (parameters, buffers,
    submodules, hooks, plain values and containers one level deep) on exit."""
    saved = [(m, {k: _copied(v) for k, v in vars(m).items()}) for m in model.modules()]
    try:
        yield
    finally:
        for m, attrs in saved:
            state = vars(m)
            state.clear()
            state.update({k: _copied(v) for k, v in attrs.items()})


def _copied(value):
    return copy.copy(value) if isinstance(value, _CONTAINERS) else value


def check_real(model: nn.Module) -> None:
    """``CaptureError`` naming the first attribute of ``model`` that holds a fake tensor."""
    for prefix, m in model.named_modules():
        for name, value in vars(m).items():
            for key, t in _tensors(name, value):
                if isinstance(t, FakeTensor):
                    where = f"{prefix}.{key}" if prefix else key
                    raise CaptureError(
                        f"{where} of {type(model).__name__} holds a FakeTensor, left by an "
                        f"earlier torch.export or fake-tensor run of this model object",
                        where=where,
                        fix="rebuild the model (or reload its weights) before parallelizing "
                            "it; shardplan's own captures leave the model as it was")


def _tensors(name: str, value):
    """(name, tensor) for an attribute that is a tensor or a dict of them (``_buffers``)."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict) and name.startswith("_"):
        for k, t in value.items():
            if isinstance(t, torch.Tensor):
                yield k, t
