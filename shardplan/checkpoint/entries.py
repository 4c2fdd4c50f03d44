"""The sharded module's tensors as checkpoint entries: one per distinct tensor (a tied
weight is one), with its placement over the TP group and full shape read from the
tensor's spec (``layouts.spec_of``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from ..layouts import MeshDim, Partial, Replicate, Shard, spec_of
from ..planner.shards import local_shape


@dataclass
class Entry:
    """One distinct tensor of the sharded module (a tied weight is one entry)."""

    fqn: str  # the first name in state_dict order
    aliases: list[str]  # its other names
    tensor: torch.Tensor  # this rank's part
    layout: Replicate | Shard
    shape: tuple[int, ...]  # the full, unpadded shape

    @property
    def key(self) -> str:
        return f"model/{self.fqn}"


def entries_of(sharded) -> list[Entry]:
    """Every distinct tensor of ``sharded.state_dict()`` with its layout and full shape."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in sharded.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    tp = sharded.group.size
    out = []
    for tid, group in names.items():
        t = tensors[tid]
        spec = spec_of(t)
        lay = _normal_dim(spec.layout[MeshDim.TP] if spec else Replicate(), t.dim(), group[0])
        full = spec.shape if spec else tuple(t.shape)
        if local_shape(full, lay, tp) != tuple(t.shape):
            raise CheckpointError(f"{group[0]}: this rank holds {list(t.shape)}, but layout {lay} "
                                  f"of {list(full)} over tp={tp} gives "
                                  f"{list(local_shape(full, lay, tp))}",
                                  where=group[0], fix="this is a planner bug: report it")
        out.append(Entry(group[0], group[1:], t, lay, tuple(full)))
    return out


def _normal_dim(lay, ndim: int, fqn: str):
    if isinstance(lay, Partial):
        raise CheckpointError(f"{fqn} is held as partial sums, which cannot be saved as they are",
                              where=fqn, fix="only parameters and buffers are saved; "
                                             "they must be replicated or sharded")
    if isinstance(lay, Shard) and lay.dim < 0:
        return Shard(lay.dim % ndim, lay.blocks, lay.padded, lay.replicas)
    return lay


def same_layout(a, b, shape, tp: int) -> bool:
    """Whether two layouts hold the same part of a tensor on every rank."""
    def norm(lay):
        if not isinstance(lay, Shard):
            return ("R",)
        padded = None if lay.padded in (None, shape[lay.dim]) else lay.padded
        blocks = lay.blocks if lay.blocks and len(lay.blocks) > 1 else None
        if tp == lay.replicas and padded is None:  # every rank holds all of it
            return ("R",)
        return ("S", lay.dim, blocks, padded, lay.replicas)
    return norm(a) == norm(b)


def set_local(sharded, values: dict[str, torch.Tensor], entries: list[Entry]) -> None:
    """Copy local tensors into the module: in place, or by replacement where still on meta."""
    by_fqn = {e.fqn: e for e in entries}
    meta = {}
    with torch.no_grad():
        for fqn, v in values.items():
            t = by_fqn[fqn].tensor
            if t.is_meta:
                meta[fqn] = v.to(t.dtype)
            else:
                t.copy_(v)
    if meta:
        sharded.load_local_(meta)
