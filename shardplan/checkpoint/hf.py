"""Full (unsharded) weights: Hugging Face safetensors folders in and out through DCP's
HF storage, an in-memory state dict in, the full state dict gathered out.

    load_full_state_dict(sharded, "hf_folder/")     # or one .safetensors file, or an index
    load_full_state_dict(sharded, model.state_dict())
    save_hf(sharded, "out/")                        # a folder from_pretrained loads
    export_hf("ck/", "out/", config="hf_folder/")   # a checkpoint.save directory, offline
    full = gather_full_state_dict(sharded)          # on rank 0, None elsewhere

A folder is what ``save_pretrained`` writes: one ``model.safetensors``, or
several files listed by ``model.safetensors.index.json`` (its ``weight_map``).
Each rank reads only its chunks of each tensor (``HuggingFaceStorageReader``:
safetensors slices, per block for fused layouts; padding rows stay zero).
Names, shapes, dtypes and the index are checked first; every error names the
key and the file.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from ..errors import CheckpointError
from ..layouts import Shard
from ..runtime.consistency import agree
from .chunks import LoadPlanner, chunks_of
from .dcp import commit_dir, quietly, read_metadata, save, shardplan_info, world_of
from .entries import Entry, entries_of, load_targets, match_names, set_local

__all__ = ["load_full_state_dict", "gather_full_state_dict", "save_hf", "export_hf"]

INDEX = "model.safetensors.index.json"


class _Listed(FileSystem):
    """The files of a folder that an HF reader lists: those of the index, or the one given."""

    def __init__(self, files: list[Path]):
        super().__init__()
        self.files = [str(f) for f in files]

    def ls(self, path) -> list[str]:
        return list(self.files)


def _files(path: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """(the safetensors files at ``path``, the index's name -> file or None)."""
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json"))
        if len(indexes) == 1:
            return _files(indexes[0])
        files = sorted(path.glob("*.safetensors"))
        if len(indexes) > 1 or not files:
            raise CheckpointError(f"{path} holds {'several indexes' if indexes else 'no safetensors file'}",
                                  where=str(path), fix="pass the file or the index to load")
        return files, None
    if path.name.endswith(".json"):
        weight_map = _read_index(path)
        return sorted(set(weight_map.values())), weight_map
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist", where=str(path),
                              fix="pass a .safetensors file, an index .json or their folder")
    return [path], None


def _read_index(path: Path) -> dict[str, Path]:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not readable JSON: {e}", where=str(path),
                              fix="the index is corrupt: save the checkpoint again") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path} has no weight_map of tensor name -> file name",
                              where=str(path), fix="pass an index written by save_pretrained")
    files = {name: path.parent / file for name, file in weight_map.items()}
    absent = sorted({f.name for f in files.values() if not f.is_file()})
    if absent:
        key = next(k for k, f in files.items() if f.name == absent[0])
        raise CheckpointError(f"{path} names {absent[:4]} (e.g. for {key}), which do not exist",
                              where=str(path.parent / absent[0]),
                              fix="the checkpoint is incomplete: copy every file the index lists")
    return files


def _reader(path: Path) -> tuple[HuggingFaceStorageReader, dict[str, tuple]]:
    """(a reader of the files at ``path``, name -> (shape, dtype, file) of each tensor)."""
    files, declared = _files(path)
    for file in files:  # the header of each, so that an unreadable one is named
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file} is not a readable safetensors file: {e}",
                                  where=str(file), fix="the file is truncated or corrupt: "
                                                       "use another checkpoint") from None
    reader = HuggingFaceStorageReader(str(files[0].parent))
    reader.fs = _Listed(files)
    md = reader.read_metadata()
    file_of = {i.fqn: Path(s.relative_path) for i, s in md.storage_data.items()}
    for file in files if declared else ():
        lost = sorted(k for k, f in declared.items() if f == file and file_of.get(k) != file)
        if lost:
            raise CheckpointError(f"{file.name} lacks {lost[:4]} that the index of {path} "
                                  "places there", where=str(file),
                                  fix="the index and the files disagree: the checkpoint is "
                                      "incomplete or mixed up")
    found = {k: (list(m.size), m.properties.dtype, file_of[k])
             for k, m in md.state_dict_metadata.items()}
    return reader, found


def load_full_state_dict(sharded, source, *, strict: bool = True) -> None:
    """Load FULL (unsharded) weights into ``sharded``: each rank takes only its slices.

    ``source`` is a dict of tensors, or a path: one .safetensors file, a
    ``*.safetensors.index.json`` as ``save_pretrained`` writes for several
    files, or a folder holding either. A tied tensor may appear under any of
    its names. ``strict``: names the model does not have are an error. Names,
    shapes and dtypes are checked before anything is copied. Collective.
    """
    is_path = isinstance(source, (str, os.PathLike))
    if not is_path and not isinstance(source, Mapping):
        raise CheckpointError(f"expected a state dict or a .safetensors path, got "
                              f"{type(source).__name__}", fix="pass model.state_dict() or a file")
    where = str(source) if is_path else "state dict"
    rank, tp = sharded.group.rank, sharded.group.size

    def from_files():
        reader, found = _reader(Path(source))
        entries = entries_of(sharded)
        chosen = match_names(found, entries, where, strict)
        targets, finish = load_targets(sharded, entries)
        state = {chosen[e.fqn]: chunks_of(targets[e.fqn], e, rank, tp) for e in entries}
        quietly(dcp.load, state, storage_reader=reader, planner=LoadPlanner(), no_dist=True)
        finish()

    def from_dict():
        entries = entries_of(sharded)
        found = {k: (list(v.shape), v.dtype, where) for k, v in source.items()}
        chosen = match_names(found, entries, where, strict)
        for e in entries:
            full = source[chosen[e.fqn]].detach()  # slices are copies; a replica must be too
            local = e.layout.slice(full, rank, tp) if isinstance(e.layout, Shard) else full.clone()
            set_local(sharded, {e.fqn: local.to(e.tensor.dtype)}, entries)

    agree(sharded.group, f"load_full_state_dict({where})", from_files if is_path else from_dict,
          error=CheckpointError)


def _gather(sharded, e: Entry) -> torch.Tensor:
    """The full, unpadded tensor of one entry, on every rank."""
    t = e.tensor.detach()
    if not isinstance(e.layout, Shard):
        return t.clone()
    parts = sharded.group.all_gather(t.unsqueeze(0), 0).unbind(0)
    return e.layout.unshard(list(parts), e.shape[e.layout.dim]).clone()


def gather_full_state_dict(sharded) -> dict[str, torch.Tensor] | None:
    """The original model's full ``state_dict`` (every alias key) on rank 0; None elsewhere.

    Collective over the TP group: all-gathers one tensor at a time. Padding is
    dropped, so the result loads into the unsharded class with
    ``load_state_dict(strict=True)``.
    """
    full: dict[str, torch.Tensor] = {}
    for e in entries_of(sharded):
        t = _gather(sharded, e)
        full.update(dict.fromkeys([e.fqn, *e.aliases], t))
    if sharded.group.rank != 0:
        return None
    return {n: full[n] for n in sharded.state_dict(keep_vars=True)}


def _file_indices(tensors: dict[str, torch.Tensor], shard_bytes: int) -> dict[str, int]:
    """Each tensor's file (1, 2, ...): in order, a new file once ``shard_bytes`` is full."""
    out, index, used = {}, 1, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        if used and used + size > shard_bytes:
            index, used = index + 1, 0
        out[name], used = index, used + size
    return out


def export_hf(checkpoint, folder, *, config=None, shard_bytes: int = 5 * 2**30) -> None:
    """Write the weights of a ``checkpoint.save`` directory as a Hugging Face folder.

    One process, offline: the full model is read (DCP resharding to full
    tensors), a tied weight once, and written by ``HuggingFaceStorageWriter``
    in files of at most about ``shard_bytes`` with their index. ``config``:
    a folder whose ``config.json`` (and generation config) is copied, or an
    object with ``save_pretrained`` (a transformers config), so that
    ``from_pretrained(folder)`` loads it. ``folder`` is replaced atomically.
    """
    src, out = Path(checkpoint), Path(folder)
    metadata = read_metadata(src)
    tied = shardplan_info(src, metadata).get("tied", {})
    full = {k[len("model."):]: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for k, m in metadata.items() if k.startswith("model.") and k[len("model."):] not in tied}
    quietly(dcp.load, {"model": full}, checkpoint_id=str(src), no_dist=True)
    if out.exists() and any(out.iterdir()) and not (out / INDEX).is_file():
        raise CheckpointError(f"refusing to replace {out}: it holds no {INDEX}", where=str(out),
                              fix="choose a new or empty directory")
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    writer = HuggingFaceStorageWriter(str(tmp), fqn_to_index_mapping=_file_indices(full, shard_bytes))
    quietly(dcp.save, full, storage_writer=writer, no_dist=True)
    if isinstance(config, (str, os.PathLike)):
        for name in ("config.json", "generation_config.json"):
            if (Path(config) / name).is_file():
                shutil.copy(Path(config) / name, tmp / name)
    elif config is not None:
        config.save_pretrained(tmp)
    commit_dir(tmp, out, marker=INDEX)


def save_hf(sharded, folder, *, shard_bytes: int = 5 * 2**30) -> None:
    """Save ``sharded``'s weights as a Hugging Face folder (``from_pretrained`` loads it),
    with the source model's config if it has one. Collective: a ``checkpoint.save``
    next to ``folder``, which rank 0 then exports (``export_hf``) and removes."""
    folder = Path(folder)
    staging = folder.parent / f".{folder.name}.dcp"
    save(sharded, staging)
    config = getattr(sharded.source, "config", None)

    def export():
        try:
            export_hf(staging, folder, config=config, shard_bytes=shard_bytes)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    world = world_of(sharded)
    agree(world, f"save_hf({folder})", export if world.rank == 0 else lambda: None,
          error=CheckpointError)
