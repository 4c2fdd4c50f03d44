"""Fault injection, for tests of what happens when a rank dies or stops answering.

Not for production runs: set ``SHARDPLAN_FAULT_INJECTION`` only in such tests. It
lists faults separated by ``;``, each ``ACTION POINT=N [rank=R] [attempt=A]``:

- ``ACTION``: ``kill`` (this process SIGKILLs itself) or ``hang`` (it sleeps
  forever: a peer that stops answering);
- ``POINT=N``: the ``N``-th time (from 1) this process reaches ``POINT``:
  ``step`` (a training step, after its backward, before the optimizer) or
  ``save`` (a checkpoint written by every rank, before rank 0 commits it);
- ``rank=R``: only on global rank ``R`` (default: every rank);
- ``attempt=A``: only in torchrun's restart attempt ``A`` (its
  ``TORCHELASTIC_RESTART_COUNT``, 0 for the first; default: every attempt).

    SHARDPLAN_FAULT_INJECTION="kill step=3 rank=1 attempt=0; kill save=1 rank=0 attempt=1"
"""

from __future__ import annotations

import os
import signal
import time

import torch.distributed as dist

from .errors import ConfigurationError

__all__ = ["inject", "VARIABLE", "POINTS"]

VARIABLE = "SHARDPLAN_FAULT_INJECTION"
POINTS = ("step", "save")
_ACTIONS = ("kill", "hang")
_REACHED: dict[str, int] = {}  # point -> how often this process reached it


def _parse(text: str) -> list[dict]:
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        action, *fields = entry.split()
        try:
            spec = {k: int(v) for k, v in (f.split("=") for f in fields)}
        except ValueError:
            spec = {}
        points = [p for p in POINTS if p in spec]
        if action not in _ACTIONS or len(points) != 1 or set(spec) - {*POINTS, "rank", "attempt"}:
            raise ConfigurationError(f"{VARIABLE}: cannot read the fault {entry!r}",
                                     where=VARIABLE, fix="write ACTION POINT=N [rank=R] "
                                     "[attempt=A]: ACTION kill or hang, POINT step or save")
        faults.append({"action": action, "point": points[0], **spec})
    return faults


def inject(point: str) -> None:
    """Count one arrival at ``point``; kill or hang this process if a fault says so."""
    text = os.environ.get(VARIABLE)
    if not text:
        return
    _REACHED[point] = n = _REACHED.get(point, 0) + 1
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    for f in _parse(text):
        if f["point"] == point and f[point] == n and f.get("rank", rank) == rank \
                and f.get("attempt", attempt) == attempt:
            print(f"fault injection: {f['action']} rank {rank} at {point} {n} "
                  f"(attempt {attempt})", flush=True)
            if f["action"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:
                time.sleep(3600)
