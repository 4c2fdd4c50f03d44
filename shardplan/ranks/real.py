"""N ranks as N gloo worker processes that stay alive between runs.

    with RealRanks(2) as ranks:
        ranks.run(fn, x)      # fn(ctx, x) on every rank; fn a top-level function

Workers are started lazily by the first ``run()`` (or by ``start()``), each
joins one gloo process group over a ``TCPStore`` held by this process on
127.0.0.1 (collective timeout = ``timeout``; one torch thread per worker), and
then serves tasks. They fork from multiprocessing's fork server (spawn where
the platform has none), which imports torch and this package once per process:
the first pool costs the imports (seconds), later pools and respawns a
fraction of a second (``spawn_seconds`` holds the last). A worker takes the
environment of the pool's process as it is when the pool starts, not the
server's. Tasks and results travel as plain pickles through one pipe per
worker, so every rank gets its own copy of the arguments (nothing is shared
memory) and returned tensors are detached, compacted CPU copies.

A worker's captures are shared within one run (``planner.shared_capture``: a
model of the same structure, called the same way, is exported once); with
``keep_captures`` each worker keeps them for the pool's life, so later runs
reuse them too (safe while the code the models call does not change between
runs, as in a test session).

Failures: an exception on a rank is re-raised here with its type (when it
pickles) and the rank's traceback appended; of several, a rank's own error
wins over the collective failures it caused in its peers. A collective
timeout names the collective's site, and a note names the ranks that had
returned without joining it. If a rank does not answer within ``timeout``
(plus a short grace, so gloo's own timeout can report first; once a peer
has answered, plus several seconds of ``report_slack``), dies, or
reports a ``CommunicationError``, or a rank fails while its peers stay
stuck, the pool is killed and ``run()`` raises; the next ``run()`` spawns a
fresh pool. After ``close()``, ``run()`` raises ``ConfigurationError``.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import CommunicationError, ConfigurationError
from ..planner.shared_capture import CaptureShare, sharing
from ..runtime.comm import TorchGroup
from ..torch_compat import pytree
from .base import RankContext, Ranks, check_world_size, grace, root_cause

_HOST = "127.0.0.1"


class RealRanks(Ranks):
    """A pool of ``world_size`` gloo worker processes (see the module docstring)."""

    def __init__(self, world_size: int, timeout: float = 120.0, startup_timeout: float = 180.0,
                 keep_captures: bool = False):
        check_world_size(world_size)
        self.world_size, self.timeout = world_size, float(timeout)
        self.keep_captures = keep_captures
        # spawning Python and importing torch takes seconds, more on a loaded machine:
        # start-up gets its own limit, so a short collective timeout stays usable
        self.startup_timeout = max(float(startup_timeout), self.timeout)
        self.spawn_seconds: float | None = None  # wall time of the last start()
        self._procs: list = []
        self._conns: list = []
        self._store = None
        self._closed = False
        self._lock = threading.Lock()

    # -- pool life cycle -------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs)

    def start(self) -> None:
        """Spawn the workers and wait until all joined the process group."""
        if self._closed:
            raise ConfigurationError("RealRanks.run() after close()",
                                     fix="create a new RealRanks")
        if self._procs:
            return
        t0 = time.monotonic()
        ctx = _start_context()
        self._store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.timeout))
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, name=f"shardplan-rank{rank}", daemon=True,
                            args=(rank, self.world_size, self._store.port, self.timeout,
                                  self.startup_timeout, self.keep_captures, dict(os.environ),
                                  child))
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        replies, errors = self._collect(self.startup_timeout, "start-up")
        if errors or len(replies) < self.world_size:
            self._kill()
            raise root_cause(errors)
        self.spawn_seconds = time.monotonic() - t0

    def close(self) -> None:
        """Barrier + destroy_process_group in every worker, then join them."""
        self._closed = True
        if not self._procs:
            return
        try:
            for c in self._conns:
                c.send_bytes(pickle.dumps(None))
            self._collect(min(self.timeout, 30.0), "close")
        except (OSError, CommunicationError):
            pass
        for p in self._procs:
            p.join(5.0)
        self._kill()

    def _kill(self) -> None:
        """Terminate, then kill, every worker; forget the pool."""
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for c in self._conns:
            c.close()
        self._procs, self._conns, self._store = [], [], None

    # -- running tasks ---------------------------------------------------
    def run(self, fn, *args):
        with self._lock:
            self.start()
            try:
                task = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:
                raise ConfigurationError(
                    f"RealRanks cannot send {getattr(fn, '__qualname__', fn)!r} and its "
                    f"arguments to the workers: {e}",
                    fix="fn must be a top-level function and its arguments picklable") from e
            try:
                for c in self._conns:
                    c.send_bytes(task)
            except OSError as e:
                self._kill()
                raise CommunicationError(f"a RealRanks worker is gone: {e}") from e
            try:
                replies, errors = self._collect(self.timeout + grace(self.timeout), "task")
            except BaseException:  # interrupted (Ctrl-C, test timeout): results would go stale
                self._kill()
                raise
            if any(isinstance(e, CommunicationError) for e in errors.values()):
                self._kill()  # peers may be stuck or out of step: respawn next run
            if errors:
                error = root_cause(errors)
                if getattr(error, "secondary", False) and replies:
                    error.add_note(", ".join(f"rank {r}" for r in sorted(replies)) +
                                   " had returned from fn without joining this collective")
                raise error
            return [replies[r] for r in range(self.world_size)]

    def _collect(self, timeout: float, what: str):
        """One reply per rank: (results by rank, errors by rank).

        Fails fast when a worker dies; once a rank has failed, waits only a
        short grace for the others. Each answer restarts the wait for the rest,
        with ``report_slack`` on top: they may be in a collective the answered rank
        skipped, which their own timeout reports by name, and on a loaded machine
        raising, formatting and sending that error takes a while; the pool must
        not give up first. Missing ranks are reported as errors.
        """
        start = time.monotonic()
        deadline = start + timeout
        replies: dict = {}
        errors: dict = {}
        pending = dict(enumerate(self._conns))
        while pending:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, now + grace(self.timeout))
            ready = wait(list(pending.values()) +
                         [self._procs[r].sentinel for r in pending], max(0.0, deadline - now))
            for r, c in list(pending.items()):
                if c in ready:
                    try:
                        ok, payload = pickle.loads(c.recv_bytes())
                    except (EOFError, OSError):
                        ok, payload = False, self._died(r, what)
                    except Exception as e:  # a result that does not unpickle here
                        ok, payload = False, e
                    del pending[r]
                    if ok:
                        replies[r] = payload
                        deadline = max(deadline, time.monotonic() + timeout
                                       + report_slack(self.timeout))
                    else:
                        errors[r] = payload if isinstance(payload, BaseException) \
                            else _rebuild(r, *payload)
            for r in [r for r in pending if not self._procs[r].is_alive()
                      and not pending[r].poll()]:
                del pending[r]
                errors[r] = self._died(r, what)
            if pending and time.monotonic() >= deadline:
                late = sorted(pending)
                after = f" (ranks {sorted(errors)} had failed)" if errors else ""
                for r in late:
                    errors[r] = CommunicationError(
                        f"RealRanks ranks {late} did not answer {what} within "
                        f"{time.monotonic() - start:.1f}s{after}",
                        fix="a rank is stuck (in a collective its peers skipped, or in fn); "
                            "the pool was killed. Raise timeout for slow work")
                    errors[r].secondary = bool(after)  # stuck waiting for the failed ranks
                break
        return replies, errors

    def _died(self, rank: int, what: str) -> CommunicationError:
        p = self._procs[rank]
        p.join(1.0)
        return CommunicationError(
            f"RealRanks rank {rank} died during {what} (exit code {p.exitcode})",
            fix="see the worker's output above; it crashed or was killed")


def _start_context():
    """Multiprocessing's fork server, preloaded with this module (so torch), where the
    platform has one; spawn elsewhere."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _rebuild(rank: int, exc_bytes, type_name: str, message: str, tb: str) -> BaseException:
    """The worker's exception with ``[rank r] traceback`` appended to its message."""
    tail = f"\n\n[rank {rank}] traceback:\n{tb.rstrip()}"
    exc = None
    if exc_bytes is not None:
        try:
            exc = pickle.loads(exc_bytes)
        except Exception:
            exc = None
    if exc is None:
        return RuntimeError(f"{type_name}: {message}{tail}")
    if (len(exc.args) == 1 and isinstance(exc.args[0], str) and not isinstance(exc, KeyError)
            and type(exc).__str__ is BaseException.__str__):
        exc.args = (exc.args[0] + tail,)
    else:
        exc.add_note(tail.lstrip("\n"))
    return exc


def _portable(x):
    """Results cross as detached, compact CPU tensors."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.untyped_storage().nbytes() != x.numel() * x.element_size() or x.storage_offset():
            x = x.clone()
    return x


def _send(conn, ok: bool, payload) -> None:
    conn.send_bytes(pickle.dumps((ok, payload), protocol=pickle.HIGHEST_PROTOCOL))


def _send_error(conn, e: BaseException) -> None:
    tb = "".join(traceback.format_exception(e))
    try:
        exc_bytes = pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(exc_bytes)
    except Exception:
        exc_bytes = None
    _send(conn, False, (exc_bytes, type(e).__qualname__, str(e), tb))


def _all_arrived(store, n: int, limit: float) -> None:
    """Wait until all ``n`` workers have started (they spawn seconds apart under load)."""
    store.add("arrived", 1)
    deadline = time.monotonic() + limit
    while store.add("arrived", 0) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {store.add('arrived', 0)} of {n} workers started "
                               f"within {limit}s")
        time.sleep(0.01)


def report_slack(timeout: float) -> float:
    """How long past a collective's timeout the pool waits, after a rank has answered,
    for the ranks still out: enough for a stuck rank's own timeout error to reach it
    first on a busy machine (seconds, not ``grace``'s fraction of one)."""
    return max(grace(timeout), min(timeout, 10.0))


def _worker(rank: int, n: int, port: int, timeout: float, startup: float, keep_captures: bool,
            environ: dict, conn) -> None:
    """Body of one worker process: join the group, then serve tasks until told to stop.
    Forked from the fork server, it takes the pool's environment as it is now."""
    os.environ.clear()
    os.environ.update(environ)
    dist.set_debug_level_from_env()
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=timedelta(seconds=startup))
        _all_arrived(store, n, startup)  # gloo's connect waits only `timeout` for late peers
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n,
                                timeout=timedelta(seconds=timeout))
        ctx = RankContext(rank, n, TorchGroup())
        kept = CaptureShare() if keep_captures else None
        _send(conn, True, None)
    except BaseException as e:
        _send_error(conn, e)
        return
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            return
        try:
            task = pickle.loads(msg)
            if task is None:
                break
            fn, args = task
            with sharing(CaptureShare() if kept is None else kept):
                result = fn(ctx, *args)
            _send(conn, True, pytree.tree_map(_portable, result))
        except BaseException as e:
            try:
                _send_error(conn, e)
            except (EOFError, OSError):
                return
    try:  # close(): barrier first; teardown without one can SIGABRT
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        pass  # a broken group: the process exits anyway
    _send(conn, True, None)
