"""What torch does not know of a sharded module's tensors, for DCP's planners.

Entries: each distinct tensor (a tied weight is one) with its TP layout and full
shape (``layouts.spec_of``). Chunks: a rank's blocked shard (fused QKV) is one chunk
of the global tensor per block, which no ``DTensor`` placement expresses; under
FSDP2 they are cut from the rank's ``DTensor`` shard of its TP shard. Padding rows
are in no chunk (dropped on save, zero on load); DCP keeps one writer per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from ..layouts import MeshDim, Partial, Replicate, Shard, spec_of
from ..planner.shards import local_shape
from ..torch_compat import compute_local_shape_and_global_offset, flatten_state_dict, set_element

__all__ = ["Entry", "entries_of", "load_targets", "match_names", "Chunks", "SavePlanner",
           "LoadPlanner", "chunks_of", "segments"]


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
    by_id: dict[int, list] = {}  # id -> [the tensor, its names...]
    for name, t in sharded.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), [t]).append(name)
    tp = sharded.group.size
    out = []
    for t, *group in by_id.values():
        spec = spec_of(t)
        lay = spec.layout[MeshDim.TP] if spec else Replicate()
        if isinstance(lay, Partial):
            raise CheckpointError(f"{group[0]} is held as partial sums, which cannot be saved",
                                  where=group[0], fix="only parameters and buffers are saved; "
                                                      "they must be replicated or sharded")
        if isinstance(lay, Shard) and lay.dim < 0:
            lay = Shard(lay.dim % t.dim(), lay.blocks, lay.padded, lay.replicas)
        full = spec.shape if spec else tuple(t.shape)
        if local_shape(full, lay, tp) != tuple(t.shape):
            raise CheckpointError(f"{group[0]}: this rank holds {list(t.shape)}, but layout {lay} "
                                  f"of {list(full)} over tp={tp} gives "
                                  f"{list(local_shape(full, lay, tp))}",
                                  where=group[0], fix="this is a planner bug: report it")
        out.append(Entry(group[0], group[1:], t, lay, tuple(full)))
    return out


def load_targets(sharded, entries: list[Entry]):
    """(fqn -> the tensor to load each entry's chunks into, ``finish`` to call after): the
    module's own tensors, padding zeroed, or zeros that ``finish`` gives a meta one."""
    targets, fresh = {}, {}
    with torch.no_grad():
        for e in entries:
            t = e.tensor
            if t.is_meta:
                t = fresh[e.fqn] = torch.zeros(t.shape, dtype=t.dtype)
            elif isinstance(e.layout, Shard) and e.layout.padded:  # rows in no chunk
                (t.to_local() if isinstance(t, DTensor) else t).zero_()
            targets[e.fqn] = t
    return targets, lambda: sharded.load_local_(fresh) if fresh else None


def match_names(found: dict[str, tuple], entries: list[Entry], where: str, strict: bool) -> dict:
    """Each entry's name in ``found`` (name -> (shape, dtype, file)); raises on missing or
    unexpected names, other shapes, dtypes it cannot be cast from."""
    chosen = {e.fqn: next((n for n in [e.fqn, *e.aliases] if n in found), None) for e in entries}
    missing = [fqn for fqn, name in chosen.items() if name is None]
    names = {n for e in entries for n in [e.fqn, *e.aliases]}
    unexpected = sorted(set(found) - names) if strict else []
    if missing or unexpected:
        parts = [f"{what} {names[:4]}" for what, names in
                 (("missing", missing), ("unexpected", unexpected)) if names]
        at = f" (e.g. {unexpected[0]} in {found[unexpected[0]][2]})" if unexpected else ""
        raise CheckpointError(f"{where} does not match the model: {'; '.join(parts)}{at}",
                              where=where,
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


class Chunks:
    """This rank's chunks of one global tensor, (global offsets, local view) pairs, behind
    the protocol DCP's planners ask a ``DTensor`` for (write items, chunks, one chunk)."""

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
        return dict(self.pieces)[index.offset]  # DCP asks only for the chunks listed


class SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Chunks):
            return obj.__get_tensor_shard__(index).clone()  # only the chunk, not its storage
        return super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """Loads into ``Chunks``; reads no pickled object but plain values."""

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

    def load_bytes(self, read_item, value) -> None:
        """A non-tensor entry (JSON text, hyperparameters), unpickled ``weights_only``."""
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                    torch.load(value, weights_only=True))


def segments(lay: Shard, full: int, rank: int, tp: int) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each run of ``lay``'s shard, padding dropped."""
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


def chunks_of(t: torch.Tensor, entry: Entry, rank: int, tp: int) -> Chunks:
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
    dim, runs = (lay.dim, segments(lay, full[lay.dim], rank, tp)) if isinstance(lay, Shard) \
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
