"""Layouts: how one tensor is held across the ranks of a tensor-parallel group.

Small immutable values, in the spirit of DTensor's placements:

- ``Replicate()``: every rank holds the whole tensor;
- ``Shard(dim, blocks, padded)``: rank r holds the r-th slice along ``dim``;
- ``Partial()``: every rank holds a summand, the sum is the value.

A shard may be *blocked*: ``blocks`` lists the sizes of consecutive segments
of ``dim`` (a fused QKV output is ``blocks=(H, H, H)``, a GQA one
``(Hq, Hkv, Hkv)``); rank r then holds the r-th slice of every segment,
concatenated. ``padded`` is the size ``dim`` is padded to before splitting
(a vocabulary not divisible by tp); padding rows are zero. ``replicas`` > 1
splits ``dim`` into tp/replicas parts, each held by ``replicas`` consecutive
ranks (K/V heads fewer than tp: the ranks that share a head hold it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


@dataclass(frozen=True)
class Shard:
    dim: int
    blocks: tuple[int, ...] | None = None
    padded: int | None = None
    replicas: int = 1

    def __str__(self) -> str:
        extra = ""
        if self.blocks:
            extra += "|" + "+".join(map(str, self.blocks))
        if self.padded:
            extra += f"|pad{self.padded}"
        if self.replicas > 1:
            extra += f"|x{self.replicas}"
        return f"S({self.dim}{extra})"

    def local_size(self, full: int, tp: int) -> int:
        return (self.padded or full) * self.replicas // tp

    def slice(self, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """This rank's part of the full tensor ``t`` (a copy)."""
        if self.padded and self.padded > t.shape[self.dim]:
            pad = list(t.shape)
            pad[self.dim] = self.padded - t.shape[self.dim]
            t = torch.cat([t, t.new_zeros(pad)], self.dim)
        parts, index = tp // self.replicas, rank // self.replicas
        segments = t.split(list(self.blocks), self.dim) if self.blocks else [t]
        return torch.cat([s.chunk(parts, self.dim)[index] for s in segments], self.dim).clone()

    def unshard(self, parts: list[torch.Tensor], full: int) -> torch.Tensor:
        """The full tensor from every rank's part (in rank order); drops padding."""
        parts = parts[::self.replicas]
        tp = len(parts)
        if self.blocks:
            pieces = [p.split([b // tp for b in self.blocks], self.dim) for p in parts]
            segs = [torch.cat([pc[i] for pc in pieces], self.dim) for i in range(len(self.blocks))]
            out = torch.cat(segs, self.dim)
        else:
            out = torch.cat(parts, self.dim)
        return out.narrow(self.dim, 0, full)


Layout = Replicate | Shard | Partial

