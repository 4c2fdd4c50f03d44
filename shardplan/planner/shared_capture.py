"""One capture for all simulated ranks of a launch.

Simulated ranks are threads of one process, each parallelizing its own copy of
the model (``copy.deepcopy``), so each would export the same forward again:
seconds a rank, where a deepcopy of the result costs about 1% of that. Inside
``sharing(share)`` (``SimulatedRanks.run`` opens one ``CaptureShare`` per
launch for its rank threads), ``capture`` first asks the share for an earlier
capture of a model of the same structure called the same way, and gets a copy
of it whose graph reads *this* model's own tensors.

Same structure means an equal ``key``: every module's type, its class's
forward code, its attributes (parameters and buffers by name, shape, stride,
dtype, device and ``requires_grad``; hooks and bound forwards by code; plain
values by value; tensors held as plain attributes also by content, as export
may read them), the module tree's sharing and the weights' tying, and the
call's pytree spec with each leaf's tensor metadata or value. Anything the key
cannot describe (an object with no ``__dict__``, a cycle, a sparse tensor)
makes the model unshareable: it is captured anew.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import enum
import functools
import hashlib
import threading
import types
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
from ..torch_compat import pytree

# values that stand for themselves in a key
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.Size, torch.layout, torch.memory_format, enum.Enum)
_DEPTH = 8  # nesting of plain objects (configs) a key follows before giving up
_local = threading.local()


class _Unshareable(Exception):
    """Something in the model or the call that a key cannot describe."""


@dataclass(frozen=True)
class _Same:
    """An object compared by identity (a class, a code object)."""

    obj: object

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


@dataclass
class _Entry:
    captured: object  # the capture as it was made, its graph reading ``tensors``
    tensors: list[torch.Tensor]  # the capturing model's tensors, in the key's order
    constants: list[tuple[str, str]]  # (module, name): a tensor its graph holds unregistered


class CaptureShare:
    """Captures by key (the ``limit`` most recently used); hands out copies bound to the
    asker's tensors. Not thread-safe by itself: ``capture`` calls it under its planning
    lock.

    A share kept beyond one launch (a test session) hands a later model the capture of
    an earlier one of the same key, so it is only as safe as the key: it describes the
    modules, their forwards' code and attributes, not functions a forward calls from its
    module's globals. Keep one only while such code does not change."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self._entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()

    def lookup(self, key: tuple, tensors: list[torch.Tensor]):
        """A copy of the capture made under ``key``, reading ``tensors`` (the asking
        model's, in the key's order) where the original read its model's; else None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        memo = {id(theirs): mine for theirs, mine in zip(entry.tensors, tensors, strict=True)}
        return _copied(entry.captured, memo, entry.constants)

    def keep(self, key: tuple, tensors: list[torch.Tensor], captured) -> None:
        """Remember ``captured`` (of the model whose ``tensors`` these are) under ``key``:
        a copy of its graph, so the caller may rewrite its own in place."""
        constants = _constants(captured.gm)
        memo = {id(t): t for t in tensors}
        self._entries[key] = _Entry(_copied(captured, memo, constants), list(tensors), constants)
        if len(self._entries) > self.limit:
            self._entries.popitem(last=False)


def _copied(captured, memo: dict, constants: list[tuple[str, str]]):
    """A deepcopy of ``captured`` (``memo``: tensors it reads in place of the originals);
    its graph's unregistered tensors stay unregistered (``GraphModule``'s copy would
    register them as buffers)."""
    out = copy.deepcopy(captured, memo)
    for owner, name in constants:
        m = out.gm.get_submodule(owner)
        if name in m._buffers:
            m.__dict__[name] = m._buffers.pop(name)
    return out


def _constants(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """(owner, name) of every tensor ``gm``'s graph reads that is neither a parameter
    nor a buffer of its owner."""
    out = []
    for node in gm.graph.find_nodes(op="get_attr"):
        owner, _, name = node.target.rpartition(".")
        m = gm.get_submodule(owner)
        if isinstance(m.__dict__.get(name), torch.Tensor):
            out.append((owner, name))
    return out


@contextlib.contextmanager
def sharing(share: CaptureShare | None):
    """``capture`` in this thread consults ``share`` while in this block (None: no share,
    every capture made anew)."""
    before = getattr(_local, "share", None)
    _local.share = share
    try:
        yield share
    finally:
        _local.share = before


def active() -> CaptureShare | None:
    """The share this thread's captures consult, if any."""
    return getattr(_local, "share", None)


def key(model: nn.Module, args: tuple, kwargs: dict, truncate: bool
        ) -> tuple[tuple, list[torch.Tensor]] | None:
    """``(key, tensors)`` for capturing ``model(*args, **kwargs)``: the key, and the
    model's tensors in the order it visited them; None if unshareable."""
    walk = _Walk(model)
    try:
        return (truncate, walk.model(), walk.call(args, kwargs)), walk.tensors
    except _Unshareable:
        return None


class _Walk:
    """One key's walk over a model: its tensors in visiting order, each object once."""

    def __init__(self, model: nn.Module):
        self.root = model
        self.paths: dict[int, str] = {}
        for name, m in model.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(m), name)
        self.tensors: list[torch.Tensor] = []
        self._seen: dict[int, int] = {}  # id -> its number, for objects met again
        self._open: set[int] = set()  # objects being described (a cycle back to one: give up)

    def model(self) -> tuple:
        parts: list[tuple] = []
        for name, m in self.root.named_modules(remove_duplicate=False):
            first = self.paths[id(m)]
            if first != name:
                parts.append((name, first))
                continue
            code = getattr(type(m).forward, "__code__", type(m).forward)
            parts.append((name, _Same(type(m)), _Same(code), self._module_attrs(m)))
        return tuple(parts)

    def call(self, args: tuple, kwargs: dict) -> tuple:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        out = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                out.append(_tensor_meta(x))
            elif isinstance(x, _PLAIN):
                out.append((type(x), x))
            else:
                raise _Unshareable(type(x))
        return str(spec), tuple(out)

    def _module_attrs(self, m: nn.Module) -> tuple:
        out = []
        for name, value in vars(m).items():
            if name == "_modules":
                out.append((name, tuple((k, self.paths.get(id(c))) for k, c in value.items())))
            elif name in ("_parameters", "_buffers"):
                out.append((name, tuple((k, self._state_tensor(t)) for k, t in value.items())))
            else:
                out.append((name, self.value(value, _DEPTH)))
        return tuple(out)

    def _state_tensor(self, t: torch.Tensor | None):
        """A parameter or buffer: export reads it as a graph input, never its values."""
        if t is None:
            return None
        if id(t) in self._seen:  # tied
            return "seen", self._seen[id(t)]
        self._first(t)
        self.tensors.append(t)
        return _tensor_meta(t)

    def _first(self, v) -> None:
        self._seen[id(v)] = len(self._seen)

    def value(self, v, depth: int):
        if isinstance(v, _PLAIN):
            return type(v), v
        if isinstance(v, nn.Module):
            if id(v) not in self.paths:
                raise _Unshareable(f"a module outside the model: {type(v).__name__}")
            return "module", self.paths[id(v)]
        if isinstance(v, type):
            return _Same(v)
        if id(v) in self._seen:  # the same object again: so must the other model's be
            return "seen", self._seen[id(v)]
        if id(v) in self._open or depth < 0:
            raise _Unshareable(type(v))
        self._open.add(id(v))
        try:
            part = self._describe(v, depth - 1)
        finally:
            self._open.discard(id(v))
        self._first(v)
        return part

    def _describe(self, v, depth: int):
        each = functools.partial(self.value, depth=depth)
        if isinstance(v, torch.Tensor):  # held as a plain attribute: export may read it
            self.tensors.append(v)
            return _tensor_meta(v), _digest(v)
        if isinstance(v, (list, tuple)):
            return type(v), tuple(map(each, v))
        if isinstance(v, (set, frozenset)):
            return type(v), frozenset(map(each, v))
        if isinstance(v, dict):
            return type(v), tuple((each(k), each(x)) for k, x in v.items())
        if isinstance(v, types.FunctionType):
            cells = tuple(each(c.cell_contents) for c in v.__closure__ or ())
            return _Same(v.__code__), each(v.__defaults__), each(v.__kwdefaults__), cells
        if isinstance(v, types.MethodType):
            return "method", each(v.__func__), each(v.__self__)
        if isinstance(v, functools.partial):
            return "partial", each(v.func), each(v.args), each(v.keywords)
        if isinstance(v, (types.BuiltinFunctionType, types.CodeType)):
            return _Same(v)
        plain_object = isinstance(getattr(v, "__dict__", None), dict)
        if type(v).__module__.split(".")[0] != "torch" and plain_object:
            return _Same(type(v)), each(vars(v))
        raise _Unshareable(type(v))


def _tensor_meta(t: torch.Tensor) -> tuple:
    if t.layout != torch.strided:
        raise _Unshareable(t.layout)
    return (_Same(type(t)), tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _digest(t: torch.Tensor) -> bytes | None:
    """The content of a tensor (None on meta: nothing to read)."""
    if t.is_meta:
        return None
    flat = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.blake2b(flat.view(torch.uint8).numpy().tobytes(), digest_size=16).digest()
