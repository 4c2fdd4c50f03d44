"""Checkpoint directories that replace each other atomically, and reading their index.

A save writes into ``.<name>.partial`` next to the target; ``commit_dir``
writes the index, fsyncs and swaps the directory into place (one
``renameat2(RENAME_EXCHANGE)`` on Linux, else two renames with the previous
checkpoint kept as ``.<name>.old`` in between, where ``read_index`` finds it).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import sys
from pathlib import Path

from ..errors import CheckpointError
from .index import FORMAT, INDEX, VERSION


def partial_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def _backup_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


def fsync_dir(path: Path) -> None:
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


def prepare_dir(path: Path) -> Path:
    """Check that ``path`` may be replaced; an empty temp directory next to it."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a directory", where=str(path),
                              fix="choose another path for the checkpoint directory")
    if path.is_dir() and any(path.iterdir()) and not (path / INDEX).is_file():
        raise CheckpointError(f"refusing to replace {path}: it is not a shardplan checkpoint "
                              f"(no {INDEX})", where=str(path),
                              fix="choose a new or empty directory, or one holding a checkpoint")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_dir(path)
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a save that died
    tmp.mkdir()
    return tmp


def commit_dir(tmp: Path, path: Path, index: dict) -> None:
    """Write the index into ``tmp``, fsync, and swap ``tmp`` into ``path``."""
    missing = [n for n in index["files"] if not (tmp / n).is_file()]
    if missing:
        raise CheckpointError(f"{missing} are missing from {tmp}", where=str(tmp),
                              fix="the checkpoint path must be on a filesystem every rank shares")
    _write_json(tmp / INDEX, index)
    fsync_dir(tmp)
    if not path.exists():
        os.rename(tmp, path)
    elif swap_paths(tmp, path):
        shutil.rmtree(tmp)  # now the previous checkpoint
    else:  # two renames; in between, loads find the previous one under _backup_dir
        old = _backup_dir(path)
        if old.exists():
            shutil.rmtree(old)
        os.rename(path, old)
        os.rename(tmp, path)
    fsync_dir(path.parent)
    if _backup_dir(path).exists():
        shutil.rmtree(_backup_dir(path))


def swap_paths(a: Path, b: Path) -> bool:
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


def read_index(path) -> tuple[Path, dict]:
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
