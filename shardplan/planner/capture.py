"""capture: a model and example inputs -> an ATen-level ``fx.GraphModule``.

Non-strict ``torch.export`` first (it captures real Transformers, keeps
linear/embedding/SDPA/cross-entropy as single nodes, and records the owning
module and the user's source line on every node); symbolic tracing followed by
export as the fallback for forwards that export cannot read directly. Every
tensor dim is exported as ``Dim.AUTO``: batch and sequence stay symbolic,
model sizes become literals. Nothing real is computed: export runs on fake
tensors, so a model built on ``meta`` captures without memory.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sysconfig
import threading
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export import Dim

from ..errors import CaptureError
from .capturable import capturable
from .input_shapes import InputShapes
from .model_state import check_real, preserved
from .quiet import quiet_export
from ..torch_compat import pytree, uncached_fake_dispatch
from . import shared_capture

GUARDS = "_guards_fn"
# ``gm.meta`` key of the exported program's input spec (``ep.call_spec.in_spec``)
IN_SPEC = "shardplan_in_spec"
# torch.export and the fake tensors it leaves in node.meta keep state that is not
# thread-safe: capturing and planning hold this lock (simulated ranks are threads).
PLANNING_LOCK = threading.RLock()
# blocks a truncated capture keeps of a list: the first, one in the middle, the last
KEPT = 3
# what torch.export takes as an input leaf (inside tuples, lists, dicts and registered pytrees)
_LEAVES = (torch.Tensor, int, float, bool, str, type(None), nn.Module, torch.ScriptObject)
# frames in these trees are not the user's code
_LIBRARIES = tuple({os.path.realpath(d) + os.sep for d in (
    os.path.dirname(torch.__file__), os.path.dirname(__file__),
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])})


@dataclass
class Captured:
    """One capture of ``model`` for one call signature and mode."""

    gm: fx.GraphModule
    aliases: dict[str, str]  # every parameter/buffer FQN -> its canonical FQN (tying)
    truncated: dict[str, tuple[int, int]]  # ModuleList FQN -> (captured, real) length
    shapes: InputShapes  # the input shapes the graph serves


def capture(model: nn.Module, args: tuple, kwargs: dict | None = None, *,
            truncate: bool = False) -> Captured:
    """Capture ``model(*args, **kwargs)`` in its current train/eval mode.

    With ``truncate``, lists of more than three identical blocks are captured
    with their first three only (planning a deep model in seconds): a first,
    a middle and a last block; the plan stamps the middle one onto the rest.
    Within ``shared_capture.sharing`` (a launch of simulated ranks), a model of
    the same structure called the same way as one captured before gets a copy
    of that capture reading this model's tensors.
    """
    args, kwargs = tuple(args), dict(kwargs or {})
    check_inputs(model, args, kwargs)
    check_real(model)
    share = shared_capture.active()
    with PLANNING_LOCK:  # another thread may be capturing this very model object
        found = shared_capture.key(model, args, kwargs, truncate) if share else None
        if share is None or found is None:
            return _capture(model, args, kwargs, truncate)
        key, tensors = found
        captured = share.lookup(key, tensors)
        if captured is None:
            captured = _capture(model, args, kwargs, truncate)
            share.keep(key, tensors, captured)
        return captured


def _capture(model: nn.Module, args: tuple, kwargs: dict, truncate: bool) -> Captured:
    args, kwargs = _unaliased(args, kwargs)
    cutting: contextlib.AbstractContextManager[dict] = \
        _truncated(model) if truncate else contextlib.nullcontext({})
    with PLANNING_LOCK, preserved(model), _buffers_on_meta(model), capturable(model), \
            cutting as cut:
        try:
            gm, shapes = _export(model, args, kwargs)
        except CaptureError:
            raise
        except Exception as first:  # export refused the forward: try tracing first
            try:
                traced = fx.symbolic_trace(model, concrete_args=_none_kwargs(model, args, kwargs))
                gm, shapes = _export(traced, args, kwargs)
            except Exception:
                raise CaptureError(
                    f"could not capture {type(model).__name__}.forward: "
                    f"{type(first).__name__}: {_first_line(first)}",
                    where=type(model).__name__, source=_user_line(first),
                    fix="make the forward traceable at that line (no Python control flow on "
                        "tensor values, no .item()), or pass example_inputs matching how "
                        "you call the model") from first
    return Captured(gm, _aliases(model), cut, shapes)


def check_inputs(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """``model(*args, **kwargs)`` binds to the forward and passes only what export takes."""
    name = type(model).__name__
    sig = inspect.signature(model.forward)
    fix = ("pass example_inputs as the model is called: one tensor, a tuple of positional "
           "arguments or a dict of keyword arguments, holding tensors and plain values "
           "(int, float, bool, str, None)")
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        given = ", ".join([*map(_describe, args),
                           *(f"{k}={_describe(v)}" for k, v in kwargs.items())])
        raise CaptureError(f"the inputs ({given}) do not fit {name}.forward{sig}: {e}",
                           where=name, source=_definition(model.forward), fix=fix) from None
    for arg, value in bound.arguments.items():
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            if not isinstance(leaf, _LEAVES):
                raise CaptureError(
                    f"{name}.forward gets a {type(leaf).__module__}.{type(leaf).__qualname__} as "
                    f"{arg}{pytree.keystr(path)}, which torch.export cannot take",
                    where=name, source=_definition(model.forward),
                    fix=f"{fix}; convert arrays with torch.as_tensor")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else f"{type(value).__name__}(...)"


def _definition(fn) -> str | None:
    """``file:line: def ...`` of a function, when its source is available."""
    try:
        lines, lineno = inspect.getsourcelines(fn)
        return f"{inspect.getsourcefile(fn)}:{lineno}: {lines[0].strip()}"
    except (OSError, TypeError):
        return None


def _unaliased(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """One tensor passed as two arguments (``model(ids, ids)``) becomes two tensors:
    export would capture it as one input and read it for both ever after."""
    seen: set[int] = set()

    def own(x):
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return x.clone()
            seen.add(id(x))
        return x

    return (tuple(own(a) for a in args), {k: own(v) for k, v in kwargs.items()})


def _export(model: nn.Module, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, InputShapes]:
    shapes = _auto_shapes(model, args, kwargs)
    with _no_kv_cache(model), quiet_export(), uncached_fake_dispatch():
        ep = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=shapes)
    gm = ep.module()
    gm.meta[IN_SPEC] = ep.call_spec.in_spec
    return gm, InputShapes.of(gm, ep.range_constraints)


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module):
    """Hugging Face models return a key/value cache object by default; training has
    no use for it and export cannot return it, so it is off while capturing."""
    config: Any = getattr(model, "config", None)
    cached = getattr(config, "use_cache", None)
    if cached:
        config.use_cache = False
    try:
        yield
    finally:
        if cached:
            config.use_cache = cached


def _auto_shapes(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """``Dim.AUTO`` for every dim of every tensor input, keyed by parameter name."""
    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    shapes: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            shapes[name] = tuple(_dims(v) for v in value)
        elif kind == inspect.Parameter.VAR_KEYWORD:
            shapes[name] = {k: _dims(v) for k, v in value.items()}
        else:
            shapes[name] = _dims(value)
    return shapes


def _dims(value):
    if isinstance(value, torch.Tensor):
        return {i: Dim.AUTO for i in range(value.dim())}
    return None


def _none_kwargs(model, args, kwargs) -> dict:
    """Arguments left at ``None`` are fixed for symbolic tracing."""
    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    return {n: None for n, p in sig.parameters.items()
            if n not in bound.arguments and p.default is None}


def _aliases(model: nn.Module) -> dict[str, str]:
    """FQN -> canonical FQN for parameters and buffers, by tensor identity."""
    first: dict[int, str] = {}
    out = {}
    for kind in (model.named_parameters, model.named_buffers):
        for name, t in kind(remove_duplicate=False):
            out[name] = first.setdefault(id(t), name)
    return out


@contextlib.contextmanager
def _buffers_on_meta(model: nn.Module):
    """A model whose parameters wait on meta for a checkpoint keeps real buffers (RoPE
    tables it does not save); capture, on meta inputs, sees meta copies of them."""
    if not any(p.is_meta for p in model.parameters()):
        yield
        return
    saved = [(mod, name, b) for mod in model.modules()
             for name, b in mod.named_buffers(recurse=False, remove_duplicate=False)
             if not b.is_meta]
    try:
        for mod, name, b in saved:
            setattr(mod, name, b.to("meta"))  # a registered buffer stays one, persistence kept
        yield
    finally:
        for mod, name, b in saved:
            setattr(mod, name, b)


@contextlib.contextmanager
def _truncated(model: nn.Module) -> Iterator[dict[str, tuple[int, int]]]:
    """Temporarily keep the first ``KEPT`` blocks of every longer list of identical blocks."""
    cut: dict[str, tuple[int, int]] = {}
    saved = []
    for name, mod in model.named_modules():
        if _cuttable(mod):
            saved.append((mod, list(mod)))
            cut[name] = (KEPT, len(mod))
    try:
        for mod, _ in saved:
            del mod[KEPT:]
        yield cut
    finally:
        for mod, blocks in saved:
            del mod[:]
            mod.extend(blocks)


def has_repeated_blocks(model: nn.Module) -> bool:
    """Would ``capture(..., truncate=True)`` cut a list of ``model``?"""
    return any(_cuttable(m) for m in model.modules())


def _cuttable(mod: nn.Module) -> bool:
    """A list of more than ``KEPT`` identical blocks; a list holding ``None`` places (a
    library's unused per-layer slots, zipped with the layers) is not one."""
    blocks = list(mod) if isinstance(mod, nn.ModuleList) else []
    return len(blocks) > KEPT and None not in blocks and _identical(blocks)


def _identical(blocks: list[nn.Module]) -> bool:
    def signature(m):
        return type(m), [(n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()]
    first = signature(blocks[0])
    return all(signature(b) == first for b in blocks[1:])


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def _user_line(e: BaseException) -> str | None:
    """The innermost frame of the user's code: not torch, shardplan, the standard library
    or an installed package (Hugging Face model code counts as the user's)."""
    best = None
    for frame in traceback.extract_tb(e.__traceback__):
        if frame.filename.startswith("<"):
            continue
        path = os.path.realpath(frame.filename)
        if "transformers" not in path and (path.startswith(_LIBRARIES) or "site-packages" in path
                                           or "dist-packages" in path):
            continue
        best = f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return best


def source_of(node: fx.Node) -> str | None:
    """The user's source line that produced ``node``, as ``file:line: code``.

    The innermost frame of the node's stack trace outside torch itself.
    """
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = trace.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i].strip()
        if not line.startswith("File "):
            continue
        parts = line.split(", ")
        path = parts[0][len('File "'):-1]
        if "/torch/" in path.replace("\\", "/"):
            continue
        lineno = parts[1].replace("line ", "") if len(parts) > 1 else "?"
        code = lines[i + 1].strip() if i + 1 < len(lines) else ""
        return f"{path}:{lineno}: {code}"
    return None


def module_of(node: fx.Node) -> str:
    """FQN of the innermost module that produced ``node`` ('' for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    for fqn, _ in reversed(list(stack.values())):
        if not fqn.startswith("_"):
            return _clean_fqn(fqn)
    return ""


def _clean_fqn(fqn: str) -> str:
    # export spells list indices as "h.0" or "L['self'].h[0]"-like in some versions
    return fqn.replace("[", ".").replace("]", "").replace("'", "")


# id of each live plan made by ``plan()`` -> (model ref, args, kwargs, Captured) it was made
# from, dropped with the plan (not part of it: not compared, copied or serialized)
_PLANNED: dict[int, tuple] = {}


def remember_capture(p, model: nn.Module, args: tuple, kwargs: dict, captured: Captured) -> None:
    """Keep what plan ``p`` was planned from, for as long as ``p`` lives."""
    _PLANNED[id(p)] = (weakref.ref(model), args, kwargs, captured)
    weakref.finalize(p, _PLANNED.pop, id(p), None)


def planned_capture(p) -> tuple | None:
    """``(model ref, args, kwargs, Captured)`` that plan ``p`` was planned from, while ``p``
    lives (``None`` for a copy or a loaded plan): the exports' check of the model's own code
    reads it instead of capturing again (``export.ModelCode``)."""
    return _PLANNED.get(id(p))
