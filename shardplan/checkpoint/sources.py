"""Full checkpoints in one or many safetensors files, read by key.

A *source* is what ``save_pretrained`` writes: one ``model.safetensors``, or
several files listed by ``model.safetensors.index.json`` (its ``weight_map``:
tensor name -> file name). ``open_source`` takes a file, a folder or an index
and opens files lazily, memory-mapped, only when a tensor of theirs is read;
``get_slice`` reads byte ranges, never the whole file. Every error names the
key and the file.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from safetensors import SafetensorError

from ..errors import CheckpointError
from .files import open_file

INDEX_SUFFIX = ".safetensors.index.json"


class Source:
    """Tensor names -> files; the files opened on first use and kept open until closed."""

    def __init__(self, where: str, files: dict[str, Path], declared: dict[str, Path] | None):
        self.where = where
        self._declared = declared  # from an index: name -> file, checked when opened
        self._stack = contextlib.ExitStack()
        self._open: dict[Path, object] = {}
        if declared is None:
            self._file_of = {k: p for p in files.values() for k in self._opened(p).keys()}
        else:
            self._file_of = dict(declared)

    def keys(self) -> set[str]:
        return set(self._file_of)

    def file_of(self, name: str) -> Path:
        return self._file_of[name]

    def get_slice(self, name: str):
        file = self._file_of[name]
        f = self._opened(file)
        try:
            return f.get_slice(name)
        except SafetensorError as e:
            raise CheckpointError(f"{name} cannot be read from {file}: {e}", where=str(file),
                                  fix="the index and the file disagree: the checkpoint is "
                                      "incomplete or mixed up") from None

    def get_tensor(self, name: str):
        return self._opened(self._file_of[name]).get_tensor(name)

    def _opened(self, file: Path):
        if file not in self._open:
            f = self._open[file] = self._stack.enter_context(open_file(file))
            if self._declared is not None:
                have = set(f.keys())
                lost = sorted(k for k, p in self._declared.items() if p == file and k not in have)
                if lost:
                    raise CheckpointError(f"{file.name} lacks {lost[:4]} that the index of "
                                          f"{self.where} places there", where=str(file),
                                          fix="the index and the files disagree: the checkpoint "
                                              "is incomplete or mixed up")
        return self._open[file]

    def close(self) -> None:
        self._stack.close()


@contextlib.contextmanager
def open_source(path):
    """The checkpoint at ``path``: a .safetensors file, an index JSON, or a folder of either."""
    path = Path(path)
    source = Source(str(path), *_layout(path))
    try:
        yield source
    finally:
        source.close()


def _layout(path: Path) -> tuple[dict[str, Path], dict[str, Path] | None]:
    """(files to scan, or {} when an index declares them; the index's name -> file, or None)."""
    if path.is_dir():
        indexes = sorted(path.glob(f"*{INDEX_SUFFIX}"))
        if len(indexes) == 1:
            return _layout(indexes[0])
        files = sorted(path.glob("*.safetensors"))
        if len(indexes) > 1 or not files:
            raise CheckpointError(f"{path} holds {'several indexes' if indexes else 'no safetensors file'}",
                                  where=str(path), fix="pass the file or the index to load")
        return {str(f): f for f in files}, None
    if path.name.endswith(".json"):
        return {}, _read_index(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist", where=str(path),
                              fix="pass a .safetensors file, an index .json or their folder")
    return {str(path): path}, None


def _read_index(path: Path) -> dict[str, Path]:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not readable JSON: {e}", where=str(path),
                              fix="the index is corrupt: save the checkpoint again") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path} has no weight_map of tensor name -> file name",
                              where=str(path), fix="pass an index written by save_pretrained")
    files = {name: path.parent / file for name, file in weight_map.items()}
    absent = sorted({str(f.name) for f in files.values() if not f.is_file()})
    if absent:
        key = next(k for k, f in files.items() if f.name == absent[0])
        raise CheckpointError(f"{path} names {absent[:4]} (e.g. for {key}), which do not exist",
                              where=str(path.parent / absent[0]),
                              fix="the checkpoint is incomplete: copy every file the index lists")
    return files
