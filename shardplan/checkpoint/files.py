"""Safetensors files written one tensor at a time and read by key or by slice, with
errors that name the file; dtypes by name."""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
              torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r}", where=where,
                              fix="the index was written by another torch or shardplan version")
    return dtype


class Writer:
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
        write_tensor(self._file, t)

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


def write_tensor(f, t: torch.Tensor) -> None:
    """Append ``t``'s bytes (little-endian, row-major) to ``f``."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        f.write(memoryview(flat.view(torch.uint8).numpy()))


@contextlib.contextmanager
def open_file(path: Path):
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


def read_tensor(f, key: str, file: Path, shape=None) -> torch.Tensor:
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


def owned(t: torch.Tensor) -> torch.Tensor:
    """A tensor with memory of its own, not a view of the file's memory map (which a
    later write to that file could change under the model)."""
    return t.clone(memory_format=torch.contiguous_format)
