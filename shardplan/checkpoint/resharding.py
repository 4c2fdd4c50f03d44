"""Offline resharding of a sharded checkpoint to another tp, one tensor at a time."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path

from ..errors import CheckpointError
from ..layouts import Shard
from ..planner.shards import local_shape
from .atomic import commit_dir, prepare_dir, read_index
from .files import Writer, dtype_of, open_file, read_tensor
from .index import FORMAT, VERSION, layout_of, rank_file


def reshard(src_path, dst_path, tp: int) -> None:
    """Rewrite checkpoint ``src_path`` (any tp) as ``dst_path`` for ``tp`` ranks, offline.

    Works one tensor at a time (about one full tensor in memory): reads every
    rank's part, reassembles it, and writes each new rank's slice straight
    into that rank's file. Optimizer state follows its parameter's layout.
    A padded (vocabulary) dim is re-padded for the new tp. Like save_sharded,
    ``dst_path`` is replaced atomically (it may equal ``src_path``).
    """
    if not isinstance(tp, int) or tp < 1:
        raise CheckpointError(f"tp must be a positive int, got {tp!r}")
    root, index = read_index(src_path)
    dst = Path(dst_path)
    src_tp = index["tp"]
    layouts = {}
    records = {}
    for key, rec in index["tensors"].items():
        old = layout_of(rec, key)
        new = _relayout(old, rec["shape"], tp, src_tp, key)
        layouts[key] = (old, new)
        records[key] = {**rec, "layout": new.to_json(),
                        "local_shape": list(local_shape(rec["shape"], new, tp))}
    extra_json = json.dumps(index.get("extra"))
    tmp = prepare_dir(dst)
    writers: list[Writer] = []
    try:
        with contextlib.ExitStack() as stack:
            files = [stack.enter_context(open_file(root / n)) for n in index["files"]]
            specs = [(k, dtype_of(r["dtype"], k), tuple(r["local_shape"])) for k, r in records.items()]
            for r in range(tp):
                meta = {"format": "pt", "shardplan": FORMAT, "version": str(VERSION),
                        "rank": str(r), "tp": str(tp), "extra": extra_json}
                writers.append(Writer(tmp / rank_file(r, tp), specs, meta))
            for key, rec in index["tensors"].items():
                old, new = layouts[key]
                local = rec["local_shape"]
                if isinstance(old, Shard):
                    step = old.replicas  # ranks that hold the same part: read one
                    parts = [read_tensor(f, key, root / n, local) if r % step == 0 else None
                             for r, (f, n) in enumerate(zip(files, index["files"]))]
                    full = old.unshard(parts, rec["shape"][old.dim])
                    del parts
                else:
                    full = read_tensor(files[0], key, root / index["files"][0], local)
                for r, w in enumerate(writers):
                    w.write(key, new.slice(full, r, tp) if isinstance(new, Shard) else full)
                del full
            for w in writers:
                w.close()
    except BaseException:
        for w in writers:
            w.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    out = {**index, "tp": tp, "files": [rank_file(r, tp) for r in range(tp)], "tensors": records,
           "plan": None, "resharded_from": {"tp": src_tp, "plan": index.get("plan")}}
    commit_dir(tmp, dst, out)


def _relayout(lay, shape, tp: int, src_tp: int, key: str):
    """The layout of the same tensor at another tp.

    Padding is recomputed for the new tp. A tensor held by groups of ranks
    (``replicas``: fewer K/V heads than tp) keeps its number of parts where
    the new tp is a multiple of it. ``load_sharded`` still compares the
    result with the layout the model actually has.
    """
    if not isinstance(lay, Shard):
        return lay
    size, replicas = shape[lay.dim], 1
    if lay.blocked_replicas:
        raise CheckpointError(f"cannot reshard {key} to tp={tp}: its blocks are held by "
                              f"different rank counts ({lay})", where=key,
                              fix="load it at the tp it was saved with (or from a full checkpoint)")
    if lay.replicas > 1:
        heads = src_tp // lay.replicas
        if tp % heads == 0:
            replicas = tp // heads
        elif heads % tp:
            raise CheckpointError(f"cannot reshard {key} to tp={tp}: it is split in {heads} "
                                  f"parts (heads), and {tp} is neither a multiple nor a divisor",
                                  where=key, fix=f"choose a tp that divides or is a multiple of {heads}")
    parts = tp // replicas
    if lay.blocks:
        if any(b % parts for b in lay.blocks):
            raise CheckpointError(f"cannot reshard {key} to tp={tp}: its blocks "
                                  f"{'+'.join(map(str, lay.blocks))} do not divide by {parts}",
                                  where=key, fix="choose a tp that divides the number of heads")
        return Shard(lay.dim, lay.blocks, None, replicas)
    padded = None if size % parts == 0 else math.ceil(size / parts) * parts
    return Shard(lay.dim, None, padded, replicas)
