"""torch DCP checkpoints in the unsharded model's key space.

    save_dcp(sharded, path, optimizer=opt)     # collective: every rank of the world
    load_dcp(sharded, path, optimizer=opt)     # any tp, dp, with or without FSDP2

The checkpoint is a ``torch.distributed.checkpoint`` directory whose state
dict is ``{"model": {fqn: full tensor}, "optim": {"state": {fqn: {name:
tensor}}, "param_groups": [...]}}`` under the original model's names (every
alias of a tied weight) and full, unpadded shapes, so
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(path, file)``
gives a file whose ``["model"]`` loads strictly into the plain model, and a
load at any other layout is DCP's own resharding.

Each rank hands DCP the chunks of every global tensor it holds as
``Chunks``: a rank's blocked shard (fused QKV) is several separate chunks of
the global tensor, one per block, which no ``DTensor`` placement expresses;
under FSDP2 the chunks are cut from the rank's ``DTensor`` shard of its TP
shard. Padding rows are in no chunk: dropped on save, zero after a load.
Replicas (data-parallel ones, TP-replicated tensors, K/V heads held by
several ranks) hand in the same chunks, and DCP's planner keeps one writer
for each.

A save is atomic: DCP writes into ``.<name>.partial`` next to ``path``, and
rank 0 swaps it into place only after every rank has finished; a save that
dies halfway leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from ..layouts import Shard
from ..runtime.comm import TorchGroup
from ..runtime.consistency import agree
from .atomic import fsync_dir, swap_paths
from .entries import Entry, entries_of
from ..torch_compat import compute_local_shape_and_global_offset, flatten_state_dict, set_element

__all__ = ["save_dcp", "load_dcp", "Chunks"]


class Chunks:
    """This rank's chunks of one global tensor: (global offsets, local view) pairs.

    Implements the protocol DCP's planners ask a ``DTensor`` for (write items,
    chunk list, the tensor of one chunk), with chunks a ``DTensor`` placement
    cannot describe.
    """

    def __init__(self, shape: tuple[int, ...], pieces: list[tuple[torch.Size, torch.Tensor]]):
        self.shape, self.pieces = torch.Size(shape), pieces

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, _obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets, t.size()),
                              properties=TensorProperties.create_from_tensor(t), size=self.shape))
                for offsets, t in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets, t.size()) for offsets, t in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, t in self.pieces:
            if offsets == index.offset:
                return t
        raise CheckpointError(f"{index.fqn} has no chunk at {list(index.offset)} here",
                              where=index.fqn, fix="this is a shardplan bug: report it")


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Chunks):
            return obj.__get_tensor_shard__(index).clone()  # only the chunk, not its storage
        return super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # torch's set-up replaces the values it does not know (a Chunks) by None
        flat, mappings = flatten_state_dict(state_dict)
        chunks = {k: v for k, v in flat.items() if isinstance(v, Chunks)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for key, value in chunks.items():
            set_element(state_dict, mappings[key], value)
            self.state_dict[key] = value

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Chunks):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)


# --------------------------------------------------------------------------
# the chunks a rank holds
# --------------------------------------------------------------------------

def _segments(lay: Shard, full: int, rank: int, tp: int) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each run of the TP shard along ``lay.dim``
    that is in the full tensor (padding dropped)."""
    out, local, base = [], 0, 0
    for block, r in zip(lay.blocks or (lay.padded or full,), lay.block_replicas()):
        parts, index = tp // r, rank // r
        n = block // parts
        start = base + index * n
        keep = max(0, min(n, full - start))
        if keep:
            out.append((local, start, keep))
        local, base = local + n, base + block
    return out


def _chunks(t: torch.Tensor, entry: Entry, rank: int, tp: int) -> Chunks:
    """The chunks of ``entry``'s full tensor that ``t`` (its parameter, or a state tensor
    shaped like it) holds on this TP rank; views of ``t``'s local data."""
    row0 = 0
    if isinstance(t, DTensor):  # FSDP2's shard of the TP shard, along dim 0
        _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        row0, t = offsets[0] if offsets else 0, t.to_local()
    t = t.detach()
    full = entry.shape
    if t.dim() == 0:
        return Chunks(full, [(torch.Size(()), t)])
    lay = entry.layout
    dim, runs = (lay.dim, _segments(lay, full[lay.dim], rank, tp)) if isinstance(lay, Shard) \
        else (0, [(0, 0, full[0])])
    pieces = []
    for local, start, length in runs:
        offsets = [0] * len(full)
        if dim == 0:  # the rows of this run that this rank's FSDP2 shard holds
            lo, hi = max(local, row0), min(local + length, row0 + t.shape[0])
            if hi <= lo:
                continue
            view = t.narrow(0, lo - row0, hi - lo)
            offsets[0] = start + lo - local
        else:
            view = t.narrow(dim, local, length)
            offsets[0], offsets[dim] = row0, start
        if view.numel():
            pieces.append((torch.Size(offsets), view))
    return Chunks(full, pieces)


# --------------------------------------------------------------------------
# state dicts
# --------------------------------------------------------------------------

def _model_state(sharded, entries: list[Entry]) -> dict:
    rank, tp = sharded.group.rank, sharded.group.size
    out = {}
    for e in entries:
        chunks = _chunks(e.tensor, e, rank, tp)
        for name in (e.fqn, *e.aliases):
            out[name] = chunks
    return out


def _is_like(value, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _by_param(optimizer, entries: list[Entry]) -> dict[int, Entry]:
    by_id = {id(e.tensor): e for e in entries}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in by_id:
                raise CheckpointError("the optimizer holds a tensor that is not a parameter of "
                                      "this sharded model", where="optimizer",
                                      fix="build the optimizer from sharded.parameters()")
    return by_id


def _optim_state(sharded, optimizer, entries: list[Entry]) -> dict:
    rank, tp = sharded.group.rank, sharded.group.size
    by_id = _by_param(optimizer, entries)
    state = {}
    for p, s in optimizer.state.items():
        e = by_id[id(p)]
        state[e.fqn] = {k: _chunks(v, e, rank, tp) if _is_like(v, p) else v
                        for k, v in s.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [by_id[id(p)].fqn for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def _fresh_optim_state(optimizer, entries: list[Entry], path: Path) -> None:
    """Give every parameter the state tensors the checkpoint has for it (zeros, to be
    loaded in place): those shaped like the parameter, like it (a ``DTensor`` under
    FSDP2); the others (``step``) as saved."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    by_fqn = {e.fqn: e for e in _by_param(optimizer, entries).values()}
    for key, md in metadata.items():
        if not key.startswith("optim.state.") or not isinstance(md, TensorStorageMetadata):
            continue
        fqn, name = key[len("optim.state."):].rsplit(".", 1)
        e = by_fqn.get(fqn)
        if e is None:
            raise CheckpointError(f"the checkpoint has optimizer state for {fqn!r}, which "
                                  "this optimizer does not hold", where=str(path),
                                  fix="load into an optimizer over all of sharded.parameters()")
        p, dtype = e.tensor, md.properties.dtype
        state = optimizer.state[p]
        if name not in state:
            state[name] = torch.zeros_like(p, dtype=dtype) if tuple(md.size) == e.shape \
                and len(md.size) else torch.zeros(md.size, dtype=dtype)


# --------------------------------------------------------------------------
# save and load
# --------------------------------------------------------------------------

def save_dcp(sharded, path, optimizer: torch.optim.Optimizer | None = None,
             extra: dict | None = None) -> None:
    """Write ``sharded``'s weights (and ``optimizer``'s state) as a DCP checkpoint at
    ``path`` (a directory), atomically. ``extra``: JSON-able, the same on every rank,
    stored as the ``"extra"`` entry (JSON text). Collective over the whole world."""
    path = Path(path)
    world = TorchGroup()
    tmp = path.parent / f".{path.name}.partial"

    def prepare():
        if path.exists() and not (path / ".metadata").is_file() and any(path.iterdir()):
            raise CheckpointError(f"refusing to replace {path}: it is not a DCP checkpoint",
                                  where=str(path), fix="choose a new or empty directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a save that died
        tmp.mkdir()
    agree(world, "preparing the DCP checkpoint directory",
          prepare if world.rank == 0 else lambda: None, error=CheckpointError)
    entries = entries_of(sharded)
    state = {"model": _model_state(sharded, entries)}
    if optimizer is not None:
        state["optim"] = _optim_state(sharded, optimizer, entries)
    if extra is not None:
        state["extra"] = json.dumps(extra)
    _collective("writing the DCP checkpoint", path,
                lambda: dcp.save(state, checkpoint_id=str(tmp), planner=_SavePlanner()))
    agree(world, "committing the DCP checkpoint",
          (lambda: _commit(tmp, path)) if world.rank == 0 else lambda: None,
          error=CheckpointError)


def _collective(what: str, path: Path, fn) -> None:
    """``fn()``, a DCP save or load: DCP raises on every rank if it failed on any, as a
    ``CheckpointException`` (a ``BaseException``), which becomes a ``CheckpointError``."""
    try:
        fn()
    except CheckpointException as e:
        rank, first = min(e.failures.items())
        raise CheckpointError(f"{what} failed on rank{'s' * (len(e.failures) > 1)} "
                              f"{', '.join(map(str, sorted(e.failures)))}: "
                              f"{type(first).__name__}: {first}", where=str(path),
                              fix=f"see rank {rank}'s error (disk space, permissions, a path "
                                  "every rank shares)") from e


def _commit(tmp: Path, path: Path) -> None:
    """Swap the finished ``tmp`` into ``path``; the previous checkpoint is kept until then."""
    fsync_dir(tmp)
    if not path.exists():
        os.rename(tmp, path)
    elif swap_paths(tmp, path):
        shutil.rmtree(tmp)  # now the previous checkpoint
    else:
        old = path.parent / f".{path.name}.old"
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    fsync_dir(path.parent)


def load_dcp(sharded, path, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a ``save_dcp`` checkpoint into ``sharded`` (and ``optimizer``), whatever
    the layout it was saved from; return its ``extra`` (``{}`` if none). Collective
    over the whole world."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"no DCP checkpoint at {path} (.metadata is missing)",
                              where=str(path), fix="pass the directory save_dcp wrote")
    entries = entries_of(sharded)
    for e in entries:  # padding rows are in no chunk: zero after the load
        if isinstance(e.layout, Shard) and e.layout.padded:
            with torch.no_grad():
                (e.tensor.to_local() if isinstance(e.tensor, DTensor) else e.tensor).zero_()
    state = {"model": {e.fqn: _chunks(e.tensor, e, sharded.group.rank, sharded.group.size)
                       for e in entries}}
    if optimizer is not None:
        _fresh_optim_state(optimizer, entries, path)
        state["optim"] = _optim_state(sharded, optimizer, entries)
    has_extra = "extra" in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if has_extra:
        state["extra"] = ""
    _collective("reading the DCP checkpoint", path,
                lambda: dcp.load(state, checkpoint_id=str(path), planner=_LoadPlanner()))
    if optimizer is not None:
        _set_hyperparameters(optimizer, state["optim"]["param_groups"], path)
    return json.loads(state["extra"]) if has_extra else {}


def _set_hyperparameters(optimizer, saved: list[dict], path: Path) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint has {len(saved)} optimizer parameter groups, "
                              f"this optimizer {len(optimizer.param_groups)}", where=str(path),
                              fix="build the optimizer the way the saved one was built")
    for group, values in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in values.items() if k not in ("params", "param_names")})
