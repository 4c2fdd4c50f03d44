"""Models built with their parameters on meta and their buffers real, to be filled by a checkpoint.

Building under ``torch.device("meta")`` puts buffers on meta too, and a buffer a
checkpoint does not hold (``persistent=False``: rotary tables, causal masks) then
never gets a value. ``parameters_on_meta`` lets the model's constructor run on
the CPU and moves each parameter to meta as it is registered: buffers keep the
values the constructor computed, a parameter's CPU tensor lives only until it
is registered (``torch.empty`` in torch's layers: never touched), and
initializers then run on meta, costing nothing.

The hook is ``nn.Module.register_parameter``, patched while any thread is inside
the block; it acts only in those threads (simulated ranks are threads, and a rank
building a plain module meanwhile keeps its parameters).
"""

from __future__ import annotations

import contextlib
import threading

from torch import nn

_LOCK = threading.Lock()
_INSIDE = threading.local()  # .depth: how deep this thread is in parameters_on_meta
_PATCH = {"users": 0, "original": None}


def _register(module, name, param):
    if getattr(_INSIDE, "depth", 0) and param is not None and not param.is_meta:
        param = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
    _PATCH["original"](module, name, param)


@contextlib.contextmanager
def parameters_on_meta():
    """Within the block, every parameter a module registers in this thread goes to ``meta``."""
    with _LOCK:
        if _PATCH["users"] == 0:
            _PATCH["original"] = nn.Module.register_parameter
            nn.Module.register_parameter = _register
        _PATCH["users"] += 1
    _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
    try:
        yield
    finally:
        _INSIDE.depth -= 1
        with _LOCK:
            _PATCH["users"] -= 1
            if _PATCH["users"] == 0:
                nn.Module.register_parameter = _PATCH["original"]
