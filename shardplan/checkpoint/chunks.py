"""This rank's chunks of the unsharded model's tensors, as DCP's planners ask for them.

A rank's blocked shard (fused QKV) is several separate chunks of the global
tensor, one per block, which no ``DTensor`` placement expresses; under FSDP2
the chunks are cut from the rank's ``DTensor`` shard of its TP shard. Padding
rows are in no chunk: dropped on save, left as they are (zero) on load.
Replicas hand in the same chunks, and DCP's planner keeps one writer for each.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from ..layouts import Shard
from ..torch_compat import compute_local_shape_and_global_offset, flatten_state_dict, set_element
from .entries import Entry

__all__ = ["Chunks", "SavePlanner", "LoadPlanner", "chunks_of", "segments"]


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
