"""Collectives behind one small interface, for real and simulated ranks.

A ``Group`` is what every runtime primitive talks to. ``TorchGroup`` wraps a
``torch.distributed`` process group (gloo on CPU, NCCL on GPU);
``ThreadGroup`` connects N threads of one process (the simulated runner).
Every collective is recorded in the active ``CommLedger``s of its thread.
"""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.distributed as dist

from ..errors import CommunicationError, ConfigurationError
from . import ledger


class Group:
    """A set of ranks that communicate. Subclasses implement the ``_`` methods."""

    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor, op: str = "sum", *,
                   direction: str = "none", site: str | None = None) -> torch.Tensor:
        """Elementwise reduction (``sum`` or ``max``) over the group; returns a new tensor."""
        self._log("all_reduce", t.numel(), t.element_size(), direction, site, op)
        if self.size == 1:
            return t.clone()
        return self._all_reduce(t.contiguous(), op)

    def all_gather(self, t: torch.Tensor, dim: int, *,
                   direction: str = "none", site: str | None = None) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` (rank order)."""
        self._log("all_gather", t.numel() * self.size, t.element_size(), direction, site)
        if self.size == 1:
            return t.clone()
        return self._all_gather(t.contiguous(), dim % t.dim())

    def reduce_scatter(self, t: torch.Tensor, dim: int, *,
                       direction: str = "none", site: str | None = None) -> torch.Tensor:
        """Sum over the group, then keep this rank's slice of ``dim``."""
        self._log("reduce_scatter", t.numel(), t.element_size(), direction, site)
        dim = dim % t.dim()
        if t.shape[dim] % self.size:
            raise ConfigurationError(
                f"reduce_scatter of dim {dim} with size {t.shape[dim]} over {self.size} ranks",
                fix="the scattered dimension must divide by the group size")
        if self.size == 1:
            return t.clone()
        return self._reduce_scatter(t.contiguous(), dim)

    def broadcast(self, t: torch.Tensor, src: int = 0, *, site: str | None = None) -> torch.Tensor:
        """Rank ``src``'s tensor, on every rank."""
        self._log("broadcast", t.numel(), t.element_size(), "none", site)
        if self.size == 1:
            return t.clone()
        return self._broadcast(t.contiguous(), src)

    def barrier(self) -> None:
        if self.size > 1:
            self._barrier()

    @property
    def device(self) -> torch.device:
        """Where tensors must live for this group's collectives."""
        return torch.device("cpu")

    def __deepcopy__(self, memo):
        return self  # a group is a handle on ranks, never copied with a module

    def _log(self, kind, elements, elsize, direction, site, op="sum"):
        if ledger.recording():
            ledger.record(ledger.CommRecord(
                kind=kind, group_size=self.size, elements=elements,
                bytes=elements * elsize, direction=direction,
                site=site or _caller(), op=op))


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _caller() -> str:
    """The innermost frame outside shardplan.runtime and torch, as ``file:line``.

    Skipping torch's frames (``Module.__call__``, ``Function.apply``) makes the
    site the user's line that called the layer, not torch's dispatch code.
    """
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if "shardplan/runtime" not in name.replace("\\", "/") and not name.startswith(_TORCH_DIR):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class TorchGroup(Group):
    """A ``torch.distributed`` process group (``None`` = the default group)."""

    def __init__(self, pg=None):
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigurationError(
                "torch.distributed is not initialized",
                fix="launch with torchrun and call torch.distributed.init_process_group() "
                    "first, or use shardplan.plan()/verify(), which need no process group")
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)

    @property
    def device(self) -> torch.device:
        backend = str(dist.get_backend(self.pg))
        if "nccl" in backend and "gloo" not in backend:  # NCCL alone: CUDA tensors only
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_reduce(self, t, op):
        out = t.clone()
        _checked(dist.all_reduce, out, op=_TORCH_OPS[op], group=self.pg)
        return out

    def _all_gather(self, t, dim):
        parts = [torch.empty_like(t) for _ in range(self.size)]
        _checked(dist.all_gather, parts, t, group=self.pg)
        return torch.cat(parts, dim)

    def _reduce_scatter(self, t, dim):
        parts = [p.contiguous() for p in t.chunk(self.size, dim)]
        out = torch.empty_like(parts[0])
        _checked(dist.reduce_scatter, out, parts, group=self.pg)
        return out

    def _broadcast(self, t, src):
        out = t.clone()
        _checked(dist.broadcast, out, src=dist.get_global_rank(self.pg, src)
                 if self.pg is not None else src, group=self.pg)
        return out

    def _barrier(self):
        _checked(dist.barrier, group=self.pg)


def _checked(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:  # gloo/NCCL report timeouts and dead peers this way
        raise CommunicationError(
            f"collective {fn.__name__} failed: {str(e).splitlines()[0]}",
            fix="another rank died, diverged or is too slow; check its log. "
                "The timeout is init_process_group(timeout=...)") from e


class Rendezvous:
    """Shared state of a ``ThreadGroup``: one slot per rank and a barrier."""

    def __init__(self, size: int, timeout: float = 60.0):
        self.size = size
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout)

    def abort(self) -> None:
        self.barrier.abort()


class ThreadGroup(Group):
    """N threads of one process exchanging tensors through a ``Rendezvous``.

    Reductions add the ranks' tensors in rank order, so every rank gets the
    bit-identical result, as a real all-reduce does.
    """

    def __init__(self, rank: int, rendezvous: Rendezvous):
        self.rank, self.size, self.rv = rank, rendezvous.size, rendezvous

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.rv.slots[self.rank] = t
        self._wait()
        parts = list(self.rv.slots)
        self._wait()  # nobody overwrites a slot before everyone has read it
        return parts

    def _wait(self):
        try:
            self.rv.barrier.wait()
        except threading.BrokenBarrierError:
            raise CommunicationError(
                f"simulated rank {self.rank}: a peer failed or timed out "
                f"after {self.rv.barrier._timeout}s in a collective",
                fix="see the first failing rank's error") from None

    def _all_reduce(self, t, op):
        parts = self._exchange(t)
        out = parts[0].clone()
        for p in parts[1:]:
            out = out + p if op == "sum" else torch.maximum(out, p)
        return out

    def _all_gather(self, t, dim):
        return torch.cat(self._exchange(t), dim)

    def _reduce_scatter(self, t, dim):
        total = self._all_reduce(t, "sum")
        return total.chunk(self.size, dim)[self.rank].clone()

    def _broadcast(self, t, src):
        return self._exchange(t)[src].clone()

    def _barrier(self):
        self._wait()


def as_group(group=None) -> Group:
    """A ``Group`` from ``None`` (default process group), a process group or a Group."""
    if isinstance(group, Group):
        return group
    return TorchGroup(group)
