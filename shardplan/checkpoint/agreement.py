"""Checkpoint steps agree across ranks: one that fails on a rank raises on every rank."""

from __future__ import annotations

from ..errors import CheckpointError
from ..runtime.consistency import agree as _agree


def agree(sharded, what: str, fn):
    """``fn()`` on this rank; a ``CheckpointError`` on every rank if it failed on any."""
    return _agree(sharded.group, what, fn, error=CheckpointError,
                  fix="see the cause above (disk space, permissions, path)")
