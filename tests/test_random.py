"""The two dropout RNG streams against independently seeded torch generators.

The default generators are per process, so simulated ranks (threads) would
share them: these ``check_*`` functions run one rank after another here, and
unchanged on real ranks (one process each).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardplan.errors import ConfigurationError
from shardplan.ranks import RankContext
from shardplan.runtime import (RNGTracker, get_rng_tracker, manual_seed, model_parallel_seed,
                               set_rng_tracker)
from shardplan.runtime.comm import Rendezvous, ThreadGroup

SETTINGS = settings(max_examples=15, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
TP = st.sampled_from([1, 2, 4, 8])
SEED = st.integers(0, 2**40)
CUDA = [False] + ([True] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def isolated_rng():
    with torch.random.fork_rng():
        yield
    set_rng_tracker(None)


def run_sequentially(fn, world_size, *args):
    """Run ``fn(ctx, *args)`` for each rank in turn (no collectives needed)."""
    rv = Rendezvous(world_size)
    return [fn(RankContext(r, world_size, ThreadGroup(r, rv)), *args)
            for r in range(world_size)]


def draws(seed, n, device="cpu"):
    """``n`` successive ``torch.rand(4)`` of a fresh generator seeded with ``seed``."""
    gen = torch.Generator(device).manual_seed(seed)
    return [torch.rand(4, generator=gen, device=device) for _ in range(n)]


def check_streams(ctx, seed, cuda):
    """Replicated draws around two forks, and the forks' model-parallel draws."""
    device = "cuda" if cuda else "cpu"
    tracker = manual_seed(seed, ctx.rank, cuda=cuda)
    out = {"replicated": [], "parallel": []}
    for _ in range(2):
        out["replicated"].append(torch.rand(4, device=device))
        with tracker.fork():
            out["parallel"].append(torch.rand(4, device=device))
    out["replicated"].append(torch.rand(4, device=device))
    return out


@SETTINGS
@given(tp=TP, seed=SEED, cuda=st.sampled_from(CUDA))
def test_replicated_stream_is_shared_and_model_parallel_stream_is_per_rank(tp, seed, cuda):
    device = "cuda" if cuda else "cpu"
    results = run_sequentially(check_streams, tp, seed, cuda)
    for rank, out in enumerate(results):
        # forks neither disturb nor replay the replicated stream ...
        for got, want in zip(out["replicated"], draws(seed, 3, device)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        # ... and each fork continues the rank's own stream where the last left off
        for got, want in zip(out["parallel"], draws(model_parallel_seed(seed, rank), 2, device)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    parallel = [out["parallel"][0] for out in results]
    assert all(not torch.equal(parallel[0], p) for p in parallel[1:])


def test_model_parallel_seed_is_megatrons_offset():
    assert model_parallel_seed(1234, 0) == 1234 + 2718
    assert model_parallel_seed(1234, 5) == 1234 + 2718 + 5


def check_dropout_replay(ctx, seed, cuda):
    """Dropout masks drawn twice from one saved ``get_states()``, outside and in a fork."""
    device = "cuda" if cuda else "cpu"
    tracker = manual_seed(seed, ctx.rank, cuda=cuda)
    torch.rand(3, device=device)  # advance both streams away from their seeds
    with tracker.fork():
        torch.rand(3, device=device)
    ones = torch.ones(64, device=device)

    def masks():
        outside = F.dropout(ones, 0.5)
        with tracker.fork():
            inside = F.dropout(ones, 0.5)
        return outside, inside

    states = tracker.get_states()
    first = masks()
    after = tracker.get_states()
    tracker.set_states(states)
    second = masks()
    return first, second, states, after


@pytest.mark.parametrize("cuda", CUDA)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_get_set_states_reproduce_dropout_masks(tp, cuda):
    results = run_sequentially(check_dropout_replay, tp, 7, cuda)
    for (out1, in1), (out2, in2), states, after in results:
        assert torch.equal(out1, out2) and torch.equal(in1, in2)
        for stream in ("replicated", "model-parallel"):
            assert set(states[stream]) == ({"cpu", "cuda"} if cuda else {"cpu"})
            assert not torch.equal(states[stream]["cpu" if not cuda else "cuda"],
                                   after[stream]["cpu" if not cuda else "cuda"])
    outside = [r[0][0] for r in results]
    inside = [r[0][1] for r in results]
    assert all(torch.equal(outside[0], m) for m in outside)
    assert all(not torch.equal(inside[0], m) for m in inside[1:])


def test_states_inside_a_fork_restore_both_streams():
    tracker = manual_seed(3, 1, cuda=False)
    with tracker.fork():
        states = tracker.get_states()
        a = torch.rand(4)
        tracker.set_states(states)
        assert torch.equal(torch.rand(4), a)
    assert torch.equal(torch.rand(4), draws(3, 1)[0])


def test_nested_fork_continues_the_model_parallel_stream():
    tracker = manual_seed(11, 2, cuda=False)
    with tracker.fork():
        a = torch.rand(4)
        with tracker.fork():
            b = torch.rand(4)
        c = torch.rand(4)
    want = draws(model_parallel_seed(11, 2), 3)
    for got, w in zip((a, b, c), want):
        assert torch.equal(got, w)
    assert torch.equal(torch.rand(4), draws(11, 1)[0])


def test_fork_restores_on_exception():
    tracker = manual_seed(0, 1, cuda=False)
    with pytest.raises(RuntimeError), tracker.fork():
        raise RuntimeError("boom")
    assert torch.equal(torch.rand(4), draws(0, 1)[0])


def test_tracker_singleton():
    with pytest.raises(ConfigurationError, match="manual_seed"):
        get_rng_tracker()
    tracker = manual_seed(1, 0, cuda=False)
    assert get_rng_tracker() is tracker
    other = RNGTracker(1, 1, cuda=False)
    set_rng_tracker(other)
    assert get_rng_tracker() is other


def test_constructing_a_tracker_leaves_the_default_generator_alone():
    torch.manual_seed(42)
    RNGTracker(1, 3, cuda=False)
    assert torch.equal(torch.rand(4), draws(42, 1)[0])
