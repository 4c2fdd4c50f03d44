"""Capture never corrupts the user's model and never runs a graph outside its guards.

- a forward that mutates ``self`` (registers a buffer on first use, caches a tensor,
  counts calls, appends to a list) leaves the model bit-identical after ``plan``,
  ``verify`` and ``parallelize``, and every later call returns real tensors equal to
  the unsharded model's (a new batch or length is a new capture, never a leaked
  fake tensor);
- a model already holding a fake tensor (left by a plain ``torch.export``) is refused;
- a forward that specialises the sequence length (a Python loop over it) or a stride
  is captured anew for calls outside that, equal to the unsharded model;
- ``InputShapes`` says why a call falls outside a capture;
- torch's capture warnings stay out of the console.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardplan
from shardplan.errors import CaptureError
from shardplan.layouts import Shard
from shardplan.planner.capture import capture
from shardplan.planner.input_shapes import InputShapes
from shardplan.ranks import SimulatedRanks

VOCAB, DIM, HEADS = 64, 32, 4


class Attention(nn.Module):
    """Causal attention with an ALiBi bias made on first use and kept with
    ``register_buffer`` inside forward (as x-transformers does), a call counter and a
    list of the lengths it saw."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        slopes = torch.tensor([2.0 ** (-8 * (h + 1) / HEADS) for h in range(HEADS)])
        self.register_buffer("slopes", slopes.view(HEADS, 1, 1), persistent=False)
        self.register_buffer("bias", None, persistent=False)
        self.calls = 0
        self.seen: list[int] = []

    def alibi(self, t: int) -> torch.Tensor:
        if self.bias is not None and self.bias.shape[-1] >= t:
            return self.bias[..., :t, :t]
        pos = torch.arange(t, device=self.slopes.device)
        bias = -(pos[None, :] - pos[:, None]).abs().float() * self.slopes
        self.register_buffer("bias", bias, persistent=False)
        return bias

    def forward(self, x):
        self.calls += 1
        b, t, _ = x.shape
        self.seen.append(t)
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        bias = self.alibi(t).masked_fill(~mask, float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(y.transpose(1, 2).reshape(b, t, DIM))


class SelfMutatingLM(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(DIM), "attn": Attention(),
                           "up": nn.Linear(DIM, 4 * DIM), "down": nn.Linear(4 * DIM, DIM)})
            for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)
        self.last_logits = None  # a tensor cached on self in forward

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = x + blk["attn"](blk["norm"](x))
            x = x + blk["down"](F.gelu(blk["up"](x)))
        logits = self.head(x)
        self.last_logits = logits
        return logits


def _ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _state(model: nn.Module) -> dict:
    """Everything a capture could change: tensors with their types and bits, every
    module's plain attributes (names, types, values)."""
    tensors = {f"{p}.{k}" if p else k: (type(t), t.dtype, t.detach().clone())
               for p, m in model.named_modules() for k, t in vars(m).items()
               if isinstance(t, torch.Tensor)}
    for kind in (model.named_parameters, model.named_buffers):
        tensors.update({n: (type(t), t.dtype, t.detach().clone())
                        for n, t in kind(remove_duplicate=False)})
    plain = {f"{p}:{k}": (type(v), copy.copy(v)) for p, m in model.named_modules()
             for k, v in vars(m).items()
             if isinstance(v, (int, float, str, bool, list, type(None)))}
    return {"tensors": tensors, "plain": plain,
            "buffers": [n for n, _ in model.named_buffers()]}


def _assert_same_state(before: dict, after: dict) -> None:
    assert after["buffers"] == before["buffers"]
    assert after["plain"] == before["plain"]
    assert after["tensors"].keys() == before["tensors"].keys()
    for name, (kind, dtype, t) in before["tensors"].items():
        kind2, dtype2, t2 = after["tensors"][name]
        assert (kind2, dtype2) == (kind, dtype), name
        assert torch.equal(t2, t), name


CALLS = [(2, 10), (1, 10), (2, 7), (1, 1), (3, 12)]  # the example first


def _parallel_calls(ctx, model, calls):
    """Parallelize the (shared) user model, call it every way; report the model's state
    after parallelize and the outputs' types."""
    sharded = shardplan.parallelize(model, group=ctx.group, example_inputs=(_ids(*calls[0]),))
    state = _state(model)
    outs = [sharded(_ids(b, t, seed=i)) for i, (b, t) in enumerate(calls)]
    return state, outs, dict(sharded.layouts), sum(p.numel() for p in sharded.parameters())


def _check_parallel_run(results, model, before, calls) -> None:
    ref = copy.deepcopy(model)
    for state, outs, layouts, local in results:
        _assert_same_state(before, state)
        for i, ((b, t), got) in enumerate(zip(calls, outs)):
            assert type(got) is torch.Tensor, type(got)
            torch.testing.assert_close(got, ref(_ids(b, t, seed=i)), atol=2e-5, rtol=1e-4)
        # it was sharded: the attention and the MLP split, the rank holds part of the model
        assert isinstance(layouts["blocks.0.attn.qkv.weight"], Shard)
        assert isinstance(layouts["blocks.1.down.weight"], Shard)
        assert local < sum(p.numel() for p in model.parameters()) * 0.75


def test_a_self_mutating_model_is_untouched_by_plan_verify_and_parallelize():
    torch.manual_seed(0)
    model = SelfMutatingLM()
    before = _state(model)
    shardplan.plan(model, tp=2, example_inputs=(_ids(2, 10),))
    _assert_same_state(before, _state(model))
    report = shardplan.verify(model, tp=2, example_inputs=(_ids(2, 10),))
    assert report.ok, str(report)
    _assert_same_state(before, _state(model))
    results = SimulatedRanks(2).run(_parallel_calls, model, CALLS)  # one model, both ranks
    _assert_same_state(before, _state(model))
    _check_parallel_run(results, model, before, CALLS)


@pytest.mark.real
def test_a_self_mutating_model_is_untouched_on_real_ranks(real_ranks):
    torch.manual_seed(0)
    model = SelfMutatingLM()
    before = _state(model)
    results = real_ranks(2).run(_parallel_calls, model, CALLS)
    _check_parallel_run(results, model, before, CALLS)


def test_a_model_holding_a_fake_tensor_is_refused_naming_it():
    torch.manual_seed(0)
    model = SelfMutatingLM()
    torch.export.export(model, (_ids(2, 10),), strict=False)  # leaves fake tensors on model
    with pytest.raises(CaptureError, match=r"blocks\.0\.attn\.bias of SelfMutatingLM holds a FakeTensor"):
        shardplan.plan(model, tp=2, example_inputs=(_ids(2, 10),))


class SlidingWindowLM(nn.Module):
    """A sliding-window mask built by a Python loop over the sequence length (litgpt's
    Gemma-2 does so): export turns the example's length into a literal."""

    window = 3

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def mask(self, t: int, device) -> torch.Tensor:
        rows = []
        for i in range(t):  # Python control flow on the length: specialises it
            rows.append([(i - self.window < j <= i) for j in range(t)])
        return torch.tensor(rows, device=device)

    def forward(self, ids):
        x = self.emb(ids)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(t, x.device))
        x = x + self.out(y.transpose(1, 2).reshape(b, t, DIM))
        x = x + self.down(F.gelu(self.up(x)))
        return self.head(x)


def _length_calls(ctx, model, example, calls):
    sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                    example_inputs=(example,))
    return [sharded(x) for x in calls], dict(sharded.layouts), len(sharded.graphs)


def _length_calls_recording(ctx, model, example, calls):
    """``_length_calls`` and the warnings it raised (one rank a process: the recording
    of warnings is process-wide)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = _length_calls(ctx, model, example, calls)
    return result, [str(w.message) for w in seen]


def _check_lengths(results, model, calls, captures) -> None:
    for outs, layouts, graphs in results:
        for x, got in zip(calls, outs):
            torch.testing.assert_close(got, model(x), atol=2e-5, rtol=1e-4)
        assert isinstance(layouts["qkv.weight"], Shard) and isinstance(layouts["down.weight"], Shard)
        assert graphs == captures


def test_a_specialised_sequence_length_is_captured_anew():
    torch.manual_seed(0)
    model = SlidingWindowLM()
    example = _ids(2, 10)
    assert capture(model, (example,), {}).shapes.leaves[0][1] == 10  # export made it literal
    calls = [_ids(2, 10, 1), _ids(2, 7, 2), _ids(2, 10, 3), _ids(2, 13, 4)]
    with pytest.warns(UserWarning, match=r"captured anew for this call \(input 0 dim 1 is 7; "
                                         r"the graph was specialised to 10\)"):
        results = SimulatedRanks(2).run(_length_calls, model, example, calls)
    _check_lengths(results, model, calls, captures=3)  # 10 (twice), 7, 13


@pytest.mark.real
def test_a_specialised_sequence_length_is_captured_anew_on_real_ranks(real_ranks):
    torch.manual_seed(0)
    model = SlidingWindowLM()
    calls = [_ids(2, 7, 2), _ids(2, 10, 3)]
    results = real_ranks(2).run(_length_calls_recording, model, _ids(2, 10), calls)
    _check_lengths([r for r, _ in results], model, calls, captures=2)
    for _, messages in results:
        assert any("captured anew" in m and "specialised to 10" in m for m in messages), messages


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _stride_calls(ctx, model, example, x):
    sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                    example_inputs=(example,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [sharded(x), sharded(example)], dict(sharded.layouts)


def test_a_guard_on_the_examples_strides_captures_a_contiguous_call_anew():
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(3, 5, 8)
    example = x[:, :4]  # not contiguous: export guards its strides
    for outs, layouts in SimulatedRanks(2).run(_stride_calls, model, example, x):
        torch.testing.assert_close(outs[0], model(x))
        torch.testing.assert_close(outs[1], model(example))
        assert isinstance(layouts["up.weight"], Shard)


def test_input_shapes_say_why_a_call_falls_outside():
    shapes = InputShapes(((("s0", 2, None), 10), None, (("s0", 2, None), ("2*s0", 4, None))))
    ids = torch.zeros(3, 10)
    assert shapes.mismatch((ids, None, torch.zeros(3, 6)), {}) is None
    assert "specialised to 10" in shapes.mismatch((torch.zeros(3, 7), None, torch.zeros(3, 6)), {})
    assert "outside the graph's [2, inf]" in shapes.mismatch(
        (torch.zeros(1, 10), None, torch.zeros(1, 2)), {})
    assert "equal to another dim of size 3" in shapes.mismatch(
        (ids, None, torch.zeros(4, 8)), {})
    assert "2*s0 = 6" in shapes.mismatch((ids, None, torch.zeros(3, 8)), {})
    assert "3 dims" in shapes.mismatch((torch.zeros(3, 10, 1), None, torch.zeros(3, 6)), {})
    assert "input leaves" in shapes.mismatch((ids,), {})


def test_capture_keeps_torchs_warnings_at_debug_level(caplog, capfd):
    torch.manual_seed(0)
    caplog.set_level(logging.DEBUG, logger="shardplan.capture")
    capture(Mlp(), (torch.randn(1, 5, 8),), {})  # batch 1: export warns it specialised it
    assert "specialized" not in capfd.readouterr().err  # torch's own handler writes there
    assert not [r for r in caplog.records if r.name.startswith("torch")]
    debug = [r.getMessage() for r in caplog.records if r.name == "shardplan.capture"]
    assert any("0/1 specialized" in m for m in debug), debug
