"""The checkpoint format's names: its tag and version, the index file, the rank files,
and the index record of one tensor."""

from __future__ import annotations

from ..errors import CheckpointError, LayoutError
from ..layouts import Placement, Replicate, Shard
from ..planner.shards import local_shape
from .files import dtype_name

FORMAT = "shardplan-checkpoint"
VERSION = 1
INDEX = "index.json"


def rank_file(rank: int, tp: int) -> str:
    """The name of rank ``rank``'s file in a checkpoint of ``tp`` ranks."""
    return f"rank{rank:05d}-of-{tp:05d}.safetensors"


def tensor_record(fqn, aliases, lay, shape, dtype, tp, kind) -> dict:
    return {"kind": kind, "fqn": fqn, "aliases": list(aliases), "layout": lay.to_json(),
            "shape": list(shape), "local_shape": list(local_shape(shape, lay, tp)),
            "dtype": dtype_name(dtype)}


def layout_of(record: dict, where: str) -> Replicate | Shard:
    """The placement a tensor record holds (``Placement.from_json``), as a checkpoint error."""
    try:
        lay = Placement.from_json(record["layout"])
    except (KeyError, LayoutError):
        lay = None
    if not isinstance(lay, (Replicate, Shard)):
        raise CheckpointError(f"unknown layout {record.get('layout')!r}", where=where,
                              fix="the index was written by another shardplan version or "
                                  "edited by hand")
    return lay
