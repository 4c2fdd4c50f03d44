"""Layouts: how one tensor is held across the ranks of a device mesh.

A *placement* says how a tensor is held along one mesh dimension; small
immutable values, in the spirit of DTensor's placements:

- ``Replicate()``: every rank holds the whole tensor;
- ``Shard(dim, blocks, padded)``: rank r holds the r-th slice along ``dim``;
- ``Partial()``: every rank holds a summand, the sum is the value.

A shard may be *blocked*: ``blocks`` lists the sizes of consecutive segments
of ``dim`` (a fused QKV output is ``blocks=(H, H, H)``, a GQA one
``(Hq, Hkv, Hkv)``); rank r then holds the r-th slice of every segment,
concatenated. ``padded`` is the size ``dim`` is padded to before splitting
(a vocabulary not divisible by tp); padding rows are zero. ``replicas`` > 1
splits ``dim`` into tp/replicas parts, each held by ``replicas`` consecutive
ranks (K/V heads fewer than tp: the ranks that share a head hold it). A
blocked shard may give each block its own count (``replicas=(1, 4, 4)``,
written ``x1+4+4``): a fused multi-query QKV whose query block is split tp
ways while its one K and one V head are held whole by every rank.
``period`` P says ``dim`` merges an outer count of any size (the batch,
symbolic in a capture) with P inner elements, ``[B*H]`` of attention that
folds its heads into the batch: the shard (and its blocks) applies within
every run of P elements, so rank r holds its heads of every batch row.

A ``MeshLayout`` is a placement per named mesh dimension, outer to inner
(``dp=R,tp=S(0)``), as a DTensor's placement list is. A tensor of a sharded
module carries its ``ParallelSpec`` (mesh layout and full shape) as one
attribute, set when its shard is made (``spec_of``, ``set_spec``).

The text forms are the one codec of layouts: ``str()`` writes them
(``R``, ``P``, ``S(0|32+32+32|pad128|x2)``, ``dp=R,tp=S(0)``) and
``Placement.parse`` / ``MeshLayout.parse`` read them back, raising
``LayoutError`` for malformed text (``S(0|per4)`` is period 4); ``to_json`` /
``from_json`` are the checkpoint index's form of a placement.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from .errors import ConfigurationError, LayoutError


class Placement:
    """How a tensor is held along one mesh dimension (``Replicate``, ``Shard`` or ``Partial``)."""

    __slots__ = ()

    @staticmethod
    def parse(text: str) -> Placement:
        """The placement whose ``str()`` is ``text``; ``LayoutError`` if there is none."""
        if not isinstance(text, str):
            raise LayoutError(f"a layout is text, got {type(text).__name__}",
                              fix='pass a string such as "R", "P" or "S(0)"')
        text = text.strip()
        if text == "R":
            return Replicate()
        if text == "P":
            return Partial()
        return Shard._parse(text)

    def to_json(self) -> dict:
        return {"type": type(self).__name__.lower()}

    @staticmethod
    def from_json(d) -> Placement:
        """Inverse of ``to_json``; ``LayoutError`` for anything else."""
        kind = d.get("type") if isinstance(d, Mapping) else None
        try:
            if kind == "replicate":
                return Replicate()
            if kind == "partial":
                return Partial()
            if kind == "shard":
                blocks = tuple(d["blocks"]) if d.get("blocks") else None
                reps = d.get("replicas", 1)
                reps = tuple(int(r) for r in reps) if isinstance(reps, list) else int(reps)
                return Shard(int(d["dim"]), blocks, d.get("padded"), reps, d.get("period"))
        except (KeyError, TypeError, ValueError, LayoutError):
            pass
        raise LayoutError(f"not a layout: {d!r}",
                          fix="it was written by another shardplan version or edited by hand")


@dataclass(frozen=True)
class Replicate(Placement):
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial(Placement):
    def __str__(self) -> str:
        return "P"


_SHARD = re.compile(r"S\((-?\d+)((?:\|[^|()]*)*)\)")


@dataclass(frozen=True)
class Shard(Placement):
    dim: int
    blocks: tuple[int, ...] | None = None
    padded: int | None = None
    replicas: int | tuple[int, ...] = 1  # a tuple: one count per block
    period: int | None = None

    def __post_init__(self):
        if self.blocks is not None:
            object.__setattr__(self, "blocks", tuple(self.blocks))
        if isinstance(self.replicas, (tuple, list)):
            reps = tuple(self.replicas)
            # one count for every block: the plain form
            plain = reps and len(set(reps)) == 1 and (self.blocks is None
                                                      or len(reps) == len(self.blocks))
            object.__setattr__(self, "replicas", reps[0] if plain else reps)
        bad = [f for f, ok in (("dim", _is_int(self.dim)),
                               ("blocks", self.blocks is None or (
                                   len(self.blocks) > 0 and all(_is_int(b) and b > 0
                                                                for b in self.blocks))),
                               ("padded", self.padded is None or (_is_int(self.padded)
                                                                  and self.padded > 0)),
                               ("replicas", _is_int(self.replicas) and self.replicas > 0 or (
                                   isinstance(self.replicas, tuple) and self.blocks is not None
                                   and len(self.replicas) == len(self.blocks) and not self.padded
                                   and all(_is_int(r) and r > 0 for r in self.replicas))),
                               ("period", self.period is None or (
                                   _is_int(self.period) and self.period > 0 and not self.padded
                                   and sum(self.blocks or [self.period]) == self.period)))
               if not ok]
        if bad:
            raise LayoutError(f"Shard({self.dim!r}, blocks={self.blocks!r}, "
                              f"padded={self.padded!r}, replicas={self.replicas!r}, "
                              f"period={self.period!r}) has an invalid {' and '.join(bad)}",
                              fix="dim is an int; blocks a non-empty tuple of positive ints or "
                                  "None; padded a positive int or None; replicas >= 1; period "
                                  "None or the blocks' sum, not padded")

    @classmethod
    def _parse(cls, text: str) -> Shard:
        m = _SHARD.fullmatch(text)
        fields: dict[str, Any] = {}  # Shard's keyword arguments
        value: int | tuple[int, ...]
        for part in (m.group(2).split("|")[1:] if m else ()):
            if re.fullmatch(r"pad\d+", part):
                key, value = "padded", int(part[3:])
            elif re.fullmatch(r"x\d+(\+\d+)*", part):
                reps = tuple(int(r) for r in part[1:].split("+"))
                key, value = "replicas", reps if len(reps) > 1 else reps[0]
            elif re.fullmatch(r"per\d+", part):
                key, value = "period", int(part[3:])
            elif re.fullmatch(r"\d+(\+\d+)*", part):
                key, value = "blocks", tuple(int(b) for b in part.split("+"))
            else:
                m = None
                break
            if key in fields:
                m = None
                break
            fields[key] = value
        if m is None:
            raise LayoutError(f"not a layout: {text!r}",
                              fix='write "R", "P" or "S(dim[|b1+b2+..][|padN][|xR][|perN])", '
                                  'e.g. "S(0|32+32+32|pad128|x2)" or "S(0|64+16+16|x1+4+4)"')
        try:
            return cls(int(m.group(1)), **fields)
        except LayoutError as e:
            raise LayoutError(f"not a layout: {text!r} ({e.what})", fix=e.fix) from None

    def __str__(self) -> str:
        extra = ""
        if self.blocks:
            extra += "|" + "+".join(map(str, self.blocks))
        if self.padded:
            extra += f"|pad{self.padded}"
        if isinstance(self.replicas, tuple):  # blocked_replicas, spelled so the type narrows
            extra += "|x" + "+".join(map(str, self.replicas))
        elif self.replicas > 1:
            extra += f"|x{self.replicas}"
        if self.period:
            extra += f"|per{self.period}"
        return f"S({self.dim}{extra})"

    def to_json(self) -> dict:
        d = {"type": "shard", "dim": self.dim,
             "blocks": list(self.blocks) if self.blocks else None,
             "padded": self.padded,
             "replicas": list(self.replicas) if isinstance(self.replicas, tuple) else self.replicas}
        return {**d, "period": self.period} if self.period else d

    @property
    def blocked_replicas(self) -> bool:
        """Do the blocks carry counts of their own (``x1+4+4``)?"""
        return isinstance(self.replicas, tuple)

    def block_replicas(self) -> tuple[int, ...]:
        """The ranks holding each part, per block (one entry for an unblocked shard)."""
        if isinstance(self.replicas, tuple):
            return self.replicas
        return (self.replicas,) * len(self.blocks or (None,))

    def local_blocks(self, tp: int) -> tuple[int, ...]:
        """Each block's size on one rank (of a blocked shard)."""
        return tuple(b * r // tp for b, r in zip(self.blocks or (), self.block_replicas()))

    def local_size(self, full: int, tp: int) -> int:
        if isinstance(self.replicas, tuple):
            return sum(self.local_blocks(tp))
        return (self.padded or full) * self.replicas // tp

    def slice(self, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """This rank's part of the full tensor ``t`` (a copy)."""
        if self.period:  # [n*P] -> [n, P]: the shard applies to each run of P
            d = self.dim % t.dim()
            inner = Shard(d + 1, self.blocks, None, self.replicas)
            return inner.slice(t.unflatten(d, (-1, self.period)), rank, tp).flatten(d, d + 1)
        if self.padded and self.padded > t.shape[self.dim]:
            pad = list(t.shape)
            pad[self.dim] = self.padded - t.shape[self.dim]
            t = torch.cat([t, t.new_zeros(pad)], self.dim)
        segments = t.split(list(self.blocks), self.dim) if self.blocks else [t]
        return torch.cat([s.chunk(tp // r, self.dim)[rank // r]
                          for s, r in zip(segments, self.block_replicas())], self.dim).clone()

    def unshard(self, parts: list[torch.Tensor], full: int, copy: int = 0) -> torch.Tensor:
        """The full tensor from every rank's part (in rank order); drops padding. A part
        held by r ranks is read from the ``copy % r``-th of them."""
        if self.period:
            d = self.dim % parts[0].dim()
            inner = Shard(d + 1, self.blocks, None, self.replicas)
            local = self.local_size(self.period, len(parts))
            runs = [p.unflatten(d, (-1, local)) for p in parts]
            return inner.unshard(runs, self.period, copy).flatten(d, d + 1)
        tp = len(parts)
        if isinstance(self.replicas, tuple):  # block i from ranks c, c + r_i, c + 2 r_i, ...
            pieces = [p.split(list(self.local_blocks(tp)), self.dim) for p in parts]
            return torch.cat([torch.cat([pc[i] for pc in pieces[copy % r::r]], self.dim)
                              for i, r in enumerate(self.replicas)], self.dim)
        parts = parts[copy % self.replicas::self.replicas]
        tp = len(parts)
        if self.blocks:
            pieces = [p.split([b // tp for b in self.blocks], self.dim) for p in parts]
            segs = [torch.cat([pc[i] for pc in pieces], self.dim) for i in range(len(self.blocks))]
            out = torch.cat(segs, self.dim)
        else:
            out = torch.cat(parts, self.dim)
        return out.narrow(self.dim, 0, full)


Layout = Replicate | Shard | Partial


def _is_int(v) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


_DIM_NAME = re.compile(r"[A-Za-z_]\w*")


class MeshDim(str, enum.Enum):
    """The parallel dimensions by name, outer to inner as torchtitan orders its mesh:
    pipeline stages, data-parallel replicas (HSDP's replicate dim), FSDP2 shards,
    context parallelism (reserved) and tensor parallelism. A member is its name
    (``MeshDim.TP == "tp"``), so a ``DeviceMesh`` built with these names reads them."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, eq=False)
class MeshSizes(Mapping):
    """The number of ranks along each parallel dimension, outer to inner, as an immutable
    mapping: ``MeshSizes.of(dp_shard=2, tp=4)[MeshDim.TP] == 4``, ``.tp`` too. A
    dimension not listed is not parallelized (``.get(dim, 1)``)."""

    sizes: tuple[tuple[MeshDim, int], ...]

    def __post_init__(self):
        items = self.sizes.items() if isinstance(self.sizes, Mapping) else self.sizes
        sizes = {}
        for name, n in items:
            dim = _mesh_dim(name)
            if not _is_int(n) or n < 1 or dim in sizes:
                raise ConfigurationError(
                    f"mesh dimension {dim} of size {n!r}"
                    + (" is given twice" if dim in sizes else ""),
                    fix="give each mesh dimension once, as a positive integer, e.g. tp=4")
            sizes[dim] = n
        order = list(MeshDim)
        object.__setattr__(self, "sizes", tuple(sorted(sizes.items(),
                                                       key=lambda kv: order.index(kv[0]))))

    @classmethod
    def of(cls, **sizes: int) -> MeshSizes:
        return cls(tuple((_mesh_dim(name), n) for name, n in sizes.items()))

    def __getitem__(self, dim: MeshDim | str) -> int:
        for d, n in self.sizes:
            if d == dim:
                return n
        raise KeyError(dim)

    def __iter__(self):
        return (d for d, _ in self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def __hash__(self) -> int:
        return hash(self.sizes)

    @property
    def tp(self) -> int:
        return self.get(MeshDim.TP, 1)

    def __str__(self) -> str:
        return ",".join(f"{d}={n}" for d, n in self.sizes)


def _mesh_dim(name) -> MeshDim:
    try:
        return MeshDim(name)
    except ValueError:
        raise ConfigurationError(f"no mesh dimension named {name!r}",
                                 fix="name one of " + ", ".join(d.value for d in MeshDim)) \
            from None


@dataclass(frozen=True)
class MeshLayout:
    """A placement per named mesh dimension, outer to inner: ``MeshLayout.of(dp=R, tp=S(0))``."""

    dims: tuple[tuple[str, Placement], ...]

    def __post_init__(self):
        object.__setattr__(self, "dims", tuple((n, p) for n, p in self.dims))
        names = [n for n, _ in self.dims]
        if not names or len(set(names)) != len(names) or \
                not all(isinstance(n, str) and _DIM_NAME.fullmatch(n) for n in names):
            raise LayoutError(f"mesh dimension names {names} must be distinct identifiers, "
                              "at least one", fix='name them like a DeviceMesh: ("dp", "tp")')
        bad = [n for n, p in self.dims if not isinstance(p, Placement)]
        if bad:
            raise LayoutError(f"mesh dimension {bad[0]!r} has no placement",
                              fix="give each dimension Replicate(), Shard(...) or Partial()")

    @classmethod
    def of(cls, **placements: Placement) -> MeshLayout:
        return cls(tuple(placements.items()))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.dims)

    def __getitem__(self, name: str) -> Placement:
        for n, p in self.dims:
            if n == name:
                return p
        raise KeyError(name)

    def get(self, name: str, default: Placement | None = None) -> Placement | None:
        return next((p for n, p in self.dims if n == name), default)

    def __str__(self) -> str:
        return ",".join(f"{n}={p}" for n, p in self.dims)

    @classmethod
    def parse(cls, text: str) -> MeshLayout:
        """The mesh layout whose ``str()`` is ``text``; ``LayoutError`` if there is none."""
        if not isinstance(text, str):
            raise LayoutError(f"a mesh layout is text, got {type(text).__name__}",
                              fix='pass a string such as "dp=R,tp=S(0)"')
        dims = []
        for item in text.split(","):
            name, eq, placement = item.partition("=")
            if not eq:
                raise LayoutError(f"not a mesh layout: {text!r}",
                                  fix='write name=placement per mesh dim, e.g. "dp=R,tp=S(0)"')
            dims.append((name.strip(), Placement.parse(placement)))
        return cls(tuple(dims))


@dataclass(frozen=True)
class ParallelSpec:
    """What a tensor of a sharded module is: its mesh layout and full (unpadded) shape."""

    layout: MeshLayout
    shape: tuple[int, ...]


_SPEC = "_shardplan_spec"


def set_spec(t: torch.Tensor, spec: ParallelSpec) -> torch.Tensor:
    """Attach ``spec`` to ``t`` (as Megatron's ``tensor_model_parallel`` travels on a parameter)."""
    setattr(t, _SPEC, spec)
    return t


def spec_of(t: torch.Tensor) -> ParallelSpec | None:
    """The spec ``set_spec`` attached to ``t``; None for a tensor of no sharded module."""
    return getattr(t, _SPEC, None)

