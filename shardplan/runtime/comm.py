"""Collectives behind one small interface, for real and simulated ranks.

A ``Group`` is what every runtime primitive talks to. ``TorchGroup`` wraps a
``torch.distributed`` process group (gloo on CPU, NCCL on GPU);
``ThreadGroup`` connects N threads of one process (the simulated runner).
Every collective is recorded in the active ``CommLedger``s of its thread.

Errors name the collective and its site in the model. A ``CommunicationError``
a rank gets because of a peer (a peer failed, or never arrived before the
timeout) has ``secondary = True``: the rank runners report a rank's own error
first. Inside ``torch.compile`` a ``TorchGroup`` issues torch's functional
collectives (traceable ops that inductor schedules) and records nothing: the
mappings record compiled collectives in the ledger (see ``ledger.traced``).
``ThreadGroup`` cannot be compiled. ``ThreadGroup`` checks that every rank passes a tensor of the same
shape and dtype to the same kind of collective. Real backends do not: gloo
may hang or return a wrong sum; set ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` to make
torch check every collective across ranks (an extra exchange per collective;
its error is reported as ranks disagreeing).

Point-to-point transfers (``send``, ``recv``, ``batch_isend_irecv``) name their
peer by its rank *within the group* (``0 .. size - 1``, never this rank), as a
pipeline stage names its neighbours; ``TorchGroup`` passes it to torch as the
group rank. Each is recorded in the ledger (kind ``send`` or ``recv``, with the
peer). They are not traceable: a ``torch.compile``d graph cannot contain them.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import CommunicationError, ConfigurationError
from . import ledger
from ..torch_compat import funcol


class Group:
    """A set of ranks that communicate. Subclasses implement the ``_`` methods."""

    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor, op: str = "sum", *,
                   direction: str = "none", site: str | None = None) -> torch.Tensor:
        """Elementwise reduction (``sum`` or ``max``) over the group; returns a new tensor."""
        if torch.compiler.is_dynamo_compiling():
            return t.clone() if self.size == 1 else self._traced_all_reduce(t, op)
        self._log("all_reduce", t.numel(), t.element_size(), direction, site, op)
        if self.size == 1:
            return t.clone()
        return self._all_reduce(t.contiguous(), op)

    def all_gather(self, t: torch.Tensor, dim: int, *, stacked: bool = False,
                   direction: str = "none", site: str | None = None) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` (rank order).

        ``stacked``: the result has the concatenation's shape, but its elements are the
        ranks' parts one after another (row-major), as the collective leaves them,
        not interleaved into ``dim``'s order: no copy. Only what treats every position
        of ``dim`` alike (a token-wise region) may read it so."""
        dim = dim % t.dim()
        if stacked:
            return _concatenated_shape(self.all_gather(t.unsqueeze(0), 0, direction=direction,
                                                       site=site), dim)
        if torch.compiler.is_dynamo_compiling():
            return t.clone() if self.size == 1 else self._traced_all_gather(t, dim)
        self._log("all_gather", t.numel() * self.size, t.element_size(), direction, site)
        if self.size == 1:
            return t.clone()
        return self._all_gather(t.contiguous(), dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int, *, stacked: bool = False,
                       direction: str = "none", site: str | None = None) -> torch.Tensor:
        """Sum over the group, then keep this rank's slice of ``dim``.

        ``stacked``: ``t``'s elements are the ranks' parts one after another, as an
        ``all_gather(stacked=True)`` result's are (no copy to cut out each part)."""
        dim = dim % t.dim()
        if stacked:
            return self.reduce_scatter(_stacked_parts(t, self.size, dim), 0, direction=direction,
                                       site=site).squeeze(0)
        if torch.compiler.is_dynamo_compiling():
            return t.clone() if self.size == 1 else self._traced_reduce_scatter(t, dim)
        self._log("reduce_scatter", t.numel(), t.element_size(), direction, site)
        if t.shape[dim] % self.size:
            raise ConfigurationError(
                f"reduce_scatter of dim {dim} with size {t.shape[dim]} over {self.size} ranks",
                fix="the scattered dimension must divide by the group size")
        if self.size == 1:
            return t.clone()
        return self._reduce_scatter(t.contiguous(), dim)

    def all_gather_start(self, t: torch.Tensor, dim: int, *, stacked: bool = False,
                         direction: str = "none", site: str | None = None) -> Pending:
        """``all_gather``, running in the background where the backend can (gloo's worker
        thread, NCCL's stream) while this thread computes: ``wait()`` returns the result.
        ``t`` must not change before then."""
        dim = dim % t.dim()
        if stacked:
            return self.all_gather_start(t.unsqueeze(0), 0, direction=direction,
                                         site=site).then(lambda x: _concatenated_shape(x, dim))
        if torch.compiler.is_dynamo_compiling() or self.size == 1:
            return Pending(self.all_gather(t, dim, direction=direction, site=site))
        self._log("all_gather", t.numel() * self.size, t.element_size(), direction, site)
        return self._all_gather_start(t.contiguous(), dim)

    def reduce_scatter_start(self, t: torch.Tensor, dim: int, *, stacked: bool = False,
                             direction: str = "none", site: str | None = None) -> Pending:
        """``reduce_scatter``, running in the background as ``all_gather_start`` does."""
        dim = dim % t.dim()
        if stacked:
            return self.reduce_scatter_start(_stacked_parts(t, self.size, dim), 0,
                                             direction=direction,
                                             site=site).then(lambda x: x.squeeze(0))
        if torch.compiler.is_dynamo_compiling() or self.size == 1 or t.shape[dim] % self.size:
            return Pending(self.reduce_scatter(t, dim, direction=direction, site=site))
        self._log("reduce_scatter", t.numel(), t.element_size(), direction, site)
        return self._reduce_scatter_start(t.contiguous(), dim)

    def _all_gather_start(self, t, dim) -> Pending:
        return Pending(self._all_gather(t, dim))  # a backend without background work

    def _reduce_scatter_start(self, t, dim) -> Pending:
        return Pending(self._reduce_scatter(t, dim))

    def broadcast(self, t: torch.Tensor, src: int = 0, *, site: str | None = None) -> torch.Tensor:
        """Rank ``src``'s tensor, on every rank."""
        self._log("broadcast", t.numel(), t.element_size(), "none", site)
        if self.size == 1:
            return t.clone()
        return self._broadcast(t.contiguous(), src)

    def send(self, t: torch.Tensor, dst: int, *, direction: str = "none",
             site: str | None = None) -> None:
        """Send ``t`` to group rank ``dst`` (blocks until ``t`` may be reused)."""
        self._check_peer(dst, "send")
        self._log("send", t.numel(), t.element_size(), direction, site, peer=dst)
        self._send(t.contiguous(), dst)

    def recv(self, t: torch.Tensor, src: int, *, direction: str = "none",
             site: str | None = None) -> torch.Tensor:
        """Receive group rank ``src``'s tensor into ``t`` (contiguous, of the sent shape
        and dtype) and return ``t``, as ``torch.distributed.recv`` does."""
        self._check_peer(src, "recv")
        _check_buffer(t)
        self._log("recv", t.numel(), t.element_size(), direction, site, peer=src)
        self._recv(t, src)
        return t

    def batch_isend_irecv(self, ops: list[P2POp], *, direction: str = "none",
                          site: str | None = None) -> Pending:
        """Start every ``P2POp`` at once (a pipeline's sends and receives of one step, in
        any order across ranks without deadlock); ``wait()`` returns the receive buffers
        in ``ops``' order, filled. Sent tensors must not change before then."""
        for op in ops:
            self._check_peer(op.peer, op.kind)
            if op.kind == "recv":
                _check_buffer(op.tensor)
        for op in ops:
            self._log(op.kind, op.tensor.numel(), op.tensor.element_size(), direction, site,
                      peer=op.peer)
        _CURRENT.op = ("batch_isend_irecv", site)
        if not ops:
            return Pending([])
        ops = [P2POp(op.kind, op.tensor.contiguous(), op.peer) for op in ops]
        return self._batch_isend_irecv(ops)

    def _check_peer(self, peer, kind: str) -> None:
        if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < self.size \
                or peer == self.rank:
            raise ConfigurationError(
                f"{kind} with peer {peer!r} on rank {self.rank} of a group of {self.size} "
                f"ranks: not another rank of the group",
                fix=f"name the peer by its rank within the group: 0 .. {self.size - 1}, "
                    f"other than this rank ({self.rank})")

    def barrier(self) -> None:
        _CURRENT.op = ("barrier", None)
        if self.size > 1:
            self._barrier()

    @property
    def device(self) -> torch.device:
        """Where tensors must live for this group's collectives."""
        return torch.device("cpu")

    traceable = False  #: whether ``torch.compile`` can trace its collectives (``_traced_*``)

    def __deepcopy__(self, memo):
        return self  # a group is a handle on ranks, never copied with a module

    def _log(self, kind, elements, elsize, direction, site, op="sum", peer=None):
        """Record the collective in the ledger; remember it for error messages."""
        _CURRENT.op = (kind, site)
        if ledger.recording():
            ledger.record(ledger.CommRecord(
                kind=kind, group_size=self.size, elements=elements,
                bytes=elements * elsize, direction=direction,
                site=site or caller_site(), op=op, peer=peer))

    def _checked(self, fn, *args, **kwargs):
        """``fn(...)``, its backend's errors as ``CommunicationError`` (here: as raised)."""
        return fn(*args, **kwargs)


@dataclass(frozen=True, eq=False)
class P2POp:
    """One transfer of a ``Group.batch_isend_irecv``: ``kind`` ``"send"`` sends ``tensor``
    to group rank ``peer``, ``"recv"`` receives into it from ``peer``."""

    kind: str
    tensor: torch.Tensor
    peer: int

    def __post_init__(self):
        if self.kind not in ("send", "recv"):
            raise ConfigurationError(f"P2POp kind {self.kind!r}", fix='say "send" or "recv"')


def _check_buffer(t: torch.Tensor) -> None:
    """A receive buffer must be contiguous: the backend writes its bytes in place."""
    if not t.is_contiguous():
        raise ConfigurationError(
            f"recv into a non-contiguous tensor of shape {tuple(t.shape)}",
            fix="receive into a contiguous buffer (torch.empty(shape, dtype=...)), then copy")


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_CURRENT = threading.local()  # .op: (kind, site) of this thread's latest collective


def _running() -> str:
    """``"kind at site"`` for this thread's current collective (for error messages)."""
    kind, site = getattr(_CURRENT, "op", ("collective", None))
    return f"{kind} at {site or caller_site()}"


def _secondary(e: CommunicationError) -> CommunicationError:
    """Mark ``e`` as caused by a peer (see the module docstring)."""
    e.secondary = True
    return e


def caller_site() -> str:
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


class Pending:
    """A collective in flight (``Group.all_gather_start``, ``reduce_scatter_start``):
    ``wait()`` blocks until it is done and returns its result (once)."""

    __slots__ = ("_result", "_work", "_group", "_op")

    def __init__(self, result, work=None, group: Group | None = None):
        """``result``: the value, or with ``work`` (anything with a ``wait()``: a c10d
        ``Work``, ``_AllOf`` several) a function making it once ``work`` is done; ``group``
        reports ``work``'s errors."""
        self._result, self._work, self._group = result, work, group
        self._op = getattr(_CURRENT, "op", None)  # what an error in wait() names

    def wait(self):
        if self._work is not None:
            _CURRENT.op = self._op
            self._group._checked(self._work.wait)
            self._work, self._result = None, self._result()
        return self._result

    def then(self, fn) -> Pending:
        """This collective, its result passed through ``fn`` (once it is done)."""
        if self._work is None:
            self._result = fn(self._result)
        else:
            result = self._result
            self._result = lambda: fn(result())
        return self


class _AllOf:
    """Several waits as one ``work`` of a ``Pending`` (a batch of point-to-point ops)."""

    def __init__(self, waits):
        self.waits = waits  # functions of no arguments, called in order

    def wait(self):
        for wait in self.waits:
            wait()


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
        self._traced_pg = pg if pg is not None else dist.group.WORLD  # funcol needs a group
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)

    @property
    def device(self) -> torch.device:
        backend = str(dist.get_backend(self.pg))
        if "nccl" in backend and "gloo" not in backend:  # NCCL alone: CUDA tensors only
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    traceable = True

    def _traced_all_reduce(self, t, op):
        return funcol.all_reduce(t, op, self._traced_pg)

    def _traced_all_gather(self, t, dim):
        return funcol.all_gather_tensor(t.contiguous(), dim, self._traced_pg)

    def _traced_reduce_scatter(self, t, dim):
        return funcol.reduce_scatter_tensor(t.contiguous(), "sum", dim, self._traced_pg)

    def _all_reduce(self, t, op):
        out = t.clone()
        self._checked(dist.all_reduce, out, op=_TORCH_OPS[op], group=self.pg)
        return out

    def _all_gather(self, t, dim):
        return self._all_gather_start(t, dim).wait()

    def _reduce_scatter(self, t, dim):
        return self._reduce_scatter_start(t, dim).wait()

    def _all_gather_start(self, t, dim):
        # one flat buffer, every rank's part stacked in front: a list all-gather and a
        # cat cost gloo 2-3x more (docs/benchmarks.md, "Sequence parallelism")
        out = t.new_empty(self.size * t.numel())
        work = self._checked(dist.all_gather_single, out, t.reshape(-1), group=self.pg,
                             async_op=True)
        return Pending(lambda: _unstack(out.view(self.size, *t.shape), dim), work, self)

    def _reduce_scatter_start(self, t, dim):
        parts = _stack(t, self.size, dim)  # [size, part]: rank r's part at r
        if self.device.type == "cuda":
            out = parts.new_empty(parts.shape[1:])
            work = self._checked(dist.reduce_scatter_single, out, parts, group=self.pg,
                                 async_op=True)
            return Pending(lambda: out, work, self)
        # gloo reduces a reduce-scatter over the whole tensor, as an all-reduce costs;
        # an all-to-all sends each rank only its part of every peer's tensor, summed here
        got = torch.empty_like(parts)
        work = self._checked(dist.all_to_all_single, got, parts, group=self.pg, async_op=True)
        return Pending(lambda: got.sum(0), work, self)

    def _broadcast(self, t, src):
        out = t.clone()
        self._checked(dist.broadcast, out, src=dist.get_global_rank(self.pg, src)
                      if self.pg is not None else src, group=self.pg)
        return out

    def _send(self, t, dst):
        self._checked(dist.send, t, group=self.pg, group_dst=dst)

    def _recv(self, t, src):
        self._checked(dist.recv, t, group=self.pg, group_src=src)

    def _batch_isend_irecv(self, ops):
        works = self._checked(dist.batch_isend_irecv, [
            dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, op.tensor,
                       group=self.pg, group_peer=op.peer) for op in ops])
        received = [op.tensor for op in ops if op.kind == "recv"]
        return Pending(lambda: received, _AllOf([w.wait for w in works]), self)

    def _barrier(self):
        self._checked(dist.barrier, group=self.pg)

    def _checked(self, fn, *args, **kwargs):
        """``fn(...)``, with gloo's/NCCL's errors (timeouts, dead peers, and the
        mismatches ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` finds) as ``CommunicationError``."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            what = _running()
            detail = str(e).splitlines()[0]
            fix = ("another rank died, diverged (skipped this collective, or called the model "
                   "with other input shapes) or is too slow; check its log. The timeout is "
                   "init_process_group(timeout=...); TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch "
                   "check every collective's shapes across ranks")
            if "Detected mismatch between collectives" in detail:
                message = f"ranks disagree at {what}: {detail}"
                fix = _SAME_SHAPES
            elif "timed out" in detail.lower() or "timeout" in detail.lower():
                limit = self._timeout()
                after = f" after {limit:g}s" if limit is not None else ""
                message = (f"rank {self.rank}: {what} timed out{after} (a peer never arrived): "
                           f"{detail}")
            else:
                message = f"rank {self.rank}: {what} failed: {detail}"
            raise _secondary(CommunicationError(message, fix=fix)) from e

    def _timeout(self) -> float | None:
        """The process group's collective timeout in seconds, where torch exposes it."""
        try:
            pg = self.pg or dist.group.WORLD
            return pg._get_backend(self.device).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):  # a backend without options: say no number
            return None


def _stack(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``t`` cut into ``n`` parts along ``dim``, stacked on a new dim 0 (contiguous)."""
    shape = (*t.shape[:dim], n, t.shape[dim] // n, *t.shape[dim + 1:])
    return t.reshape(shape).movedim(dim, 0).contiguous()


def in_stacked_order(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``t``'s ``n`` parts along ``dim`` one after another, in ``t``'s shape: the order
    ``all_gather(stacked=True)`` leaves them in (a copy; ``n`` must divide the dim)."""
    return _concatenated_shape(_stack(t, n, dim), dim)


def _stacked_parts(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``t``'s elements read as ``n`` parts of ``dim`` one after another, ``[n, *part]``
    (a view of a contiguous ``t``), as ``all_gather(stacked=True)`` orders them."""
    part = list(t.shape)
    if part[dim] % n:
        raise ConfigurationError(
            f"stacked parts of dim {dim} with size {part[dim]} over {n} ranks",
            fix="the scattered dimension must divide by the group size")
    part[dim] //= n
    return t.reshape(n, *part)


def _concatenated_shape(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """``[n, *part]`` with the shape of the parts concatenated along ``dim``, its
    elements left in order (the parts one after another): a view."""
    shape = list(parts.shape[1:])
    shape[dim] *= parts.shape[0]
    return parts.reshape(shape)


def _unstack(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of ``_stack``: ``[n, ...]`` parts concatenated along ``dim``."""
    if dim == 0:
        return parts.flatten(0, 1)
    shape = parts.shape[1:]
    return parts.movedim(0, dim).reshape(*shape[:dim], -1, *shape[dim + 1:])


_SAME_SHAPES = ("every rank of a tensor-parallel group must make the same collectives with "
                "tensors of the same shape and dtype: call the sharded model with the same "
                "inputs (the same batch and sequence shapes) on every rank of the group")


class Rendezvous:
    """Shared state of a ``ThreadGroup``: one slot per rank, a barrier, and who
    is waiting in it (to name the ranks that never arrived when it times out);
    a mailbox per (sender, receiver) pair for point-to-point transfers."""

    def __init__(self, size: int, timeout: float = 60.0):
        self.size, self.timeout = size, timeout
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.waiting = [False] * size
        self.returned: set[int] = set()  # ranks whose function returned (set by the runner)
        self.failed: int | None = None  # the first rank that failed (set by abort)
        self.progress = time.monotonic()  # last arrival, departure or return of any rank
        self.mail: dict[tuple[int, int], deque] = {}  # (src, dst): tensors sent, oldest first
        self.mail_changed = threading.Condition()  # guards mail; notified on post and abort

    def abort(self, failed: int | None = None) -> None:
        """Break the barrier and wake every receiver; every waiting rank raises.
        ``failed``: the rank that failed."""
        if self.failed is None:
            self.failed = failed
        self.barrier.abort()
        with self.mail_changed:
            self.mail_changed.notify_all()

    def post(self, src: int, dst: int, t: torch.Tensor) -> None:
        """Leave ``t`` in ``dst``'s mailbox from ``src`` (returns at once)."""
        with self.mail_changed:
            self.mail.setdefault((src, dst), deque()).append(t)
            self.progress = time.monotonic()
            self.mail_changed.notify_all()

    def take(self, src: int, dst: int) -> torch.Tensor:
        """The oldest tensor ``src`` sent ``dst``, waiting up to ``timeout`` for one."""
        deadline = time.monotonic() + self.timeout
        with self.mail_changed:
            while not self.mail.get((src, dst)):
                left = deadline - time.monotonic()
                if self.barrier.broken or left <= 0:
                    raise self._unsent(src, dst)
                self.mail_changed.wait(left)
            self.progress = time.monotonic()
            return self.mail[(src, dst)].popleft()

    def _unsent(self, src: int, dst: int) -> CommunicationError:
        if self.barrier.broken and self.failed is not None:
            return self._broken(dst)
        if self.barrier.broken:
            return _secondary(CommunicationError(
                f"simulated rank {dst}: {_running()} broke off: the run was aborted",
                fix="see the runner's error"))
        returned = " (it had returned)" if src in self.returned else ""
        return _secondary(CommunicationError(
            f"simulated rank {dst}: {_running()} timed out after {self.timeout:g}s: "
            f"rank {src} never sent{returned}",
            fix="every recv needs the peer's send, in the same order: the peer skipped this "
                "send or diverged; raise the timeout if it is only slow"))

    def wait(self, rank: int) -> None:
        self.waiting[rank] = True
        self.progress = time.monotonic()
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise self._broken(rank) from None  # waiting[rank] stays set: the run is over
        self.waiting[rank] = False
        self.progress = time.monotonic()

    def _broken(self, rank: int) -> CommunicationError:
        what = _running()
        if self.failed is not None:
            return _secondary(CommunicationError(
                f"simulated rank {rank}: {what} broke off: rank {self.failed} failed",
                fix=f"see rank {self.failed}'s error"))
        absent = [f"rank {r} never arrived" + (" (it had returned)" if r in self.returned else "")
                  for r in range(self.size) if not self.waiting[r]]
        return _secondary(CommunicationError(
            f"simulated rank {rank}: {what} timed out after {self.timeout:g}s: "
            f"{', '.join(absent) or 'a rank never arrived'}",
            fix="every rank must make the same collectives in the same order: a rank skipped "
                "this one or diverged (other control flow, inputs or model); raise the timeout "
                "if a rank is only slow"))


class ThreadGroup(Group):
    """N threads of one process exchanging tensors through a ``Rendezvous``.

    Reductions add the ranks' tensors in rank order, so every rank gets the
    bit-identical result, as a real all-reduce does.
    """

    def __init__(self, rank: int, rendezvous: Rendezvous):
        self.rank, self.size, self.rv = rank, rendezvous.size, rendezvous

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.rv.slots[self.rank] = (_CURRENT.op[0], t)
        self.rv.wait(self.rank)
        parts = list(self.rv.slots)
        self.rv.wait(self.rank)  # nobody overwrites a slot before everyone has read it
        if len({(k, p.shape, p.dtype) for k, p in parts}) > 1:  # every rank raises alike
            sent = "; ".join(f"rank {r} passes shape {tuple(p.shape)} {p.dtype} to {k}"
                             for r, (k, p) in enumerate(parts))
            raise CommunicationError(f"ranks disagree at {_running()}: {sent}", fix=_SAME_SHAPES)
        return [p for _, p in parts]

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
        self.rv.wait(self.rank)

    def _send(self, t, dst):
        self.rv.post(self.rank, dst, t.detach().clone())  # the sender may reuse t at once

    def _recv(self, t, src):
        got = self.rv.take(src, self.rank)
        if (got.shape, got.dtype) != (t.shape, t.dtype):
            raise CommunicationError(
                f"ranks disagree at {_running()}: rank {src} sent shape {tuple(got.shape)} "
                f"{got.dtype}, rank {self.rank} receives into shape {tuple(t.shape)} {t.dtype}",
                fix="receive into a buffer of the shape and dtype the peer sends")
        with torch.no_grad():
            t.copy_(got)

    def _batch_isend_irecv(self, ops):
        for op in ops:
            if op.kind == "send":
                self._send(op.tensor, op.peer)
        recvs = [op for op in ops if op.kind == "recv"]
        waits = [lambda op=op: self._recv(op.tensor, op.peer) for op in recvs]
        return Pending(lambda: [op.tensor for op in recvs], _AllOf(waits), self)


def as_group(group=None) -> Group:
    """A ``Group`` from ``None`` (default process group), a process group or a Group."""
    if isinstance(group, Group):
        return group
    return TorchGroup(group)
