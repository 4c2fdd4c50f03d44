"""Point-to-point transfers on both rank runners: send, recv, batch_isend_irecv.

Every received tensor is compared with the one its sender made, written out here
by hand; peers are ranks within the group. Functions run on the ranks are
top-level so ``RealRanks`` can pickle them.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shardplan.errors import CommunicationError, ConfigurationError, ShardplanError
from shardplan.ranks import SimulatedRanks
from shardplan.runtime import CommLedger, P2POp, ThreadGroup, TorchGroup
from shardplan.runtime.comm import Rendezvous

pytestmark = pytest.mark.timeout(60)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64],
                                 ids=str)
ELEMENT_SIZE = {torch.float32: 4, torch.bfloat16: 2, torch.int64: 8}


@pytest.fixture(params=[("simulated", 2), ("simulated", 4),
                        pytest.param(("real", 2), marks=pytest.mark.real)],
                ids=lambda p: f"{p[0]}-n{p[1]}")
def ranks(request, real_ranks, sim_ranks):
    kind, n = request.param
    return (real_ranks if kind == "real" else sim_ranks)(n)


def _made_by(rank, dtype):
    """The tensor rank ``rank`` sends."""
    return (torch.arange(6).reshape(2, 3) + 100 * rank).to(dtype)


def _expected(rank, dtype):
    """``_made_by(rank)`` written out, to compare received tensors with."""
    return torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int64).add(100 * rank).to(dtype)


def _logged(led):
    return [(r.kind, r.peer, r.elements, r.bytes, r.site, r.group_size) for r in led.records]


# -- functions run on every rank ----------------------------------------------------

def _ring(ctx, dtype):
    """Each rank sends to rank + 1 and receives from rank - 1, in one batch."""
    g, n = ctx.group, ctx.world_size
    with CommLedger() as led:
        pending = g.batch_isend_irecv([P2POp("send", _made_by(ctx.rank, dtype), (ctx.rank + 1) % n),
                                       P2POp("recv", torch.empty(2, 3, dtype=dtype),
                                             (ctx.rank - 1) % n)], site="the ring")
        (got,) = pending.wait()
    return got, _logged(led)


def _pairs(ctx, dtype):
    """Ranks 2k and 2k+1: the even one sends its tensor, the odd one sends it back
    doubled plus its rank, with blocking send and recv."""
    g, r = ctx.group, ctx.rank
    with CommLedger() as led:
        buf = torch.empty(2, 3, dtype=dtype)
        if r % 2 == 0:
            g.send(_made_by(r, dtype), r + 1, site="out")
            got = g.recv(buf, r + 1, site="back")
        else:
            got = g.recv(buf, r - 1, site="out")
            g.send(got * 2 + r, r - 1, site="back")
    return got, got is buf, _logged(led)


def _chain(ctx):
    """A pipeline's forward: rank r > 0 receives from r - 1, adds r, sends on to r + 1."""
    g, r, n = ctx.group, ctx.rank, ctx.world_size
    x = _made_by(0, torch.float64) if r == 0 else g.recv(torch.empty(2, 3, dtype=torch.float64),
                                                         r - 1) + r
    if r < n - 1:
        g.send(x, r + 1)
    return x


def _subgroup_pair(ctx):
    """Four ranks, groups {0, 2} and {1, 3}: group rank 0 sends to group rank 1."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    g = TorchGroup(groups[ctx.rank % 2])
    with CommLedger() as led:
        if g.rank == 0:
            g.send(_made_by(ctx.rank, torch.float32), 1)
            got = None
        else:
            got = g.recv(torch.empty(2, 3), 0)
    return g.rank, got, [(r.kind, r.peer) for r in led.records]


def _recv_unsent(ctx, batched, group=None):
    """Rank 1 waits for a tensor rank 0 never sends."""
    g = group or ctx.group
    if ctx.rank == 1:
        if batched:
            g.batch_isend_irecv([P2POp("recv", torch.empty(3), 0)], site="the lost batch").wait()
        else:
            g.recv(torch.empty(3), 0, site="the lost send")
    return ctx.rank


def _caught_recv_unsent(ctx, batched, timeout):
    """``_recv_unsent`` on a new group timing out after ``timeout`` s: (error, seconds)
    on rank 1, caught there; then every rank drops the broken group, so the pool lives on."""
    pg = dist.new_group(timeout=timedelta(seconds=timeout))
    t0 = time.monotonic()
    try:
        _recv_unsent(ctx, batched, TorchGroup(pg))
        return None
    except CommunicationError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    finally:
        ctx.group.barrier()  # rank 0 keeps its end open until rank 1 has timed out
        dist.destroy_process_group(pg)


def _recv_while_peer_fails(ctx):
    if ctx.rank == 0:
        raise ValueError("rank 0 fails before sending")
    return ctx.group.recv(torch.empty(3), 0)


def _bad_peers(ctx):
    """(peer, is a ShardplanError, message) of each op with a peer outside the group or self."""
    g, out = ctx.group, []
    for peer in [ctx.world_size, -1, ctx.rank]:
        for call in [lambda: g.send(torch.ones(3), peer),
                     lambda: g.recv(torch.empty(3), peer),
                     lambda: g.batch_isend_irecv([P2POp("send", torch.ones(3), peer)])]:
            try:
                call()
                out.append((peer, False, "no error"))
            except Exception as e:
                out.append((peer, isinstance(e, ShardplanError), str(e)))
    return out


def _recv_wrong_shape(ctx):
    if ctx.rank == 0:
        ctx.group.send(torch.ones(4), 1)
    else:
        ctx.group.recv(torch.empty(3), 0, site="the short buffer")


# -- tests ----------------------------------------------------------------------------

@DTYPES
def test_ring_exchange(ranks, dtype):
    n = ranks.world_size
    nbytes = 6 * ELEMENT_SIZE[dtype]
    for r, (got, logged) in enumerate(ranks.run(_ring, dtype)):
        assert got.dtype == dtype
        assert torch.equal(got, _expected((r - 1) % n, dtype)), (r, got)
        assert logged == [("send", (r + 1) % n, 6, nbytes, "the ring", n),
                          ("recv", (r - 1) % n, 6, nbytes, "the ring", n)]


@DTYPES
def test_send_recv_pairs(ranks, dtype):
    nbytes = 6 * ELEMENT_SIZE[dtype]
    n = ranks.world_size
    for r, (got, is_buffer, logged) in enumerate(ranks.run(_pairs, dtype)):
        want = _expected(r - 1, dtype) if r % 2 else _expected(r, dtype) * 2 + (r + 1)
        assert got.dtype == dtype
        assert torch.equal(got, want), (r, got)
        assert is_buffer  # recv fills the given buffer and returns it
        peer = r + 1 if r % 2 == 0 else r - 1
        first, second = ("send", "recv") if r % 2 == 0 else ("recv", "send")
        assert logged == [(first, peer, 6, nbytes, "out", n), (second, peer, 6, nbytes, "back", n)]


def test_chain_through_every_rank(ranks):
    for r, got in enumerate(ranks.run(_chain)):
        assert torch.equal(got, _expected(0, torch.float64) + r * (r + 1) / 2), (r, got)


@pytest.mark.real
def test_peers_are_group_ranks(real_ranks):
    """On a subgroup, the peer is the rank within it: group rank 1 of {1, 3} is rank 3."""
    results = real_ranks(4).run(_subgroup_pair)
    assert [(rank, log) for rank, _, log in results] == [
        (0, [("send", 1)]), (0, [("send", 1)]), (1, [("recv", 0)]), (1, [("recv", 0)])]
    assert torch.equal(results[2][1], _expected(0, torch.float32))
    assert torch.equal(results[3][1], _expected(1, torch.float32))


@pytest.mark.parametrize("batched", [False, True], ids=["recv", "batch"])
def test_recv_never_sent_times_out(batched):
    what = "batch_isend_irecv at the lost batch" if batched else "recv at the lost send"
    t0 = time.monotonic()
    with pytest.raises(CommunicationError, match=f"simulated rank 1: {what} timed out after "
                                                 f"1s: rank 0 never sent \\(it had returned\\)"):
        SimulatedRanks(2, timeout=1.0).run(_recv_unsent, batched)
    assert 0.5 <= time.monotonic() - t0 < 20  # the timeout, no hang (a loaded machine)


@pytest.mark.real
@pytest.mark.parametrize("batched", [False, True], ids=["recv", "batch"])
def test_real_recv_never_sent_times_out(real_ranks, batched):
    what = "batch_isend_irecv at the lost batch" if batched else "recv at the lost send"
    rank0, (kind, message, elapsed) = real_ranks(2).run(_caught_recv_unsent, batched, 1)
    assert rank0 is None
    assert kind == "CommunicationError"
    assert f"rank 1: {what} timed out after 1s" in message, message
    assert 0.5 <= elapsed < 20, elapsed


def test_failed_peer_wakes_the_receiver():
    """Rank 0 fails instead of sending: rank 1's recv breaks off at once, not at the timeout."""
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="rank 0 fails before sending"):
        SimulatedRanks(2, timeout=60).run(_recv_while_peer_fails)
    assert time.monotonic() - t0 < 20


def test_bad_peer_is_named(ranks):
    n = ranks.world_size
    for r, results in enumerate(ranks.run(_bad_peers)):
        assert len(results) == 9
        for peer, is_shardplan_error, message in results:
            assert is_shardplan_error, message
            assert f"peer {peer} on rank {r} of a group of {n} ranks" in message
            assert f"0 .. {n - 1}" in message


def test_recv_into_buffer_of_other_shape():
    with pytest.raises(CommunicationError, match=r"ranks disagree at recv at the short buffer: "
                                                 r"rank 0 sent shape \(4,\) torch.float32, rank 1 "
                                                 r"receives into shape \(3,\)"):
        SimulatedRanks(2, timeout=10).run(_recv_wrong_shape)


def test_bad_op_and_buffer():
    with pytest.raises(ConfigurationError, match="P2POp kind 'isend'"):
        P2POp("isend", torch.ones(3), 1)
    g = ThreadGroup(0, Rendezvous(2))
    with pytest.raises(ConfigurationError, match=r"non-contiguous tensor of shape \(3, 2\)"):
        g.recv(torch.empty(2, 3).t(), 1)
