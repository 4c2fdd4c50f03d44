"""The sharded module's tensors as checkpoint entries: one per distinct tensor (a tied
weight is one), with its placement over the TP group and full shape read from the
tensor's spec (``layouts.spec_of``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

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


def load_targets(sharded, entries: list[Entry]):
    """(fqn -> the tensor to load each entry's chunks into, a function to call after).

    The targets are the module's own tensors (their padding zeroed) or, for tensors
    still on meta, new zero tensors that ``finish()`` then hands to the module."""
    targets, fresh = {}, {}
    with torch.no_grad():
        for e in entries:
            t = e.tensor
            if t.is_meta:
                t = fresh[e.fqn] = torch.zeros(t.shape, dtype=t.dtype)
            elif isinstance(e.layout, Shard) and e.layout.padded:  # rows in no chunk
                (t.to_local() if isinstance(t, DTensor) else t).zero_()
            targets[e.fqn] = t
    return targets, lambda: set_local(sharded, fresh, entries) if fresh else None


def match_names(found: dict[str, tuple], entries: list[Entry], where: str, strict: bool) -> dict:
    """Each entry's name in ``found`` (name -> (shape, dtype, file)); raises on missing or
    unexpected names, other shapes, dtypes it cannot be cast from."""
    chosen, missing = {}, []
    for e in entries:
        chosen[e.fqn] = next((n for n in [e.fqn, *e.aliases] if n in found), None)
        if chosen[e.fqn] is None:
            missing.append(e.fqn)
    names = {n for e in entries for n in [e.fqn, *e.aliases]}
    unexpected = sorted(set(found) - names) if strict else []
    if missing or unexpected:
        parts = [f"missing {missing[:4]}" if missing else "",
                 f"unexpected {unexpected[:4]}" if unexpected else ""]
        at = f" (e.g. {unexpected[0]} in {found[unexpected[0]][2]})" if unexpected else ""
        raise CheckpointError(f"{where} does not match the model: "
                              + "; ".join(p for p in parts if p) + at, where=where,
                              fix="pass the full state dict of the same model class and "
                                  "configuration (strict=False ignores extra names)")
    for e in entries:
        name = chosen[e.fqn]
        shape, dtype, file = found[name]
        if shape != list(e.shape):
            raise CheckpointError(f"{name} has shape {shape} in {file}, the model "
                                  f"{list(e.shape)}", where=f"{name} in {file}",
                                  fix="load weights of the same model configuration")
        if dtype.is_floating_point != e.tensor.dtype.is_floating_point:
            raise CheckpointError(f"{name} is {dtype} in {file}; the model holds it as "
                                  f"{e.tensor.dtype}, which it cannot be cast to",
                                  where=f"{name} in {file}",
                                  fix="load weights of the same model (floating point weights "
                                      "go into floating point tensors)")
    return chosen
