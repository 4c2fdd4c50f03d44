"""The simulated ranks of one launch share one capture of the same model.

Each rank parallelizes its own deepcopy of the model; the first rank to capture
exports, the others get a copy of that capture bound to their own model's
tensors (``planner.shared_capture``). Checked: the shared capture plans and
computes exactly what per-rank captures do (simulated and real ranks), a model
differing in one parameter's shape, one forward line, one plain attribute, its
mode or its call is captured anew, and every rank's graph reads its own tensors.
"""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch
import torch.nn as nn

import shardplan
from shardplan.planner import shared_capture
from shardplan.planner.capture import capture
from shardplan.ranks import RealRanks, SimulatedRanks
from shardplan.runtime.comm import Rendezvous, ThreadGroup

from planner_cases import batch, make_model, reference


@pytest.fixture
def exports(monkeypatch):
    """The number of ``torch.export.export`` calls so far (a list of one int); the
    session's share (conftest) set aside, so each test counts its own exports."""
    count = [0]
    real = torch.export.export

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    with shared_capture.sharing(None):
        yield count


def parallel_run(ctx, model, idx, tgt, share: bool = True):
    """Parallelize this rank's copy of ``model`` (sharing captures, or each its own),
    run forward and backward; the plan's dump and report, logits, loss, gradients."""
    scope = contextlib.nullcontext() if share else shared_capture.sharing(None)
    with scope:
        sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                        example_inputs=(idx, tgt))
    logits, loss = sharded(idx, tgt)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in sharded.named_parameters(remove_duplicate=False)}
    return (sharded.plan.model_dump(), sharded.plan.report(), logits.detach(), loss.detach(),
            grads, sharded.layouts)


def _same_runs(a, b) -> None:
    for x, y in zip(a, b):
        assert x[0] == y[0] and x[1] == y[1]  # plan and report
        torch.testing.assert_close(x[2], y[2], rtol=0, atol=0)
        torch.testing.assert_close(x[3], y[3], rtol=0, atol=0)
        assert x[4].keys() == y[4].keys()
        for name in x[4]:
            torch.testing.assert_close(x[4][name], y[4][name], rtol=0, atol=0)


def test_shared_capture_plans_and_computes_as_own_captures(exports):
    model = make_model("gpt")
    idx, tgt = batch(64, 2, 8)
    shared = SimulatedRanks(2).run(parallel_run, model, idx, tgt, True)
    assert exports[0] == 1  # one rank exported, the other copied
    own = SimulatedRanks(2).run(parallel_run, model, idx, tgt, False)
    assert exports[0] == 3
    _same_runs(shared, own)
    logits, loss, _ = reference(model, idx, tgt)
    for r in shared:
        assert any(isinstance(lay, shardplan.Shard) for lay in r[5].values())  # it was sharded
        torch.testing.assert_close(r[2], logits, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(r[3], loss, atol=1e-5, rtol=1e-4)


@pytest.mark.real
@pytest.mark.timeout(240)
def test_shared_capture_plans_and_computes_as_real_ranks(real_ranks):
    """Real gloo ranks capture each on its own: the simulated ranks' shared capture
    gives the same plan, report, outputs and gradients."""
    model = make_model("gpt")
    idx, tgt = batch(64, 2, 8)
    real = real_ranks(2).run(parallel_run, model, idx, tgt, True)
    shared = SimulatedRanks(2).run(parallel_run, model, idx, tgt, True)
    for x, y in zip(real, shared):
        assert x[0] == y[0] and x[1] == y[1]
        for got, want in [(x[2], y[2]), (x[3], y[3]), *((x[4][n], y[4][n]) for n in y[4])]:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


class Scaled(nn.Module):
    """x -> fc2(act(fc1(x) * scale)) + offset; ``scale`` has ``width`` elements
    (broadcast), ``offset`` is a plain tensor attribute (export bakes it in)."""

    def __init__(self, width: int = 16, act: str = "relu"):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.scale = nn.Parameter(torch.ones(width))
        self.register_buffer("shift", torch.zeros(16))
        self.offset = torch.zeros(8)
        self.act = act

    def forward(self, x):
        h = self.fc1(x) * self.scale + self.shift
        h = torch.relu(h) if self.act == "relu" else torch.tanh(h)
        return self.fc2(h) + self.offset


class OtherLine(Scaled):
    def forward(self, x):
        h = self.fc1(x) * self.scale + self.shift
        h = torch.relu(h) if self.act == "relu" else torch.tanh(h)
        return self.fc2(h) - self.offset


def _capture_both(a: nn.Module, b: nn.Module, xa, xb=None) -> None:
    """Capture ``a(xa)`` then ``b(xb)`` (default ``xa``) within one share."""
    with shared_capture.sharing(shared_capture.CaptureShare()):
        capture(a, (xa,))
        capture(b, (xa if xb is None else xb,))


def _variants():
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    base = Scaled()
    offset = copy.deepcopy(base)
    offset.offset = torch.ones(8)
    return x, base, {
        "one parameter's shape": Scaled(width=1),
        "one forward line": OtherLine(),
        "a plain attribute": Scaled(act="tanh"),
        "a plain tensor's values": offset,
        "the mode": copy.deepcopy(base).eval(),
        "requires_grad": copy.deepcopy(base).requires_grad_(False),
        "tied weights": _tied(copy.deepcopy(base)),
    }


def _tied(m: Scaled) -> Scaled:
    m.scale = m.fc1.bias  # same names and shapes, one tensor under two names
    return m


def test_a_copy_of_the_same_model_is_shared(exports):
    x, base, _ = _variants()
    _capture_both(base, copy.deepcopy(base), x)
    assert exports[0] == 1


@pytest.mark.parametrize("what", list(_variants()[2]))
def test_a_model_differing_in_one_thing_is_captured_anew(exports, what):
    x, base, variants = _variants()
    _capture_both(base, variants[what], x)
    assert exports[0] == 2, what


def test_a_call_differing_in_shape_or_kind_is_captured_anew(exports):
    x, base, _ = _variants()
    _capture_both(base, copy.deepcopy(base), x, torch.randn(4, 3, 8))
    assert exports[0] == 2
    _capture_both(base, copy.deepcopy(base), x, x.double())
    assert exports[0] == 4


def test_no_share_outside_a_launch(exports):
    x, base, _ = _variants()
    capture(base, (x,))
    capture(copy.deepcopy(base), (x,))
    assert exports[0] == 2


def test_a_share_the_caller_holds_serves_every_simulated_run(exports):
    """Simulated runs in a ``sharing`` scope use that share: the second run exports
    nothing, and its ranks' captures read their own models' tensors."""
    x, base, _ = _variants()

    def rank_capture(ctx, model):
        captured = capture(model, (x,))
        return {name for name, t in captured.gm.named_parameters()
                if not any(t is p for p in model.parameters())}

    with shared_capture.sharing(shared_capture.CaptureShare()):
        first = SimulatedRanks(2).run(rank_capture, copy.deepcopy(base))
        assert exports[0] == 1
        second = SimulatedRanks(2).run(rank_capture, copy.deepcopy(base))
    assert exports[0] == 1
    assert first == second == [set(), set()]  # every graph reads its own model's parameters


def test_a_share_keeps_its_most_recent_captures_only(exports):
    x, base, variants = _variants()
    share = shared_capture.CaptureShare(limit=1)
    with shared_capture.sharing(share):
        capture(base, (x,))
        capture(variants["one parameter's shape"], (x,))  # evicts base's capture
        capture(copy.deepcopy(base), (x,))
    assert exports[0] == 3


_WORKER_EXPORTS = [0]  # torch.export.export calls in this process (a RealRanks worker)


def _count_exports(ctx, model, x):
    """Capture ``model`` on this worker; the worker's export count so far."""
    if not getattr(torch.export.export, "counted", False):
        real = torch.export.export

        def counted(*args, **kwargs):
            _WORKER_EXPORTS[0] += 1
            return real(*args, **kwargs)

        counted.counted = True
        torch.export.export = counted
    capture(model, (x,))
    capture(copy.deepcopy(model), (x,))  # the same run's share serves the copy
    return _WORKER_EXPORTS[0]


@pytest.mark.real
@pytest.mark.timeout(180)
@pytest.mark.parametrize("keep", [False, True], ids=["per-run", "kept"])
def test_real_workers_share_a_run_and_keep_captures_when_asked(keep):
    """A RealRanks worker exports a model once a run (its copy shares it); with
    ``keep_captures`` a later run exports nothing, without it the model anew."""
    x, base, _ = _variants()
    with RealRanks(2, keep_captures=keep) as ranks:
        assert ranks.run(_count_exports, base, x) == [1, 1]
        assert ranks.run(_count_exports, base, x) == ([1, 1] if keep else [2, 2])


def _graph_tensors(gm: nn.Module, model: nn.Module) -> dict:
    """(kind, FQN) -> is it ``model``'s own tensor at that FQN, for every tensor ``gm`` holds:
    its parameters, buffers and unregistered tensors (export's constants)."""
    out = {}
    for path, m in gm.named_modules():
        held = [*(("parameter", k, t) for k, t in m._parameters.items()),
                *(("buffer", k, t) for k, t in m._buffers.items()),
                *(("attribute", k, t) for k, t in vars(m).items() if isinstance(t, torch.Tensor))]
        for kind, name, t in held:
            fqn = f"{path}.{name}" if path else name
            owner, _, leaf = fqn.rpartition(".")
            out[kind, fqn] = getattr(model.get_submodule(owner), leaf, None) is t
    return out


def _own_weights_run(ctx, model, x, first_done: threading.Event):
    """Rank r scales its copy's weights by r + 1 (and shifts its buffer by r), then
    parallelizes it alone (tp=1) after rank 0 did: rank 1's capture is rank 0's copied.
    Returns its output, its own model's, and which of its graph's tensors are its own."""
    mine = copy.deepcopy(model)
    with torch.no_grad():
        for p in mine.parameters():
            p.mul_(ctx.rank + 1)
        mine.shift.add_(ctx.rank)
    if ctx.rank:
        first_done.wait(60)
    alone = ThreadGroup(0, Rendezvous(1))
    captured = capture(mine, (x,))
    sharded = shardplan.parallelize(mine, group=alone, example_inputs=(x,), check_model=False)
    first_done.set()
    return sharded(x).detach(), mine(x).detach(), _graph_tensors(captured.gm, mine)


def test_each_rank_reads_its_own_weights(exports):
    x, base, _ = _variants()
    results = SimulatedRanks(2).run(_own_weights_run, base, x, threading.Event())
    assert exports[0] == 1  # rank 1 got rank 0's capture (both its captures)
    (out0, want0, own0), (out1, want1, own1) = results
    assert own1 == own0  # the same tensors registered the same way as rank 0's own capture
    assert ("attribute", "offset") in own0 and ("buffer", "shift") in own0
    assert all(own0.values()) and all(own1.values())
    assert not torch.allclose(want0, want1)  # the ranks' weights differ
    torch.testing.assert_close(out0, want0, rtol=0, atol=0)
    torch.testing.assert_close(out1, want1, rtol=0, atol=0)
