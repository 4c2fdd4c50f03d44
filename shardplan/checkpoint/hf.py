"""Full (unsharded) weights: Hugging Face folders in and out through DCP's HF storage, an
in-memory state dict in, the full state dict gathered out, an HF model in one call.

A folder is what ``save_pretrained`` writes: one ``model.safetensors``, or several
files that ``model.safetensors.index.json`` lists. Each rank reads only its chunks
(``HuggingFaceStorageReader``'s safetensors slices). Names, shapes, dtypes and the
index are checked first; every error names the key and the file.
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

from ..api import parallelize
from ..errors import CheckpointError
from ..layouts import Shard
from ..runtime.consistency import agree
from .chunks import LoadPlanner, chunks_of, entries_of, load_targets, match_names
from .dcp import commit_dir, fresh_staging, quietly, read_metadata, save, shardplan_info, world_of
from .empty import parameters_on_meta

__all__ = ["load_full_state_dict", "gather_full_state_dict", "save_hf", "export_hf",
           "load_pretrained"]

INDEX = "model.safetensors.index.json"


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
    return [path], None  # if it is no file, the reader below names it


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
    return {name: path.parent / file for name, file in weight_map.items()}


def _reader(path: Path) -> tuple[HuggingFaceStorageReader, dict[str, tuple]]:
    """(a reader of the files at ``path``, name -> (shape, dtype, file) of each tensor)."""
    files, declared = _files(path)
    for file in files:  # the header of each, so that a missing or unreadable one is named
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            held = next((f" (e.g. for {k})" for k, f in (declared or {}).items() if f == file), "")
            raise CheckpointError(f"{file} is not a readable safetensors file{held}: {e}",
                                  where=str(file), fix="the file is missing, truncated or "
                                  "corrupt: copy every file the index lists again") from None
    reader = HuggingFaceStorageReader(str(files[0].parent))
    reader.fs.ls = lambda _path: [str(f) for f in files]  # those of the index, or the one given
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
    """Load full (unsharded) weights into ``sharded``, each rank only its slices, from a dict
    of tensors or a path (a .safetensors file, a ``*.safetensors.index.json``, or a folder
    of either), a tied tensor under any of its names. ``strict``: names the model lacks
    are an error. Names, shapes and dtypes are checked before anything is copied. Collective."""
    is_path = isinstance(source, (str, os.PathLike))
    if not is_path and not isinstance(source, Mapping):
        raise CheckpointError(f"expected a state dict or a .safetensors path, got "
                              f"{type(source).__name__}", fix="pass model.state_dict() or a file")
    where = str(source) if is_path else "state dict"

    def run():
        entries = entries_of(sharded)
        if is_path:
            reader, found = _reader(Path(source))
        else:
            found = {k: (list(v.shape), v.dtype, where) for k, v in source.items()}
        chosen = match_names(found, entries, where, strict)
        targets, finish = load_targets(sharded, entries)
        rank, tp = sharded.group.rank, sharded.group.size
        state = {chosen[e.fqn]: chunks_of(targets[e.fqn], e, rank, tp) for e in entries}
        if is_path:
            quietly(dcp.load, state, storage_reader=reader, planner=LoadPlanner(), no_dist=True)
        else:
            _copy_chunks(source, state)
        finish()

    agree(sharded.group, f"load_full_state_dict({where})", run, error=CheckpointError)


def _copy_chunks(source: Mapping[str, torch.Tensor], state: dict) -> None:
    """Each chunk of ``state`` (name -> ``Chunks``) copied from ``source``'s full tensor."""
    with torch.no_grad():
        for name, chunks in state.items():
            for offsets, view in chunks.pieces:
                at = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))
                view.copy_(source[name][at])


def gather_full_state_dict(sharded) -> dict[str, torch.Tensor] | None:
    """The original model's full ``state_dict`` (every alias key; padding dropped, so it
    loads strictly into the unsharded class) on rank 0; None elsewhere. Collective over
    the TP group: one all-gather per sharded tensor."""
    full: dict[str, torch.Tensor] = {}
    for e in entries_of(sharded):
        t = e.tensor.detach()
        if isinstance(e.layout, Shard):
            parts = sharded.group.all_gather(t.unsqueeze(0), 0).unbind(0)
            t = e.layout.unshard(list(parts), e.shape[e.layout.dim])
        full.update(dict.fromkeys([e.fqn, *e.aliases], t.clone()))
    return {n: full[n] for n in sharded.state_dict(keep_vars=True)} if sharded.group.rank == 0 \
        else None


def _file_indices(tensors: dict[str, torch.Tensor], shard_bytes: int) -> dict[str, int]:
    """Each tensor's file (1, 2, ...): in order, a new file once ``shard_bytes`` is full."""
    out, index, used = {}, 1, 0
    for name, t in tensors.items():
        if used and used + t.nbytes > shard_bytes:
            index, used = index + 1, 0
        out[name], used = index, used + t.nbytes
    return out


def export_hf(checkpoint, folder, *, config=None, shard_bytes: int = 5 * 2**30) -> None:
    """Write the weights of a ``checkpoint.save`` directory as a Hugging Face folder, in one
    process: the full tensors (a tied one once) through ``HuggingFaceStorageWriter``, in files
    of at most about ``shard_bytes`` with their index. ``config`` (a folder whose config.json
    and generation config are copied, or a transformers config) lets ``from_pretrained``
    load it. ``folder`` is replaced atomically."""
    src, out = Path(checkpoint), Path(folder)
    metadata = read_metadata(src)
    tied = shardplan_info(src, metadata).get("tied", {})
    full = {k[len("model."):]: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for k, m in metadata.items() if k.startswith("model.") and k[len("model."):] not in tied}
    quietly(dcp.load, {"model": full}, checkpoint_id=str(src), no_dist=True)
    tmp = fresh_staging(out, INDEX)
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
    folder, world = Path(folder), world_of(sharded)
    staging = folder.parent / f".{folder.name}.dcp"
    save(sharded, staging)
    config = getattr(sharded.source, "config", None)
    try:
        agree(world, f"save_hf({folder})", (lambda: export_hf(staging, folder, config=config,
              shard_bytes=shard_bytes)) if world.rank == 0 else (lambda: None), error=CheckpointError)
    finally:
        if world.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)


def load_pretrained(path, *, group=None, weights=None, example_inputs=None):
    """The ``save_pretrained`` model at ``path``, built from its config with parameters on
    meta (buffers such as rotary tables computed), parallelized over ``group`` (default:
    the world) for ``example_inputs`` (default: a (2, 4) batch of ``input_ids``), then each
    rank loads its slices of ``weights`` (default: ``path``). Collective; in eval mode."""
    import transformers  # the hf extra, imported only here
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"no Hugging Face config in {path}: {e}", where=str(path),
                              fix="pass a folder written by save_pretrained") from None
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.eval()
    example = example_inputs or {"input_ids": torch.zeros(2, 4, dtype=torch.long)}
    sharded = parallelize(model, group=group, example_inputs=example, check_model=False)
    load_full_state_dict(sharded, path if weights is None else weights)
    return sharded.eval()
