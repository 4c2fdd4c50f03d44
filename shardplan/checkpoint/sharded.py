"""Sharded checkpoints: every rank saves and loads its own shards (and optimizer state)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import CheckpointError
from .agreement import agree
from .atomic import commit_dir, partial_dir, prepare_dir, read_index
from .entries import Entry, entries_of, same_layout, set_local
from .files import Writer, open_file, read_tensor
from .index import FORMAT, VERSION, layout_of, rank_file, tensor_record
from .optimizer import optimizer_load, optimizer_state


def _extra_json(extra) -> str:
    if extra is None:
        return "null"
    if not isinstance(extra, Mapping):
        raise CheckpointError(f"extra must be a dict, got {type(extra).__name__}",
                              fix="pass extra={'step': ..., 'rng': torch.get_rng_state().tolist()}")
    for k, v in extra.items():
        try:
            json.dumps({str(k): v}, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"extra[{k!r}] is not JSON-serializable: {e}", where=f"extra[{k!r}]",
                                  fix="store plain values and lists: tensors as .tolist() "
                                      "(e.g. torch.get_rng_state().tolist())") from None
    return json.dumps(dict(extra))


def save_sharded(sharded, path, *, optimizer=None, extra: dict | None = None) -> None:
    """Save this rank's shards (and ``optimizer``'s state) into checkpoint directory ``path``.

    Collective: every rank calls it with the same ``path`` on a shared
    filesystem. ``extra`` (JSON: step, data position, RNG states as lists) is
    kept per rank and rank 0's also in the index; ``load_sharded`` returns it.
    The previous checkpoint at ``path`` stays intact until the new one is complete.
    """
    path = Path(path)
    rank, tp = sharded.group.rank, sharded.group.size

    def prepare():
        entries = entries_of(sharded)
        optim, otensors = (None, []) if optimizer is None else optimizer_state(optimizer, entries)
        return entries, optim, otensors, _extra_json(extra), prepare_dir(path) if rank == 0 else None

    entries, optim, otensors, extra_json, _ = agree(sharded, f"save_sharded({path})", prepare)
    tmp = partial_dir(path)
    tensors = [(e.key, e.tensor) for e in entries] + [(o.key, o.tensor) for o in otensors]

    def write():
        meta = {"format": "pt", "shardplan": FORMAT, "version": str(VERSION), "rank": str(rank),
                "tp": str(tp), "extra": extra_json}
        specs = [(k, t.dtype, tuple(t.shape)) for k, t in tensors]
        w = Writer(tmp / rank_file(rank, tp), specs, meta)
        try:
            for k, t in tensors:
                w.write(k, t)
            w.close()
        except BaseException:
            w.abort()
            raise

    agree(sharded, f"writing the rank files into {tmp}", write)

    def commit():
        if rank != 0:
            return
        records = {e.key: tensor_record(e.fqn, e.aliases, e.layout, e.shape, e.tensor.dtype, tp,
                                         "model") for e in entries}
        for o in otensors:
            records[o.key] = tensor_record(o.fqn, [], o.layout, o.shape, o.tensor.dtype, tp, "optim")
        plan = getattr(sharded, "plan", None)
        index = {
            "format": FORMAT, "version": VERSION, "tp": tp,
            "files": [rank_file(r, tp) for r in range(tp)],
            "model": {n: e.key for e in entries for n in [e.fqn, *e.aliases]},
            "tensors": records,
            "optimizer": optim,
            "extra": json.loads(extra_json),
            "plan": json.loads(plan.to_json()) if plan is not None else None,
            "torch": torch.__version__,
        }
        commit_dir(tmp, path, index)

    agree(sharded, f"committing {path}", commit)


def load_sharded(sharded, path, *, optimizer=None) -> dict:
    """Load this rank's shards (and ``optimizer``'s state) from a ``save_sharded`` directory.

    Collective. Checks tp, names, layouts and shapes against the model before
    changing anything. Returns the ``extra`` this rank saved ({} if none).
    """
    group = sharded.group
    rank, tp = group.rank, group.size

    def load():
        root, index = read_index(path)
        if index["tp"] != tp:
            raise CheckpointError(
                f"{root} was saved with tp={index['tp']}; this model runs tp={tp}",
                where=str(root),
                fix=f"reshard it first: shardplan.checkpoint.reshard({str(root)!r}, new_path, "
                    f"tp={tp}), or go through save_full / load_full_state_dict")
        entries = entries_of(sharded)
        _match(index, entries, root, tp)
        file = root / index["files"][rank]
        with open_file(file) as f:
            meta = f.metadata() or {}
            if meta.get("rank") != str(rank) or meta.get("tp") != str(tp):
                raise CheckpointError(f"{file.name} says rank {meta.get('rank')} of "
                                      f"{meta.get('tp')}, expected rank {rank} of {tp}",
                                      where=str(file), fix="the checkpoint directory was mixed up")
            osd = None if optimizer is None else \
                optimizer_load(optimizer, index.get("optimizer"), entries, f, file, index)
            values = {}
            for e in entries:
                key = index["model"][e.fqn]
                values[e.fqn] = read_tensor(f, key, file, index["tensors"][key]["local_shape"])
                if not e.tensor.is_meta:  # one at a time: no second copy of the model
                    set_local(sharded, {e.fqn: values.pop(e.fqn)}, entries)
            if values:
                set_local(sharded, values, entries)
            if osd is not None:
                optimizer.load_state_dict(osd)
            extra = json.loads(meta.get("extra", "null"))
        return index.get("extra") if extra is None else extra

    extra = agree(sharded, f"load_sharded({path})", load)
    return {} if extra is None else extra


def _match(index: dict, entries: list[Entry], root: Path, tp: int) -> None:
    """Raise unless the checkpoint's names, tying, shapes and layouts are the model's."""
    names = {n for e in entries for n in [e.fqn, *e.aliases]}
    missing = sorted(names - set(index["model"]))
    unexpected = sorted(set(index["model"]) - names)
    if missing or unexpected:
        parts = [f"missing {missing[:4]}" if missing else "", f"unexpected {unexpected[:4]}"
                 if unexpected else ""]
        raise CheckpointError(f"{root} does not hold this model's tensors: "
                              + "; ".join(p for p in parts if p), where=str(root),
                              fix="load a checkpoint of the same model class and configuration")
    for e in entries:
        keys = {index["model"][n] for n in [e.fqn, *e.aliases]}
        if len(keys) > 1:
            raise CheckpointError(f"{[e.fqn, *e.aliases]} are one tied tensor in the model but "
                                  f"separate in {root}", where=e.fqn,
                                  fix="load a checkpoint of the same model configuration "
                                      "(weight tying differs)")
        rec = index["tensors"][keys.pop()]
        if list(rec["shape"]) != list(e.shape):
            raise CheckpointError(f"{e.fqn} has shape {rec['shape']} in {root}, {list(e.shape)} "
                                  "in the model", where=e.fqn,
                                  fix="load a checkpoint of the same model configuration")
        saved = layout_of(rec, e.fqn)
        if not same_layout(saved, e.layout, e.shape, tp):
            raise CheckpointError(f"{e.fqn} was saved with layout {saved}, this model places it "
                                  f"as {e.layout}", where=e.fqn,
                                  fix="the plan differs (rules or model changed): go through "
                                      "save_full / load_full_state_dict")
