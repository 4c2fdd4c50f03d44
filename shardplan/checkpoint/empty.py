"""Models built with their parameters on meta and their buffers real, to be filled by a checkpoint.

Building under ``torch.device("meta")`` puts buffers on meta too, and a buffer a
checkpoint does not hold (``persistent=False``: rotary tables, causal masks) then
never gets a value. ``parameters_on_meta`` lets the constructor run on the CPU and
moves each parameter to meta as it is registered (torch's parameter registration
hook), so buffers keep their computed values and initializers run on meta, costing
nothing. It acts only in the threads inside the block (simulated ranks are threads).
The hook is registered once, when this module is imported, and never removed: torch
keeps such hooks in one global dict, which registering or removing one while another
thread builds a module would change under its iteration.
"""

from __future__ import annotations

import contextlib
import threading

from torch.nn.modules.module import register_module_parameter_registration_hook

_INSIDE = threading.local()  # .depth: how deep this thread is in parameters_on_meta


def _to_meta(module, name, param):
    if getattr(_INSIDE, "depth", 0) and param is not None and not param.is_meta:
        return type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
    return None  # keep it


register_module_parameter_registration_hook(_to_meta)


@contextlib.contextmanager
def parameters_on_meta():
    """Within the block, every parameter a module registers in this thread goes to ``meta``."""
    _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
    try:
        yield
    finally:
        _INSIDE.depth -= 1
