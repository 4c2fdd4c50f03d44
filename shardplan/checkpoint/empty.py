"""Models built with their parameters on meta and their buffers real, to be filled by a checkpoint.

Building under ``torch.device("meta")`` puts buffers on meta too, and a buffer a
checkpoint does not hold (``persistent=False``: rotary tables, causal masks) then
never gets a value. ``parameters_on_meta`` lets the model's constructor run on
the CPU and moves each parameter to meta as it is registered: buffers keep the
values the constructor computed, parameters cost no memory (their CPU storage
is allocated uninitialized and dropped at once), and initializers then run on
meta, costing nothing. The patch is process-wide, so builds hold a lock (simulated
ranks are threads).
"""

from __future__ import annotations

import contextlib
import threading

from torch import nn

_LOCK = threading.RLock()


@contextlib.contextmanager
def parameters_on_meta():
    """Within the block, every parameter a module registers is moved to ``meta``."""
    with _LOCK:
        register = nn.Module.register_parameter

        def register_on_meta(module, name, param):
            if param is not None and not param.is_meta:
                param = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
            register(module, name, param)

        nn.Module.register_parameter = register_on_meta
        try:
            yield
        finally:
            nn.Module.register_parameter = register
