"""Models of other libraries than transformers parallelize with no per-model code:
x-transformers (decoders with ALiBi, rotary, GLU; a vision Transformer) and
curated-transformers (Llama, BERT), from benchmarks/library_models.py; the coverage
survey (``python -m benchmarks.coverage --libraries``) surveys more of them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

pytest.importorskip("x_transformers", reason="the [libs] extra is not installed")
pytest.importorskip("curated_transformers", reason="the [libs] extra is not installed")

import shardplan  # noqa: E402
from benchmarks.library_models import MODELS, token_ids  # noqa: E402
from shardplan.planner.capture import capture  # noqa: E402
from shardplan.ranks import SimulatedRanks  # noqa: E402

from checks import assert_equivalent  # noqa: E402
from library_cases import assert_sharded, real_step, reference, step  # noqa: E402

pytestmark = pytest.mark.timeout(240)

# model -> tp of the simulated ranks
EQUAL = {"x-transformers:decoder": 4, "x-transformers:decoder-alibi": 4,
         "x-transformers:decoder-rotary": 4, "x-transformers:decoder-glu": 4,
         "x-transformers:decoder-gqa": 4, "x-transformers:vit": 4,
         "curated-transformers:llama": 4, "curated-transformers:bert": 4}
# the K/V projections a model's head layout keeps whole: x-transformers' grouped-query
# decoder repeats its 2 K/V heads outside them (query head i reads K/V head i mod 2:
# every rank needs both); curated Llama's 2 K/V heads at tp 4 meet its rotary and
# attention ops as parts held by pairs of ranks, which those ops cannot run on
WHOLE_KV = {"x-transformers:decoder-gqa": (".to_k.weight", ".to_v.weight"),
            "curated-transformers:llama": (".key.weight", ".value.weight")}


@pytest.mark.parametrize("name", list(EQUAL))
def test_verify_tp2_and_every_simulated_rank_equal_and_sharded(name):
    """``verify`` at tp 2; then simulated ranks (one capture for all) against the
    unsharded model: outputs, loss and every copy of every gradient."""
    case = MODELS[name]
    model, inputs = case.build(), case.inputs()
    report = shardplan.verify(model, 2, example_inputs=inputs)
    assert report.ok, str(report)
    results = SimulatedRanks(EQUAL[name]).run(step, model, inputs, capture(model, inputs))
    assert_equivalent(results, reference(model, inputs))
    assert_sharded(model, results, WHOLE_KV.get(name, ()))


def _buffer_kinds(model) -> dict[str, type]:
    """Every buffer slot of every module, ``None`` ones too (ALiBi's bias before first use)."""
    return {f"{prefix}.{k}": type(b) for prefix, m in model.named_modules()
            for k, b in m._buffers.items()}


def _parallelize_and_call_shorter(ctx, model, ids, short):
    """The user's model itself parallelized (every rank from the one object), then called
    with the example and with a batch of 1 of a shorter sequence."""
    sharded = shardplan.parallelize(model, group=ctx.group, example_inputs=(ids,))
    with torch.no_grad():
        return sharded(ids), sharded(short), sharded.layouts


def test_alibi_leaves_the_users_model_unchanged_and_a_shorter_call_is_real():
    """x-transformers registers its ALiBi bias as a buffer inside forward: capturing it
    must not leave a FakeTensor (or any new buffer) in the user's model, and a later
    call with batch 1 and a shorter sequence returns real tensors equal to the model's."""
    model = MODELS["x-transformers:decoder-alibi"].build()
    ids, short = token_ids(), token_ids(1, 5)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = _buffer_kinds(model)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        want, want_short = ref(ids), ref(short)
    results = SimulatedRanks(2).run(_parallelize_and_call_shorter, model, ids, short)
    after = model.state_dict()
    assert after.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(after[k], v) and type(after[k]) is type(v), k
    assert _buffer_kinds(model) == kinds
    assert not any(isinstance(t, FakeTensor) for m in model.modules() for t in vars(m).values())
    for rank, (out, out_short, layouts) in enumerate(results):
        assert type(out) is torch.Tensor and type(out_short) is torch.Tensor, rank
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4, msg=f"rank {rank}")
        torch.testing.assert_close(out_short, want_short, atol=2e-5, rtol=1e-4,
                                   msg=f"batch 1 of length 5, rank {rank}")
        assert isinstance(layouts["attn_layers.layers.0.1.to_q.weight"], shardplan.Shard)
    with torch.no_grad():  # and the user's model still runs as before, on real tensors
        torch.testing.assert_close(model(short), want_short, atol=0, rtol=0)


@pytest.mark.real
@pytest.mark.parametrize("name", ["x-transformers:decoder-alibi", "curated-transformers:llama"])
def test_tp2_real_gloo(real_ranks, name):
    """2 real gloo ranks, each building the model itself, against the unsharded model."""
    case = MODELS[name]
    model, inputs = case.build(), case.inputs()
    results = real_ranks(2).run(real_step, name)
    assert_equivalent(results, reference(model, inputs))
    assert_sharded(model, results)
