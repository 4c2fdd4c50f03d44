"""Hugging Face GPT-2, Llama and BERT parallelize with no per-model code."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from shardplan.planner.capture import capture  # noqa: E402
from shardplan.ranks import SimulatedRanks  # noqa: E402

from shardplan.layouts import Shard  # noqa: E402

from checks import assert_equivalent  # noqa: E402
from hf_cases import build, full_round_trip, inputs, real_step, reference, step  # noqa: E402

KINDS = ["gpt2", "llama", "bert"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_tp4_simulated(kind, attn):
    model = build(kind, attn, heads=8, kv_heads=4)
    kw = inputs()
    results = SimulatedRanks(4).run(step, model, kw, True, capture(model, (), kw))
    assert_equivalent(results, reference(model, kw))
    plan = results[0][5]
    assert not plan.warnings


@pytest.mark.real
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", KINDS)
def test_tp2_real_gloo(real_ranks, kind):
    kw = inputs()
    results = real_ranks(2).run(real_step, kind, kw)
    assert_equivalent(results, reference(build(kind), kw))


@pytest.mark.parametrize("kind", KINDS)
def test_ledger_equals_megatron_count(kind):
    """Per layer 2 all-reduces forward and 2 backward of b*s*h; the embedding's g, the LM
    head's f and the vocab-parallel loss's 3 all-reduces of b*s; nothing else."""
    layers, b, t, h = 2, 2, 6, 64
    kw = inputs(b, t)
    results = SimulatedRanks(2).run(step, build(kind, layers=layers), kw, False)
    for records in (r[4] for r in results):
        fwd = sorted((r.kind, r.elements) for r in records if r.direction == "forward")
        bwd = sorted((r.kind, r.elements) for r in records if r.direction == "backward")
        assert fwd == sorted([("all_reduce", b * t * h)] * (2 * layers + 1)
                             + [("all_reduce", b * t)] * 3)
        assert bwd == [("all_reduce", b * t * h)] * (2 * layers + 1)


def test_gpt2_conv1d_and_tied_head_layouts():
    results = SimulatedRanks(2).run(step, build("gpt2"), inputs())
    lay = results[0][3]
    assert lay["transformer.h.0.attn.c_attn.weight"] == Shard(1, (64, 64, 64))  # Conv1D: (in, out)
    assert lay["transformer.h.0.attn.c_proj.weight"] == Shard(0)
    assert lay["transformer.wte.weight"] == lay["lm_head.weight"] == Shard(0, None, 102)
    assert isinstance(lay["transformer.wpe.weight"], type(lay["transformer.h.0.ln_1.weight"]))


@pytest.mark.parametrize("kind", KINDS)
def test_hf_checkpoint_round_trip(tmp_path, kind):
    """save_pretrained's .safetensors -> shards (each rank reads its slices) -> the same
    logits -> a gathered state dict, bit-identical, that the original class loads."""
    model = build(kind)
    model.save_pretrained(tmp_path)
    kw = inputs()
    results = SimulatedRanks(2).run(full_round_trip, model, tmp_path / "model.safetensors", kw)
    want = model(**kw).logits
    torch.testing.assert_close(results[0][0], want, atol=2e-5, rtol=1e-4)
    gathered = results[0][1]
    original = model.state_dict()
    assert gathered.keys() == original.keys()
    for k, v in original.items():
        assert torch.equal(gathered[k], v), k
    build(kind).load_state_dict(gathered, strict=True)
