"""Full (unsharded) state dicts: gathered to rank 0, saved as one safetensors file,
and loaded with each rank reading only its slices."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..layouts import Shard
from .agreement import agree
from .atomic import fsync_dir
from .entries import Entry, entries_of, set_local
from .files import Writer, owned
from .sources import open_source


def _gather(sharded, e: Entry) -> torch.Tensor:
    """The full, unpadded tensor of one entry, on every rank."""
    t = e.tensor.detach()
    if not isinstance(e.layout, Shard):
        return t.clone()
    parts = sharded.group.all_gather(t.unsqueeze(0), 0).unbind(0)
    return e.layout.unshard(list(parts), e.shape[e.layout.dim]).clone()


def gather_full_state_dict(sharded) -> dict[str, torch.Tensor] | None:
    """The original model's full ``state_dict`` (every alias key) on rank 0; None elsewhere.

    Collective: all-gathers one tensor at a time. Padding is dropped, so the
    result loads into the unsharded class with ``load_state_dict(strict=True)``.
    """
    entries = entries_of(sharded)
    rank = sharded.group.rank
    full: dict[str, torch.Tensor] = {}
    for e in entries:
        t = _gather(sharded, e)
        if rank == 0:
            for n in [e.fqn, *e.aliases]:
                full[n] = t
    if rank != 0:
        return None
    return {n: full[n] for n in sharded.state_dict(keep_vars=True)}


def save_full(sharded, file) -> None:
    """Write the full state dict as one .safetensors file (rank 0 writes; tied tensors once).

    Collective. Streams: rank 0 holds about one full tensor at a time. The
    file is replaced atomically. Load it into the unsharded model with
    ``safetensors.torch.load_model(model, file)``, or into a sharded one
    with ``load_full_state_dict``.
    """
    file = Path(file)
    rank = sharded.group.rank
    tmp = file.parent / f".{file.name}.partial"
    entries = entries_of(sharded)

    def open_writer():
        if rank != 0:
            return None
        if file.is_dir():
            raise CheckpointError(f"{file} is a directory", where=str(file),
                                  fix="pass a file name such as model.safetensors")
        file.parent.mkdir(parents=True, exist_ok=True)
        aliases = {a: e.fqn for e in entries for a in e.aliases}
        return Writer(tmp, [(e.fqn, e.tensor.dtype, e.shape) for e in entries],
                       {"format": "pt", "shardplan": "full", "aliases": json.dumps(aliases)})

    writer = agree(sharded, f"save_full({file})", open_writer)
    err = None
    for e in entries:
        t = _gather(sharded, e)  # every rank takes part, even after a write error
        if writer is not None and err is None:
            try:
                writer.write(e.fqn, t)
            except Exception as ex:
                err = ex

    def finish():
        if writer is None:
            return
        if err is not None:
            writer.abort()
            tmp.unlink(missing_ok=True)
            raise err
        writer.close()
        os.replace(tmp, file)
        fsync_dir(file.parent)

    agree(sharded, f"save_full({file})", finish)


def load_full_state_dict(sharded, source, *, strict: bool = True) -> None:
    """Load a FULL (unsharded) state dict into ``sharded``: each rank takes only its slices.

    ``source`` is a dict of tensors, or a checkpoint path: one .safetensors
    file, a ``*.safetensors.index.json`` as ``save_pretrained`` writes for
    several files, or a folder holding either. From files each rank
    memory-maps only the files holding its tensors and reads just its ranges
    (per block for fused layouts, zeros for padding), never a whole sharded
    tensor. A tied tensor may appear under any of its names. ``strict``:
    names the model does not have are an error. Names, shapes and dtypes are
    checked before anything is copied. Collective.
    """
    is_file = isinstance(source, (str, os.PathLike))
    if not is_file and not isinstance(source, Mapping):
        raise CheckpointError(f"expected a state dict or a .safetensors path, got "
                              f"{type(source).__name__}", fix="pass model.state_dict() or a file")
    where = str(source) if is_file else "state dict"
    group = sharded.group

    def load():
        entries = entries_of(sharded)
        with (open_source(source) if is_file else contextlib.nullcontext(source)) as src:
            chosen = _match(src, entries, where, strict, is_file)
            values = {}
            for e in entries:
                name = chosen[e.fqn]
                if is_file:
                    local = _read_local(src, name, e, group.rank, group.size)
                else:
                    full = src[name].detach()  # slices are copies; a replica must be too
                    local = e.layout.slice(full, group.rank, group.size) \
                        if isinstance(e.layout, Shard) else full.clone()
                values[e.fqn] = local
                if not e.tensor.is_meta:
                    set_local(sharded, {e.fqn: values.pop(e.fqn)}, entries)
            if values:
                set_local(sharded, values, entries)

    agree(sharded, f"load_full_state_dict({where})", load)


def _match(src, entries: list[Entry], where: str, strict: bool, is_file: bool) -> dict[str, str]:
    """Each entry's name in ``src``; raises on missing/unexpected names, shapes, dtypes."""
    keys = set(src.keys())
    chosen, missing = {}, []
    for e in entries:
        name = next((n for n in [e.fqn, *e.aliases] if n in keys), None)
        if name is None:
            missing.append(e.fqn)
        chosen[e.fqn] = name
    names = {n for e in entries for n in [e.fqn, *e.aliases]}
    unexpected = sorted(keys - names) if strict else []
    if missing or unexpected:
        parts = [f"missing {missing[:4]}" if missing else "",
                 f"unexpected {unexpected[:4]}" if unexpected else ""]
        at = f" (e.g. {unexpected[0]} in {src.file_of(unexpected[0])})" if unexpected and is_file else ""
        raise CheckpointError(f"{where} does not match the model: "
                              + "; ".join(p for p in parts if p) + at, where=where,
                              fix="pass the full state dict of the same model class and "
                                  "configuration (strict=False ignores extra names)")
    for e in entries:
        name = chosen[e.fqn]
        file = src.file_of(name) if is_file else where
        if is_file:
            sl = src.get_slice(name)
            shape, dtype = list(sl.get_shape()), sl.get_dtype()
        else:
            shape, dtype = list(src[name].shape), src[name].dtype
        if shape != list(e.shape):
            raise CheckpointError(f"{name} has shape {shape} in {file}, the model "
                                  f"{list(e.shape)}", where=f"{name} in {file}",
                                  fix="load weights of the same model configuration")
        if not _castable(dtype, e.tensor.dtype):
            raise CheckpointError(f"{name} is {dtype} in {file}; the model holds it as "
                                  f"{e.tensor.dtype}, which it cannot be cast to",
                                  where=f"{name} in {file}",
                                  fix="load weights of the same model (floating point weights "
                                      "go into floating point tensors)")
    return chosen


_FLOAT_NAMES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def _castable(stored, target: torch.dtype) -> bool:
    """Floating point goes to floating point, integers/bools to integers/bools."""
    is_float = stored in _FLOAT_NAMES if isinstance(stored, str) else stored.is_floating_point
    return is_float == target.is_floating_point


def _read_local(f, name: str, e: Entry, rank: int, tp: int) -> torch.Tensor:
    """This rank's part of tensor ``name`` of safetensors file ``f``, reading only its ranges."""
    lay = e.layout
    if not isinstance(lay, Shard):
        return owned(f.get_tensor(name).to(e.tensor.dtype))
    sl = f.get_slice(name)
    d, size = lay.dim, e.shape[lay.dim]
    segments, offset = [], 0
    for b in lay.blocks or (lay.padded or size,):
        segments.append((offset, b))
        offset += b
    pieces = []
    for (offset, b), r in zip(segments, lay.block_replicas()):
        parts, index = tp // r, rank // r
        lo, hi = offset + index * (b // parts), offset + (index + 1) * (b // parts)
        if min(hi, size) > lo:
            pieces.append(sl[(slice(None),) * d + (slice(lo, min(hi, size)),)].to(e.tensor.dtype))
        if hi > max(lo, size):  # padding rows are zero
            shape = list(e.shape)
            shape[d] = hi - max(lo, size)
            pieces.append(torch.zeros(shape, dtype=e.tensor.dtype))
    return torch.cat(pieces, d) if len(pieces) > 1 else owned(pieces[0])
