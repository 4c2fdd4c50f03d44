"""torch DCP checkpoints in the unsharded model's key space: the one checkpoint format.

The state dict is ``{"model": {fqn: full tensor}, "optim": {"state": {fqn:
{name: tensor}}, "param_groups": [...]}, "extra": JSON, "shardplan": JSON}``
under the original model's names (every alias of a tied weight) and full,
unpadded shapes: ``dcp_to_torch_save``'s ``["model"]`` loads strictly into the
plain model, and a load at another layout is DCP's own resharding.
``"shardplan"`` records the tied names and the optimizer class.

A save is atomic: DCP writes into ``.<name>.partial``, which rank 0 renames to
``path`` only after DCP wrote its ``.metadata`` (last, once every rank wrote its
part); a save that dies halfway leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointError
from ..faults import inject
from ..runtime.comm import TorchGroup
from ..runtime.consistency import agree
from .chunks import (Entry, LoadPlanner, SavePlanner, chunks_of, entries_of, load_targets,
                     match_names)

__all__ = ["save", "async_save", "load", "PendingSave", "OLD_FORMAT", "read_metadata",
           "shardplan_info", "commit_dir", "fresh_staging", "quietly", "world_of"]

OLD_FORMAT = "shardplan-checkpoint"  # the retired per-rank safetensors format's index tag
_ASYNC_GROUPS: dict = {}  # the default process group -> the gloo group async saves use


def world_of(sharded):
    """The group a checkpoint step agrees over: the world when torch.distributed runs."""
    return TorchGroup() if dist.is_initialized() else sharded.group


def quietly(fn, *args, **kwargs):
    """A DCP call on a single process, without its warning that it assumes one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        return fn(*args, **kwargs)


def _by_param(optimizer, entries: list[Entry]) -> dict[int, Entry]:
    by_id = {id(e.tensor): e for e in entries}
    if any(id(p) not in by_id for g in optimizer.param_groups for p in g["params"]):
        raise CheckpointError("the optimizer holds a tensor that is not a parameter of "
                              "this sharded model", where=type(optimizer).__name__,
                              fix="build the optimizer from sharded.parameters()")
    return by_id


def _optim_state(sharded, optimizer, entries: list[Entry]) -> dict:
    rank, tp = sharded.group.rank, sharded.group.size
    by_id = _by_param(optimizer, entries)
    state = {}
    for p, s in optimizer.state.items():
        e = by_id[id(p)]
        state[e.fqn] = {k: chunks_of(v, e, rank, tp) if isinstance(v, torch.Tensor) and
                        v.dim() and v.shape == p.shape else v for k, v in s.items()}
    groups = [{**g, "params": [by_id[id(p)].fqn for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def _class_name(optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _extra_json(extra: dict) -> str:
    for k, v in extra.items():
        try:
            json.dumps({str(k): v})
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"extra[{k!r}] is not JSON-serializable: {e}", where=f"extra[{k!r}]",
                                  fix="store plain values and lists: tensors as .tolist() "
                                      "(e.g. torch.get_rng_state().tolist())") from None
    return json.dumps(extra)


def _state(sharded, optimizer, extra) -> dict:
    """What DCP saves: this rank's chunks of every tensor, under every alias."""
    entries = entries_of(sharded)
    rank, tp = sharded.group.rank, sharded.group.size
    model = {}
    for e in entries:
        model.update(dict.fromkeys([e.fqn, *e.aliases], chunks_of(e.tensor, e, rank, tp)))
    info = {"version": 2, "tied": {a: e.fqn for e in entries for a in e.aliases},
            "optimizer": None if optimizer is None else _class_name(optimizer)}
    state = {"model": model, "shardplan": json.dumps(info)}
    if optimizer is not None:
        state["optim"] = _optim_state(sharded, optimizer, entries)
    if extra is not None:
        state["extra"] = _extra_json(extra)
    return state


def staging_of(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def fresh_staging(path: Path, marker: str = ".metadata") -> Path:
    """An empty ``staging_of(path)`` to save into; refuses a ``path`` that holds something
    other than a finished save (whose last file is ``marker``)."""
    if path.exists() and not (path / marker).is_file() and any(path.iterdir()):
        raise CheckpointError(f"refusing to replace {path}: it holds no {marker}",
                              where=str(path), fix="choose a new or empty directory")
    tmp = staging_of(path)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a save that died
    tmp.mkdir(parents=True)
    return tmp


def _begin(sharded, path, optimizer, extra):
    """(the world, the state dict, the staging directory) of a save that may start."""
    path, world = Path(path), world_of(sharded)
    if not dist.is_initialized() and world.size > 1:
        raise CheckpointError(f"saving at {path} needs torch.distributed: these {world.size} "
                              "ranks are threads of one process", where=str(path),
                              fix="save from real ranks (torchrun, RealRanks)")

    def start():
        state = _state(sharded, optimizer, extra)
        if world.rank == 0:
            fresh_staging(path)
        return state

    return world, agree(world, f"saving {path}", start, error=CheckpointError), staging_of(path)


def save(sharded, path, *, optimizer: torch.optim.Optimizer | None = None,
         extra: dict | None = None) -> None:
    """Write ``sharded``'s weights (and ``optimizer``'s state) as a DCP checkpoint at
    ``path`` (a directory), atomically. ``extra``: a JSON-able dict, the same on every
    rank (``load`` returns it). Collective over the world."""
    world, state, tmp = _begin(sharded, path, optimizer, extra)
    PendingSave(lambda: quietly(dcp.save, state, checkpoint_id=str(tmp), planner=SavePlanner(),
                                no_dist=not dist.is_initialized()), world, tmp, path).wait()


class PendingSave:
    """A save under way (``async_save``): ``wait()`` for it to be written and committed."""

    def __init__(self, written, world, tmp: Path, path):
        self.written, self.world, self.tmp, self.path = written, world, tmp, Path(path)
        self.done = False

    def wait(self) -> None:
        """Block until every rank's part and the metadata are written; rank 0 then renames
        the checkpoint into place. Raises on every rank if the save failed on any."""
        if self.done:
            return
        self.done = True
        _collective("writing the checkpoint", self.path, self.written)
        inject("save")  # fault-injection tests only (shardplan.faults)
        agree(self.world, f"committing {self.path}", (lambda: commit_dir(self.tmp, self.path))
              if self.world.rank == 0 else (lambda: None), error=CheckpointError)


def async_save(sharded, path, *, optimizer: torch.optim.Optimizer | None = None,
               extra: dict | None = None) -> PendingSave:
    """``save`` through ``dcp.async_save``: returns once this rank's tensors are copied
    (training may go on and change them); the files are written in the background
    over a gloo group of its own. Call ``wait()`` before the next save. Collective."""
    world, state, tmp = _begin(sharded, path, optimizer, extra)
    if dist.is_initialized() and dist.group.WORLD not in _ASYNC_GROUPS:
        _ASYNC_GROUPS[dist.group.WORLD] = dist.new_group(backend="gloo")
    group = _ASYNC_GROUPS.get(dist.group.WORLD)  # None without torch.distributed
    future = quietly(dcp.async_save, state, checkpoint_id=str(tmp), planner=SavePlanner(),
                     process_group=group, no_dist=group is None)
    return PendingSave(future.result, world, tmp, path)


def _collective(what: str, path, fn):
    """``fn()``, a DCP save or load: DCP raises on every rank if it failed on any, as a
    ``CheckpointException`` (a ``BaseException``), which becomes a ``CheckpointError``."""
    try:
        return fn()
    except CheckpointException as e:
        rank, first = min(e.failures.items())
        raise CheckpointError(f"{what} failed on ranks {sorted(e.failures)}: "
                              f"{type(first).__name__}: {first}", where=str(path),
                              fix=f"see rank {rank}'s error (disk space, permissions, a path "
                                  "every rank shares)") from e


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_dir(tmp: Path, path: Path, marker: str = ".metadata") -> None:
    """Rename the finished ``tmp`` to ``path``; ``marker``: the file a finished save writes
    last. A previous ``path`` is first renamed to ``.<name>.old``, removed after: in
    between, ``path`` is missing, never incomplete."""
    if not (tmp / marker).is_file():
        raise CheckpointError(f"{tmp} has no {marker}: the save did not finish",
                              where=str(tmp), fix="save again")
    _fsync_dir(tmp)
    old = path.parent / f".{path.name}.old"
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)  # left by a commit that died
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(path.parent)


def read_metadata(path: Path):
    """The DCP metadata at ``path``; a clear error for a retired-format or missing one."""
    index = path / "index.json"
    if index.is_file() and OLD_FORMAT in index.read_text()[:200]:
        raise CheckpointError(
            f"{path} is in the retired {OLD_FORMAT!r} format (per-rank safetensors files "
            "and index.json), which this shardplan no longer reads", where=str(path),
            fix="load it with the shardplan that wrote it (checkpoint.load_sharded) and "
                "save it again with checkpoint.save, or start from its full weights")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"no checkpoint at {path} (.metadata is missing)",
                              where=str(path), fix="pass the directory checkpoint.save wrote")
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def shardplan_info(path: Path, metadata: dict) -> dict:
    """The checkpoint's ``"shardplan"`` entry (tied names, optimizer class); {} if none."""
    if "shardplan" not in metadata:
        return {}
    state = {"shardplan": ""}
    quietly(dcp.load, state, checkpoint_id=str(path), planner=LoadPlanner(), no_dist=True)
    return json.loads(state["shardplan"])


def _fresh_optim_state(optimizer, entries: list[Entry], metadata: dict, path: Path) -> None:
    """Check that ``path`` holds state of ``optimizer``'s class, and give every parameter the
    state tensors it has for it (zeros, to be loaded in place): those shaped like the
    parameter like it (a ``DTensor`` under FSDP2), the others (``step``) as saved."""
    if not any(k.startswith("optim.") for k in metadata):
        raise CheckpointError(f"{path} holds no optimizer state", where=str(path),
                              fix="save with checkpoint.save(..., optimizer=opt), or load "
                                  "without optimizer=")
    saved = shardplan_info(path, metadata).get("optimizer")  # None: saved before it was kept
    if saved not in (None, _class_name(optimizer)):
        raise CheckpointError(f"the checkpoint holds {saved} state, the optimizer is "
                              f"{_class_name(optimizer)}", where=type(optimizer).__name__,
                              fix="load into the same optimizer class it was saved from")
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


def load(sharded, path, *, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a ``save`` checkpoint into ``sharded`` (and ``optimizer``), whatever the
    layout it was saved from (each rank reads its chunks); return its ``extra`` (``{}``
    if none). Names and shapes are checked before anything is read. Collective."""
    path = Path(path)

    def run():
        metadata = read_metadata(path)
        entries = entries_of(sharded)
        match_names({k[len("model."):]: (list(m.size), m.properties.dtype, path)
                     for k, m in metadata.items() if k.startswith("model.")}, entries,
                    str(path), strict=True)
        targets, finish = load_targets(sharded, entries)
        rank, tp = sharded.group.rank, sharded.group.size
        state = {"model": {e.fqn: chunks_of(targets[e.fqn], e, rank, tp) for e in entries}}
        if optimizer is not None:
            _fresh_optim_state(optimizer, entries, metadata, path)
            state["optim"] = _optim_state(sharded, optimizer, entries)
        if "extra" in metadata:
            state["extra"] = ""
        _collective("reading the checkpoint", path, lambda: quietly(
            dcp.load, state, checkpoint_id=str(path), planner=LoadPlanner(), no_dist=True))
        finish()
        if optimizer is not None:
            _set_hyperparameters(optimizer, state["optim"]["param_groups"], path)
        return json.loads(state["extra"]) if "extra" in state else {}

    return agree(world_of(sharded), f"loading {path}", run, error=CheckpointError)


def _set_hyperparameters(optimizer, saved: list[dict], path: Path) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint has {len(saved)} optimizer parameter groups, "
                              f"this optimizer {len(optimizer.param_groups)}", where=str(path),
                              fix="build the optimizer the way the saved one was built")
    for group, values in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in values.items() if k not in ("params", "param_names")})
