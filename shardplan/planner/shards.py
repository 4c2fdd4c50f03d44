"""This rank's parameters and buffers, by the layouts an annotation gives them.

Each tensor made here carries its ``ParallelSpec`` (mesh layout and full
shape; ``layouts.spec_of``): optimizers, checkpoints and exports read it
from the tensor.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..layouts import ParallelSpec, Replicate, Shard, set_spec
from ..parallel_dims import ParallelDims


def local_tensors(model: nn.Module, layouts: dict, aliases: dict[str, str],
                  rank: int, tp: int) -> dict[str, torch.Tensor]:
    """FQN -> this rank's tensor, for every parameter and buffer of ``model``.

    ``layouts`` maps any alias of a tensor to its layout (missing: replicated).
    Sharded tensors are fresh copies of this rank's slice (empty on meta);
    replicated ones are the model's own objects. Aliases (tied weights) map
    to one object. Every tensor gets its spec (on a replicated one, the
    model's own object, replicated over every mesh dimension, and its shape).
    """
    by_canon = {aliases.get(k, k): v for k, v in layouts.items()}
    made: dict[str, torch.Tensor] = {}
    out = {}
    for fqn, canon in aliases.items():
        if canon not in made:
            full, lay = _get(model, canon), by_canon.get(canon, Replicate())
            spec = ParallelSpec(ParallelDims.layout(lay), tuple(full.shape))
            made[canon] = set_spec(_local(full, lay, rank, tp), spec)
        out[fqn] = made[canon]
    return out


def _get(model: nn.Module, fqn: str) -> torch.Tensor:
    owner, _, leaf = fqn.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, leaf)


def _local(full: torch.Tensor, lay, rank: int, tp: int) -> torch.Tensor:
    if not isinstance(lay, Shard):
        return full
    if full.is_meta:
        shp = list(full.shape)
        shp[lay.dim] = lay.local_size(shp[lay.dim], tp)
        local = torch.empty(shp, dtype=full.dtype, device="meta")
    else:
        local = lay.slice(full.detach(), rank, tp)
    if isinstance(full, nn.Parameter):
        return nn.Parameter(local, requires_grad=full.requires_grad)
    return local


def local_shape(shape: tuple[int, ...], lay, tp: int) -> tuple[int, ...]:
    if not isinstance(lay, Shard):
        return tuple(shape)
    s = list(shape)
    s[lay.dim] = lay.local_size(s[lay.dim], tp)
    return tuple(s)
