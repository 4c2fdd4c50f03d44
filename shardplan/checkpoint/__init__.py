"""Checkpoints of a parallelized model: per-rank shards, offline resharding, full weights.

Tensors go in safetensors files, everything else in JSON; nothing is pickled.

A *sharded checkpoint* is a directory::

    path/index.json                       format, tp, per tensor its layout, global and
                                          local shape, dtype and aliases; the optimizer's
                                          param groups and state; the plan; ``extra``
    path/rank00000-of-00002.safetensors   rank 0's local tensors: ``model/<fqn>`` and
    path/rank00001-of-00002.safetensors   ``optim/<fqn>/<state>``; its ``extra`` in the header

Every rank writes its own file (replicated tensors included, so each file
loads alone). A save is atomic: all ranks write into ``.<name>.partial`` next
to ``path``, agree that every file is complete (fsynced), and only then rank 0
writes the index and swaps the directory into place, so a save that dies
halfway leaves the previous checkpoint as it was. The collectives in here are
tiny success flags: a rank that fails tells the others instead of leaving
them waiting in a barrier.

A *full checkpoint* is one ``.safetensors`` file of full, unpadded tensors
under the original model's names (a tied tensor stored once, as safetensors'
``save_model`` does), loadable by the unsharded model with
``safetensors.torch.load_model``.

    save_sharded(sharded, path, optimizer=opt, extra={"step": 100})
    extra = load_sharded(sharded, path, optimizer=opt)
    reshard(path, path_tp4, tp=4)                      # offline, one tensor at a time
    full = gather_full_state_dict(sharded)             # dict on rank 0, None elsewhere
    save_full(sharded, "model.safetensors")
    load_full_state_dict(sharded, "model.safetensors") # each rank reads only its slices

Every function except ``reshard`` is collective: call it on every rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import os
import shutil
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError
from ..layouts import Partial, Replicate, Shard
from ..planner.shards import local_shape

__all__ = ["save_sharded", "load_sharded", "reshard", "gather_full_state_dict", "save_full",
           "load_full_state_dict", "rank_file", "FORMAT", "VERSION"]

FORMAT = "shardplan-checkpoint"
VERSION = 1
INDEX = "index.json"


def rank_file(rank: int, tp: int) -> str:
    """The name of rank ``rank``'s file in a checkpoint of ``tp`` ranks."""
    return f"rank{rank:05d}-of-{tp:05d}.safetensors"


# --------------------------------------------------------------------------
# the model's tensors, as checkpoint entries
# --------------------------------------------------------------------------

@dataclass
class _Entry:
    """One distinct tensor of the sharded module (a tied weight is one entry)."""

    fqn: str  # the first name in state_dict order
    aliases: list[str]  # its other names
    tensor: torch.Tensor  # this rank's part
    layout: Replicate | Shard
    shape: tuple[int, ...]  # the full, unpadded shape

    @property
    def key(self) -> str:
        return f"model/{self.fqn}"


def _entries(sharded) -> list[_Entry]:
    """Every distinct tensor of ``sharded.state_dict()`` with its layout and full shape."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in sharded.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    layouts, tp = sharded.layouts, sharded.group.size
    out = []
    for tid, group in names.items():
        t = tensors[tid]
        lays = {layouts.get(n, Replicate()) for n in group}
        if len(lays) > 1:
            raise CheckpointError(f"the tied names {group} have different layouts {sorted(map(str, lays))}",
                                  where=group[0], fix="this is a planner bug: report it")
        lay = _normal_dim(lays.pop(), t.dim(), group[0])
        out.append(_Entry(group[0], group[1:], t, lay, _full_shape(sharded, group[0], t, lay, tp)))
    return out


def _normal_dim(lay, ndim: int, fqn: str):
    if isinstance(lay, Partial):
        raise CheckpointError(f"{fqn} is held as partial sums, which cannot be saved as they are",
                              where=fqn, fix="only parameters and buffers are saved; "
                                             "they must be replicated or sharded")
    if isinstance(lay, Shard) and lay.dim < 0:
        return Shard(lay.dim % ndim, lay.blocks, lay.padded, lay.replicas)
    return lay


def _full_shape(sharded, fqn: str, t: torch.Tensor, lay, tp: int) -> tuple[int, ...]:
    """The unsharded shape: the plan's, else the source model's, else derived from the shard."""
    if not isinstance(lay, Shard):
        return tuple(t.shape)
    full = None
    with contextlib.suppress(AttributeError, KeyError):
        full = tuple(sharded.plan.param(fqn).global_shape)
    if full is None:
        with contextlib.suppress(AttributeError, IndexError, TypeError):
            src = sharded._source[0]
            owner, _, leaf = fqn.rpartition(".")
            full = tuple(getattr(src.get_submodule(owner) if owner else src, leaf).shape)
    if full is None:
        if lay.padded:
            raise CheckpointError(f"the unpadded size of {fqn} is unknown", where=fqn,
                                  fix="the sharded module's plan must list it")
        full = list(t.shape)
        full[lay.dim] *= tp
        full = tuple(full)
    if local_shape(full, lay, tp) != tuple(t.shape):
        raise CheckpointError(f"{fqn}: this rank holds {list(t.shape)}, but layout {lay} of "
                              f"{list(full)} over tp={tp} gives {list(local_shape(full, lay, tp))}",
                              where=fqn, fix="this is a planner bug: report it")
    return full


# --------------------------------------------------------------------------
# layouts, dtypes and values as JSON
# --------------------------------------------------------------------------

def _layout_json(lay) -> dict:
    if isinstance(lay, Shard):
        return {"type": "shard", "dim": lay.dim, "blocks": list(lay.blocks) if lay.blocks else None,
                "padded": lay.padded, "replicas": lay.replicas}
    return {"type": "replicate"}


def _layout_of(d: dict, where: str):
    try:
        if d["type"] == "replicate":
            return Replicate()
        if d["type"] == "shard":
            blocks = tuple(d["blocks"]) if d.get("blocks") else None
            return Shard(int(d["dim"]), blocks, d.get("padded"), int(d.get("replicas", 1)))
    except (KeyError, TypeError, ValueError):
        pass
    raise CheckpointError(f"unknown layout {d!r}", where=where,
                          fix="the index was written by another shardplan version or edited by hand")


def _same_layout(a, b, shape, tp: int) -> bool:
    """Whether two layouts hold the same part of a tensor on every rank."""
    def norm(lay):
        if not isinstance(lay, Shard):
            return ("R",)
        padded = None if lay.padded in (None, shape[lay.dim]) else lay.padded
        blocks = lay.blocks if lay.blocks and len(lay.blocks) > 1 else None
        if tp == lay.replicas and padded is None:  # every rank holds all of it
            return ("R",)
        return ("S", lay.dim, blocks, padded, lay.replicas)
    return norm(a) == norm(b)


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
              torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r}", where=where,
                              fix="the index was written by another torch or shardplan version")
    return dtype


def _to_json(v, where: str):
    """A hyperparameter or optimizer value as JSON (tensors as tagged lists)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_to_json(x, where) for x in v]
    if isinstance(v, torch.Tensor) and v.numel() <= 64:
        return {"__tensor__": v.tolist(), "dtype": _dtype_name(v.dtype)}
    raise CheckpointError(f"{where} = {type(v).__name__} cannot be saved as JSON", where=where,
                          fix="use numbers, strings, lists or small tensors")


def _from_json(v, like=None):
    """Inverse of ``_to_json``; lists become tuples where the current value is one."""
    if isinstance(v, dict) and "__tensor__" in v:
        return torch.tensor(v["__tensor__"], dtype=_dtype_of(v["dtype"], "tensor value"))
    if isinstance(v, list):
        items = [_from_json(x) for x in v]
        return tuple(items) if isinstance(like, tuple) else items
    return v


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


# --------------------------------------------------------------------------
# safetensors files written one tensor at a time
# --------------------------------------------------------------------------

class _Writer:
    """A .safetensors file written tensor by tensor.

    The header (every name, dtype and shape) is known up front, so each
    tensor's bytes can follow in order without holding the others in memory.
    ``close()`` flushes and fsyncs.
    """

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str]):
        if sys.byteorder != "little":
            raise CheckpointError("safetensors files are little-endian; this machine is not",
                                  where=str(path))
        header: dict = {"__metadata__": metadata}
        offset = 0
        for name, dtype, shape in specs:
            if dtype not in _ST_DTYPES:
                raise CheckpointError(f"{name}: dtype {dtype} cannot be stored in safetensors",
                                      where=str(path), fix="convert it to a supported dtype")
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = path
        self._pending = list(reversed(specs))
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def write(self, name: str, t: torch.Tensor) -> None:
        want, dtype, shape = self._pending.pop()
        if (name, t.dtype, tuple(t.shape)) != (want, dtype, shape):
            raise CheckpointError(f"{name} {t.dtype} {list(t.shape)} written where the header "
                                  f"declared {want} {dtype} {list(shape)}", where=str(self.path),
                                  fix="this is a shardplan bug: report it")
        _write_tensor(self._file, t)

    def close(self) -> None:
        if self._pending:
            raise CheckpointError(f"{len(self._pending)} tensors were never written",
                                  where=str(self.path), fix="this is a shardplan bug: report it")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()


def _write_tensor(f, t: torch.Tensor) -> None:
    """Append ``t``'s bytes (little-endian, row-major) to ``f``."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        f.write(memoryview(flat.view(torch.uint8).numpy()))


@contextlib.contextmanager
def _open(path: Path):
    """``safe_open`` with errors that name the file."""
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist", where=str(path),
                              fix="the checkpoint is incomplete or the path is wrong")
    try:
        f = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}", where=str(path),
                              fix="the file is truncated or corrupt: use another checkpoint") from None
    with f:
        yield f


def _read(f, key: str, file: Path, shape=None) -> torch.Tensor:
    try:
        if shape is not None:
            got = list(f.get_slice(key).get_shape())
            if got != list(shape):
                raise CheckpointError(f"{key} is {got} in {file.name}, the index says {list(shape)}",
                                      where=str(file), fix="the checkpoint is inconsistent: "
                                                           "use another one")
        return f.get_tensor(key)
    except SafetensorError as e:
        raise CheckpointError(f"cannot read {key} from {file}: {e}", where=str(file),
                              fix="the file is incomplete or belongs to another checkpoint") from None


# --------------------------------------------------------------------------
# directories that replace each other atomically
# --------------------------------------------------------------------------

def _partial_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def _backup_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not supported here (Windows)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: Path, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _prepare(path: Path) -> Path:
    """Check that ``path`` may be replaced; an empty temp directory next to it."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a directory", where=str(path),
                              fix="choose another path for the checkpoint directory")
    if path.is_dir() and any(path.iterdir()) and not (path / INDEX).is_file():
        raise CheckpointError(f"refusing to replace {path}: it is not a shardplan checkpoint "
                              f"(no {INDEX})", where=str(path),
                              fix="choose a new or empty directory, or one holding a checkpoint")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _partial_dir(path)
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a save that died
    tmp.mkdir()
    return tmp


def _commit(tmp: Path, path: Path, index: dict) -> None:
    """Write the index into ``tmp``, fsync, and swap ``tmp`` into ``path``."""
    missing = [n for n in index["files"] if not (tmp / n).is_file()]
    if missing:
        raise CheckpointError(f"{missing} are missing from {tmp}", where=str(tmp),
                              fix="the checkpoint path must be on a filesystem every rank shares")
    _write_json(tmp / INDEX, index)
    _fsync_dir(tmp)
    if not path.exists():
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp)  # now the previous checkpoint
    else:  # two renames; in between, loads find the previous one under _backup_dir
        old = _backup_dir(path)
        if old.exists():
            shutil.rmtree(old)
        os.rename(path, old)
        os.rename(tmp, path)
    _fsync_dir(path.parent)
    if _backup_dir(path).exists():
        shutil.rmtree(_backup_dir(path))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _read_index(path) -> tuple[Path, dict]:
    """(the checkpoint directory, its index); the previous one if a save died while swapping."""
    path = Path(path)
    if not (path / INDEX).is_file() and (_backup_dir(path) / INDEX).is_file():
        path = _backup_dir(path)
    file = path / INDEX
    if not file.is_file():
        raise CheckpointError(f"no shardplan checkpoint at {path} ({INDEX} is missing)",
                              where=str(path), fix="pass the directory save_sharded wrote; "
                                                   "for a single .safetensors file use load_full_state_dict")
    try:
        index = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is not readable JSON: {e}", where=str(file),
                              fix="the checkpoint is corrupt: use another one") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a shardplan checkpoint index", where=str(file),
                              fix="pass a directory written by shardplan.checkpoint.save_sharded")
    if index.get("version", 0) > VERSION:
        raise CheckpointError(f"{file} has format version {index['version']}; this shardplan "
                              f"reads up to {VERSION}", where=str(file), fix="upgrade shardplan")
    return path, index


# --------------------------------------------------------------------------
# agreeing across ranks
# --------------------------------------------------------------------------

_MESSAGE_BYTES = 2048


def _agree(sharded, what: str, fn):
    """Run ``fn`` on this rank; raise on every rank if it failed on any.

    One tiny all-gather of success flags; on failure a second one carries
    each failed rank's message, so every rank reports the root cause.
    """
    err = None
    result = None
    try:
        result = fn()
    except Exception as e:  # every rank must reach the exchange below
        err = e
    group, device = sharded.group, _device(sharded)
    flag = torch.tensor([0 if err is None else 1], dtype=torch.int32, device=device)
    failed = [r for r, f in enumerate(group.all_gather(flag, 0).tolist()) if f]
    if not failed:
        return result
    text = b"" if err is None else str(err).encode()[:_MESSAGE_BYTES]
    buf = torch.zeros(1, _MESSAGE_BYTES, dtype=torch.uint8)
    if text:
        buf[0, :len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    messages = group.all_gather(buf.to(device), 0).cpu()
    if err is not None:
        if isinstance(err, CheckpointError):
            raise err
        raise CheckpointError(f"{what} failed on rank {group.rank}: {type(err).__name__}: {err}",
                              fix="see the cause above (disk space, permissions, path)") from err
    first = bytes(messages[failed[0]].tolist()).rstrip(b"\0").decode(errors="replace")
    raise CheckpointError(f"{what} failed on rank{'s' * (len(failed) > 1)} "
                          f"{', '.join(map(str, failed))}: {first}",
                          fix=f"rank {failed[0]}'s error is quoted above; its log has the rest")


def _device(sharded) -> torch.device:
    for t in sharded.parameters():
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


# --------------------------------------------------------------------------
# optimizer state
# --------------------------------------------------------------------------

@dataclass
class _OptimTensor:
    key: str
    tensor: torch.Tensor
    layout: Replicate | Shard
    shape: tuple[int, ...]
    fqn: str


def _optimizer_state(optimizer, entries: list[_Entry]) -> tuple[dict, list[_OptimTensor]]:
    """(the optimizer's index record, its state tensors), keyed by parameter FQN."""
    by_id = {id(e.tensor): e for e in entries}
    sd = optimizer.state_dict()
    param_of = {}
    groups = []
    for gi, (saved, group) in enumerate(zip(sd["param_groups"], optimizer.param_groups)):
        fqns = []
        for i, p in zip(saved["params"], group["params"]):
            e = by_id.get(id(p))
            if e is None:
                raise CheckpointError(
                    f"param_groups[{gi}] of the optimizer holds a parameter of shape "
                    f"{list(p.shape)} that is not one of the sharded module's",
                    where=type(optimizer).__name__,
                    fix="build the optimizer from sharded.parameters(), after parallelize")
            param_of[i] = e
            fqns.append(e.fqn)
        hyper = {k: _to_json(v, f"param_groups[{gi}][{k!r}]") for k, v in saved.items()
                 if k != "params"}
        groups.append({**hyper, "params": fqns})
    state, tensors = {}, []
    for i, st in sd["state"].items():
        e = param_of[i]
        record = {}
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                key = f"optim/{e.fqn}/{name}"
                if tuple(v.shape) == tuple(e.tensor.shape):  # elementwise: the parameter's layout
                    tensors.append(_OptimTensor(key, v, e.layout, e.shape, e.fqn))
                else:
                    tensors.append(_OptimTensor(key, v, Replicate(), tuple(v.shape), e.fqn))
                record[name] = {"tensor": key}
            else:
                record[name] = {"value": _to_json(v, f"optimizer state {e.fqn}[{name!r}]")}
        state[e.fqn] = record
    kind = type(optimizer)
    return {"type": f"{kind.__module__}.{kind.__qualname__}", "param_groups": groups,
            "state": state}, tensors


def _optimizer_load(optimizer, record: dict | None, entries: list[_Entry], f, file: Path,
                    index: dict) -> dict:
    """The optimizer's ``state_dict`` rebuilt from a checkpoint for its current param order."""
    name = type(optimizer).__name__
    if record is None:
        raise CheckpointError(f"{file.parent} holds no optimizer state", where=str(file.parent),
                              fix="save with save_sharded(..., optimizer=opt), "
                                  "or load without optimizer=")
    kind = type(optimizer)
    if record["type"] != f"{kind.__module__}.{kind.__qualname__}":
        raise CheckpointError(f"the checkpoint holds {record['type']} state, the optimizer is "
                              f"{kind.__module__}.{kind.__qualname__}", where=name,
                              fix="load into the same optimizer class it was saved from")
    saved = record["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint has {len(saved)} param groups, the optimizer "
                              f"{len(optimizer.param_groups)}", where=name,
                              fix="build the optimizer with the same param groups as when saved")
    fqn_of = {id(e.tensor): e.fqn for e in entries}
    sd: dict = {"state": {}, "param_groups": []}
    i = 0
    for gi, (group, sg) in enumerate(zip(optimizer.param_groups, saved)):
        fqns = [fqn_of.get(id(p)) for p in group["params"]]
        if None in fqns:
            raise CheckpointError(f"param_groups[{gi}] of the optimizer holds a parameter that is "
                                  "not one of the sharded module's", where=name,
                                  fix="build the optimizer from sharded.parameters()")
        if sorted(fqns) != sorted(sg["params"]):
            diff = sorted(set(fqns) ^ set(sg["params"]))
            raise CheckpointError(f"param_groups[{gi}] holds other parameters than when saved "
                                  f"(e.g. {diff[:3]})", where=name,
                                  fix="build the optimizer with the same param groups as when saved")
        ids = []
        for fqn in fqns:
            st = record["state"].get(fqn)
            if st is not None:
                sd["state"][i] = {
                    k: (_read(f, v["tensor"], file, index["tensors"][v["tensor"]]["local_shape"])
                        if "tensor" in v else _from_json(v["value"]))
                    for k, v in st.items()}
            ids.append(i)
            i += 1
        hyper = {k: _from_json(v, group.get(k)) for k, v in sg.items() if k != "params"}
        sd["param_groups"].append({**hyper, "params": ids})
    return sd


# --------------------------------------------------------------------------
# sharded checkpoints
# --------------------------------------------------------------------------

def _tensor_record(fqn, aliases, lay, shape, dtype, tp, kind) -> dict:
    return {"kind": kind, "fqn": fqn, "aliases": list(aliases), "layout": _layout_json(lay),
            "shape": list(shape), "local_shape": list(local_shape(shape, lay, tp)),
            "dtype": _dtype_name(dtype)}


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
        entries = _entries(sharded)
        optim, otensors = (None, []) if optimizer is None else _optimizer_state(optimizer, entries)
        return entries, optim, otensors, _extra_json(extra), _prepare(path) if rank == 0 else None

    entries, optim, otensors, extra_json, _ = _agree(sharded, f"save_sharded({path})", prepare)
    tmp = _partial_dir(path)
    tensors = [(e.key, e.tensor) for e in entries] + [(o.key, o.tensor) for o in otensors]

    def write():
        meta = {"format": "pt", "shardplan": FORMAT, "version": str(VERSION), "rank": str(rank),
                "tp": str(tp), "extra": extra_json}
        specs = [(k, t.dtype, tuple(t.shape)) for k, t in tensors]
        w = _Writer(tmp / rank_file(rank, tp), specs, meta)
        try:
            for k, t in tensors:
                w.write(k, t)
            w.close()
        except BaseException:
            w.abort()
            raise

    _agree(sharded, f"writing the rank files into {tmp}", write)

    def commit():
        if rank != 0:
            return
        records = {e.key: _tensor_record(e.fqn, e.aliases, e.layout, e.shape, e.tensor.dtype, tp,
                                         "model") for e in entries}
        for o in otensors:
            records[o.key] = _tensor_record(o.fqn, [], o.layout, o.shape, o.tensor.dtype, tp, "optim")
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
        _commit(tmp, path, index)

    _agree(sharded, f"committing {path}", commit)


def load_sharded(sharded, path, *, optimizer=None) -> dict:
    """Load this rank's shards (and ``optimizer``'s state) from a ``save_sharded`` directory.

    Collective. Checks tp, names, layouts and shapes against the model before
    changing anything. Returns the ``extra`` this rank saved ({} if none).
    """
    group = sharded.group
    rank, tp = group.rank, group.size

    def load():
        root, index = _read_index(path)
        if index["tp"] != tp:
            raise CheckpointError(
                f"{root} was saved with tp={index['tp']}; this model runs tp={tp}",
                where=str(root),
                fix=f"reshard it first: shardplan.checkpoint.reshard({str(root)!r}, new_path, "
                    f"tp={tp}), or go through save_full / load_full_state_dict")
        entries = _entries(sharded)
        _match(index, entries, root, tp)
        file = root / index["files"][rank]
        with _open(file) as f:
            meta = f.metadata() or {}
            if meta.get("rank") != str(rank) or meta.get("tp") != str(tp):
                raise CheckpointError(f"{file.name} says rank {meta.get('rank')} of "
                                      f"{meta.get('tp')}, expected rank {rank} of {tp}",
                                      where=str(file), fix="the checkpoint directory was mixed up")
            osd = None if optimizer is None else \
                _optimizer_load(optimizer, index.get("optimizer"), entries, f, file, index)
            values = {}
            for e in entries:
                key = index["model"][e.fqn]
                values[e.fqn] = _read(f, key, file, index["tensors"][key]["local_shape"])
                if not e.tensor.is_meta:  # one at a time: no second copy of the model
                    _set(sharded, {e.fqn: values.pop(e.fqn)}, entries)
            if values:
                _set(sharded, values, entries)
            if osd is not None:
                optimizer.load_state_dict(osd)
            extra = json.loads(meta.get("extra", "null"))
        return index.get("extra") if extra is None else extra

    extra = _agree(sharded, f"load_sharded({path})", load)
    return {} if extra is None else extra


def _match(index: dict, entries: list[_Entry], root: Path, tp: int) -> None:
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
        saved = _layout_of(rec["layout"], e.fqn)
        if not _same_layout(saved, e.layout, e.shape, tp):
            raise CheckpointError(f"{e.fqn} was saved with layout {saved}, this model places it "
                                  f"as {e.layout}", where=e.fqn,
                                  fix="the plan differs (rules or model changed): go through "
                                      "save_full / load_full_state_dict")


def _set(sharded, values: dict[str, torch.Tensor], entries: list[_Entry]) -> None:
    """Copy local tensors into the module: in place, or by replacement where still on meta."""
    by_fqn = {e.fqn: e for e in entries}
    meta = {}
    with torch.no_grad():
        for fqn, v in values.items():
            t = by_fqn[fqn].tensor
            if t.is_meta:
                meta[fqn] = v.to(t.dtype)
            else:
                t.copy_(v)
    if meta:
        sharded.load_local_(meta)


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
    root, index = _read_index(src_path)
    dst = Path(dst_path)
    src_tp = index["tp"]
    layouts = {}
    records = {}
    for key, rec in index["tensors"].items():
        old = _layout_of(rec["layout"], key)
        new = _relayout(old, rec["shape"], tp, src_tp, key)
        layouts[key] = (old, new)
        records[key] = {**rec, "layout": _layout_json(new),
                        "local_shape": list(local_shape(rec["shape"], new, tp))}
    extra_json = json.dumps(index.get("extra"))
    tmp = _prepare(dst)
    writers: list[_Writer] = []
    try:
        with contextlib.ExitStack() as stack:
            files = [stack.enter_context(_open(root / n)) for n in index["files"]]
            specs = [(k, _dtype_of(r["dtype"], k), tuple(r["local_shape"])) for k, r in records.items()]
            for r in range(tp):
                meta = {"format": "pt", "shardplan": FORMAT, "version": str(VERSION),
                        "rank": str(r), "tp": str(tp), "extra": extra_json}
                writers.append(_Writer(tmp / rank_file(r, tp), specs, meta))
            for key, rec in index["tensors"].items():
                old, new = layouts[key]
                local = rec["local_shape"]
                if isinstance(old, Shard):
                    step = old.replicas  # ranks that hold the same part: read one
                    parts = [_read(f, key, root / n, local) if r % step == 0 else None
                             for r, (f, n) in enumerate(zip(files, index["files"]))]
                    full = old.unshard(parts, rec["shape"][old.dim])
                    del parts
                else:
                    full = _read(files[0], key, root / index["files"][0], local)
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
    _commit(tmp, dst, out)


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


# --------------------------------------------------------------------------
# full state dicts
# --------------------------------------------------------------------------

def _gather(sharded, e: _Entry) -> torch.Tensor:
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
    entries = _entries(sharded)
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
    entries = _entries(sharded)

    def open_writer():
        if rank != 0:
            return None
        if file.is_dir():
            raise CheckpointError(f"{file} is a directory", where=str(file),
                                  fix="pass a file name such as model.safetensors")
        file.parent.mkdir(parents=True, exist_ok=True)
        aliases = {a: e.fqn for e in entries for a in e.aliases}
        return _Writer(tmp, [(e.fqn, e.tensor.dtype, e.shape) for e in entries],
                       {"format": "pt", "shardplan": "full", "aliases": json.dumps(aliases)})

    writer = _agree(sharded, f"save_full({file})", open_writer)
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
        _fsync_dir(file.parent)

    _agree(sharded, f"save_full({file})", finish)


def load_full_state_dict(sharded, source, *, strict: bool = True) -> None:
    """Load a FULL (unsharded) state dict into ``sharded``: each rank takes only its slices.

    ``source`` is a dict of tensors or a path to a .safetensors file; from a
    file each rank reads just its ranges (per block for fused layouts, zeros
    for padding), never the whole tensor. A tied tensor may appear under any
    of its names. ``strict``: names the model does not have are an error.
    Collective.
    """
    is_file = isinstance(source, (str, os.PathLike))
    if not is_file and not isinstance(source, Mapping):
        raise CheckpointError(f"expected a state dict or a .safetensors path, got "
                              f"{type(source).__name__}", fix="pass model.state_dict() or a file")
    where = str(source) if is_file else "state dict"
    group = sharded.group

    def load():
        entries = _entries(sharded)
        with (_open(Path(source)) if is_file else contextlib.nullcontext(source)) as src:
            keys = set(src.keys())
            chosen = {}
            missing = []
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
                raise CheckpointError(f"{where} does not match the model: "
                                      + "; ".join(p for p in parts if p), where=where,
                                      fix="pass the full state dict of the same model class and "
                                          "configuration (strict=False ignores extra names)")
            for e in entries:
                name = chosen[e.fqn]
                shape = list(src.get_slice(name).get_shape()) if is_file else list(src[name].shape)
                if shape != list(e.shape):
                    raise CheckpointError(f"{name} has shape {shape} in {where}, the model "
                                          f"{list(e.shape)}", where=name,
                                          fix="load weights of the same model configuration")
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
                    _set(sharded, {e.fqn: values.pop(e.fqn)}, entries)
            if values:
                _set(sharded, values, entries)

    _agree(sharded, f"load_full_state_dict({where})", load)


def _read_local(f, name: str, e: _Entry, rank: int, tp: int) -> torch.Tensor:
    """This rank's part of tensor ``name`` of safetensors file ``f``, reading only its ranges."""
    lay = e.layout
    if not isinstance(lay, Shard):
        return _owned(f.get_tensor(name))
    sl = f.get_slice(name)
    d, size = lay.dim, e.shape[lay.dim]
    segments, offset = [], 0
    for b in lay.blocks or (lay.padded or size,):
        segments.append((offset, b))
        offset += b
    pieces = []
    parts, index = tp // lay.replicas, rank // lay.replicas
    for offset, b in segments:
        lo, hi = offset + index * (b // parts), offset + (index + 1) * (b // parts)
        if min(hi, size) > lo:
            pieces.append(sl[(slice(None),) * d + (slice(lo, min(hi, size)),)].to(e.tensor.dtype))
        if hi > max(lo, size):  # padding rows are zero
            shape = list(e.shape)
            shape[d] = hi - max(lo, size)
            pieces.append(torch.zeros(shape, dtype=e.tensor.dtype))
    return torch.cat(pieces, d) if len(pieces) > 1 else _owned(pieces[0])


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A tensor with memory of its own, not a view of the file's memory map (which a
    later write to that file could change under the model)."""
    return t.clone(memory_format=torch.contiguous_format)
