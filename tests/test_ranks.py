"""Both rank runners behind one interface: collectives, ledger, failures, autograd.

Functions run on the ranks are top-level so ``RealRanks`` can pickle them.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import shardplan
from shardplan.errors import CommunicationError
from shardplan.models import build
from shardplan.ranks import RealRanks, SimulatedRanks
from shardplan.runtime import copy_to_region
from shardplan.runtime.consistency import agree
from shardplan.runtime.ledger import CommLedger

pytestmark = pytest.mark.timeout(120)

KINDS = ["simulated", pytest.param("real", marks=pytest.mark.real)]


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"n{n}")
def ranks(request, kind, real_ranks, sim_ranks):
    return (real_ranks if kind == "real" else sim_ranks)(request.param)


def _runner(kind, n, timeout):
    return RealRanks(n, timeout=timeout) if kind == "real" else SimulatedRanks(n, timeout=timeout)


def _message(e: BaseException) -> str:
    return "\n".join([str(e), *getattr(e, "__notes__", [])])


# -- functions run on every rank ----------------------------------------------

def _base(rank):
    return torch.arange(6.0).reshape(2, 3) + 10 * rank


def _all_reduce(ctx, op):
    return ctx.group.all_reduce(_base(ctx.rank), op)


def _all_gather(ctx, dim):
    return ctx.group.all_gather(_base(ctx.rank), dim)


def _reduce_scatter(ctx):
    n = ctx.world_size
    return ctx.group.reduce_scatter(torch.arange(2.0 * n * 3).reshape(2 * n, 3) + ctx.rank, 0)


def _broadcast(ctx):
    return ctx.group.broadcast(torch.full((3,), float(ctx.rank)), src=ctx.world_size - 1)


def _ledger(ctx):
    g = ctx.group
    with CommLedger() as led:
        g.all_reduce(torch.ones(4, 3), direction="forward")
        g.all_reduce(torch.ones(5, dtype=torch.float64), "max", direction="backward")
        g.all_gather(torch.ones(2, 3), -1, direction="forward")
        g.reduce_scatter(torch.ones(ctx.world_size * 2, 3), 0, direction="backward")
        g.broadcast(torch.ones(7, dtype=torch.int32))
    return led.records


def _identity(ctx):
    return ctx.rank, ctx.world_size, ctx.group.rank, ctx.group.size


def _raise_on_rank1(ctx):
    if ctx.rank == 1:
        raise ValueError("bad input on this rank")
    return ctx.rank


def _agree_on_rank1_failure(ctx):
    """Every rank raises together; returns what each rank caught."""
    try:
        agree(ctx.group, "the test step", lambda: _raise_on_rank1(ctx), fix="feed it better")
    except CommunicationError as e:
        return type(e.__cause__).__name__, getattr(e, "secondary", False), str(e)
    return None


def _agree_all_fine(ctx):
    return agree(ctx.group, "the test step", lambda: 10 * ctx.rank)


def _raise_on_rank1_peers_in_collective(ctx, error):
    if ctx.rank == 1:
        raise error
    return ctx.group.all_reduce(torch.ones(2))


def _shapes_differ(ctx):
    return ctx.group.all_reduce(torch.ones(4 - ctx.rank), site="the test's site")


_SHARDED: dict = {}  # per worker process (RealRanks): the model _parallelize_gpt built


def _parallelize_gpt(ctx, timeout):
    """gpt-tiny parallelized over a new group whose collectives time out after ``timeout``."""
    torch.manual_seed(0)
    group = dist.new_group(timeout=timedelta(seconds=timeout))
    _SHARDED[ctx.rank] = shardplan.parallelize(build("gpt-tiny", n_layer=1), group=group,
                                               example_inputs=torch.zeros(2, 4, dtype=torch.long))


def _forward_on_rank0_only(ctx):
    if ctx.rank == 0:  # rank 1 diverged: it never runs the forward
        _SHARDED[ctx.rank](torch.zeros(2, 4, dtype=torch.long))


def _skip_collective_on_rank1(ctx):
    if ctx.rank == 1:
        return None
    return ctx.group.all_reduce(torch.ones(2))


def _skip_collective_on_rank1_slow_report(ctx):
    """As above, but rank 0 takes 2 s more to report its timeout, as on a loaded machine."""
    try:
        return _skip_collective_on_rank1(ctx)
    except CommunicationError:
        time.sleep(2.0)
        raise


def _exit_on_rank1(ctx):
    if ctx.rank == 1:
        os._exit(3)
    return ctx.group.all_reduce(torch.ones(2))


def _sleep_on_rank1(ctx, seconds):
    if ctx.rank == 1:
        time.sleep(seconds)
    return ctx.rank


def _backward(ctx):
    x = torch.ones(3, requires_grad=True)
    with CommLedger() as led:
        y = copy_to_region(x, ctx.group)  # Megatron's f: the gradient is all-reduced
        (y * (ctx.rank + 1)).sum().backward()
    return x.grad, [(r.kind, r.direction) for r in led.records]


# -- collectives ----------------------------------------------------------------

def test_context(ranks):
    n = ranks.world_size
    assert ranks.run(_identity) == [(r, n, r, n) for r in range(n)]


@pytest.mark.parametrize("op", ["sum", "max"])
def test_all_reduce(ranks, op):
    n = ranks.world_size
    base = torch.arange(6.0).reshape(2, 3)
    want = n * base + 10 * n * (n - 1) / 2 if op == "sum" else base + 10 * (n - 1)
    for got in ranks.run(_all_reduce, op):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dim", [0, -1])
def test_all_gather(ranks, dim):
    n = ranks.world_size
    want = torch.cat([torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(n)], dim)
    assert want.shape == ((2 * n, 3) if dim == 0 else (2, 3 * n))
    for got in ranks.run(_all_gather, dim):
        torch.testing.assert_close(got, want)


def test_reduce_scatter(ranks):
    n = ranks.world_size
    total = n * torch.arange(2.0 * n * 3).reshape(2 * n, 3) + n * (n - 1) / 2
    for r, got in enumerate(ranks.run(_reduce_scatter)):
        torch.testing.assert_close(got, total[2 * r:2 * r + 2])


def test_broadcast(ranks):
    n = ranks.world_size
    for got in ranks.run(_broadcast):
        torch.testing.assert_close(got, torch.full((3,), float(n - 1)))


def test_ledger(ranks):
    n = ranks.world_size
    want = [("all_reduce", 12, 48, "forward", "sum"),
            ("all_reduce", 5, 40, "backward", "max"),
            ("all_gather", 6 * n, 24 * n, "forward", "sum"),
            ("reduce_scatter", 6 * n, 24 * n, "backward", "sum"),
            ("broadcast", 7, 28, "none", "sum")]
    for records in ranks.run(_ledger):
        assert [(r.kind, r.elements, r.bytes, r.direction, r.op) for r in records] == want
        assert all(r.group_size == n for r in records)
        assert all("test_ranks.py" in r.site for r in records), records


@pytest.mark.parametrize("n", [1, 2, 4], ids=lambda n: f"n{n}")
def test_backward_through_collective(kind, n, real_ranks, sim_ranks):
    ranks = (real_ranks if kind == "real" else sim_ranks)(n)
    for grad, log in ranks.run(_backward):
        torch.testing.assert_close(grad, torch.full((3,), n * (n + 1) / 2))
        assert log == [("all_reduce", "backward")]


# -- failures ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", [
    "simulated",
    pytest.param("real", marks=pytest.mark.real)])
def test_error_names_rank(kind, real_ranks, sim_ranks):
    ranks = (real_ranks if kind == "real" else sim_ranks)(2)
    with pytest.raises(ValueError, match="bad input on this rank") as info:
        ranks.run(_raise_on_rank1)
    assert "rank 1" in _message(info.value)


def test_agree_raises_on_every_rank_quoting_the_root_cause(ranks):
    n = ranks.world_size
    assert ranks.run(_agree_all_fine) == [10 * r for r in range(n)]
    if n == 1:
        return
    caught = ranks.run(_agree_on_rank1_failure)
    cause, secondary, message = caught[1]  # the failed rank: its own error, wrapped
    assert (cause, secondary) == ("ValueError", False)
    assert "the test step failed on rank 1: ValueError: bad input" in message
    assert "fix: feed it better" in message
    for r in set(range(n)) - {1}:  # its peers: a secondary error quoting it
        cause, secondary, message = caught[r]
        assert secondary and "the test step failed on rank 1:" in message
        assert "bad input on this rank" in message and "rank 1's error is quoted" in message


def test_error_surfaces(kind, real_ranks, sim_ranks):
    ranks = (real_ranks if kind == "real" else sim_ranks)(2)
    with pytest.raises(ValueError, match="bad input on this rank"):
        ranks.run(_raise_on_rank1)
    assert ranks.run(_identity)[1] == (1, 2, 1, 2)  # still usable


def test_error_while_peers_wait_in_collective(kind):
    """The root cause wins over the peers' broken collectives, and fast, even when
    it is a CommunicationError itself (a broken real pool respawns in between)."""
    with _runner(kind, 2, timeout=60) as ranks:
        for error in [KeyError("missing"), CommunicationError("missing", fix="none needed")]:
            if kind == "real":
                ranks.start()
            t0 = time.monotonic()
            with pytest.raises(type(error), match="missing") as info:
                ranks.run(_raise_on_rank1_peers_in_collective, error)
            # well before the 60 s group timeout (a generous bound for a loaded machine)
            assert time.monotonic() - t0 < 40
            if kind == "real":
                assert "[rank 1] traceback" in _message(info.value)
                assert not ranks.alive  # killed: rank 0 was stuck in the collective


@pytest.mark.timeout(60)
def test_rank_skips_collective(kind):
    """Rank 1 returns while rank 0 all-reduces: CommunicationError within the timeout."""
    timeout = 5.0
    with _runner(kind, 2, timeout=timeout) as ranks:
        if kind == "real":
            ranks.start()
        t0 = time.monotonic()
        with pytest.raises(CommunicationError, match="all_reduce at .*test_ranks.py:[0-9]+ "
                                                     "timed out after 5s") as info:
            ranks.run(_skip_collective_on_rank1)
        elapsed = time.monotonic() - t0
        # waited for the timeout, and did not hang (a loaded machine may run late)
        assert timeout * 0.5 <= elapsed < 45, elapsed
        absent = "rank 1 never arrived" if kind == "simulated" else "rank 1 had returned from fn"
        assert absent in _message(info.value)


@pytest.mark.real
@pytest.mark.timeout(60)
def test_collective_timeout_reports_first_when_the_report_is_slow():
    """Rank 1 answers at once; rank 0's collective times out after 5 s and its error takes
    2 s more to come back. The pool, whose wait restarted at rank 1's answer, must still
    be waiting: the collective's timeout is what gets reported, not 'did not answer'."""
    with RealRanks(2, timeout=5.0) as ranks:
        ranks.start()
        with pytest.raises(CommunicationError, match="all_reduce at .*test_ranks.py:[0-9]+ "
                                                     "timed out after 5s") as info:
            ranks.run(_skip_collective_on_rank1_slow_report)
        assert "did not answer" not in _message(info.value)
        assert "rank 1 had returned from fn" in _message(info.value)


def test_ranks_disagree_on_shape(kind, monkeypatch):
    """Simulated ranks compare shapes; gloo does so under TORCH_DISTRIBUTED_DEBUG=DETAIL
    (without, rank 1 gets a wrong sum and rank 0 times out)."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # read by the spawned workers
    with _runner(kind, 2, timeout=90) as ranks:
        t0 = time.monotonic()
        with pytest.raises(CommunicationError,
                           match="ranks disagree at all_reduce at the test's site") as info:
            ranks.run(_shapes_differ)
        # found by comparing shapes, not by the 90 s timeout (real: start-up included)
        assert time.monotonic() - t0 < 75
    if kind == "simulated":
        assert "rank 0 passes shape (4,)" in str(info.value)
        assert "rank 1 passes shape (3,)" in str(info.value)


@pytest.mark.real
@pytest.mark.timeout(90)
def test_real_collective_timeout_names_site_and_absent_rank():
    """A rank that skips a sharded model's forward: its peer fails within the group's
    timeout, naming the collective's site in the model and the rank that returned."""
    timeout = 3
    with RealRanks(2, timeout=60) as ranks:
        ranks.run(_parallelize_gpt, timeout)
        t0 = time.monotonic()
        with pytest.raises(CommunicationError, match=r"rank 0: all_reduce at \S*transformer\.wte "
                                                     r"timed out after 3s") as info:
            ranks.run(_forward_on_rank0_only)
        elapsed = time.monotonic() - t0
        assert timeout * 0.5 <= elapsed < 45, elapsed  # the 3 s timeout, not the pool's 60 s
        assert "rank 1 had returned from fn" in _message(info.value)


@pytest.mark.real
@pytest.mark.timeout(60)
def test_real_dead_worker_fails_fast():
    with RealRanks(2, timeout=60) as ranks:
        ranks.start()
        t0 = time.monotonic()
        with pytest.raises(CommunicationError, match=r"rank 1 died .*exit code 3"):
            ranks.run(_exit_on_rank1)
        assert time.monotonic() - t0 < 40  # before the 60 s collective timeout
        assert not ranks.alive
        assert ranks.run(_identity) == [(0, 2, 0, 2), (1, 2, 1, 2)]


@pytest.mark.real
@pytest.mark.timeout(60)
def test_real_stuck_rank_is_named_and_pool_killed():
    with RealRanks(2, timeout=3) as ranks:
        ranks.start()
        procs = list(ranks._procs)
        t0 = time.monotonic()
        with pytest.raises(CommunicationError, match=r"ranks \[1\] did not answer"):
            ranks.run(_sleep_on_rank1, 60)
        assert time.monotonic() - t0 < 40  # the 3 s timeout, not the rank's 60 s sleep
        assert not ranks.alive and not any(p.is_alive() for p in procs)


def _environment(ctx, name):
    return os.environ.get(name), os.getppid()


@pytest.mark.real
@pytest.mark.timeout(90)
def test_real_workers_take_the_pools_environment_not_the_fork_servers(monkeypatch):
    """Workers fork from a server started with the first pool: a pool started after the
    environment changed sees the change (and one removed is gone), on every rank."""
    monkeypatch.setenv("SHARDPLAN_TEST_ENV", "before")
    with RealRanks(2) as first:
        assert [v for v, _ in first.run(_environment, "SHARDPLAN_TEST_ENV")] == ["before"] * 2
    monkeypatch.setenv("SHARDPLAN_TEST_ENV", "after")
    with RealRanks(2) as second:
        got = second.run(_environment, "SHARDPLAN_TEST_ENV")
        assert [v for v, _ in got] == ["after"] * 2
        assert all(parent != os.getpid() for _, parent in got)  # forked by the server
    monkeypatch.delenv("SHARDPLAN_TEST_ENV")
    with RealRanks(1) as third:
        assert third.run(_environment, "SHARDPLAN_TEST_ENV")[0][0] is None


@pytest.mark.real
@pytest.mark.timeout(60)
def test_real_closed_pool_refuses():
    ranks = RealRanks(1)
    assert ranks.run(_identity) == [(0, 1, 0, 1)]
    procs = list(ranks._procs)
    ranks.close()
    assert not any(p.is_alive() for p in procs)
    assert all(p.exitcode == 0 for p in procs)
    with pytest.raises(Exception, match="after close"):
        ranks.run(_identity)


@pytest.mark.real
def test_real_unpicklable_fn(real_ranks):
    with pytest.raises(Exception, match="top-level function"):
        real_ranks(2).run(lambda ctx: ctx.rank)


@pytest.mark.real
def test_real_results_are_independent_copies(real_ranks):
    a, b = real_ranks(2).run(_broadcast)
    a.add_(1)
    torch.testing.assert_close(b, torch.full((3,), 1.0))
