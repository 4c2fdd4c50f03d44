"""Activation recomputation per block: the same gradients, fewer stored activations."""

from __future__ import annotations

import copy

import pytest
import torch

import shardplan
from shardplan import ConfigurationError
from shardplan.models import build
from shardplan.planner.recompute import Recomputed, block_names

from recompute_cases import batch, dropout_gpt, step


@pytest.fixture(scope="module")
def stored(real_ranks):
    """Each rank's step without recomputation (tp=2 real ranks)."""
    return real_ranks(2).run(step, False)


@pytest.mark.real
@pytest.mark.timeout(180)
def test_recomputed_dropout_gives_the_same_gradients(real_ranks, stored):
    """tp=2, dropout 0.2 inside and outside the sharded regions: recomputing every
    block in backward gives bit-identical gradients on every rank."""
    recomputed = real_ranks(2).run(step, True)
    for rank, ((loss0, g0, calls0, mp), (loss1, g1, calls1, _)) in enumerate(
            zip(stored, recomputed)):
        assert mp, "no dropout on the model-parallel stream: the test would prove nothing"
        assert calls0 == []
        # every block ran twice: once in forward, once recomputed in backward
        assert sorted(calls1) == sorted(["transformer.h.0", "transformer.h.1"] * 2), calls1
        assert loss0 == loss1
        assert list(g0) == list(g1)
        for name in g0:
            assert torch.equal(g0[name], g1[name]), (rank, name)


@pytest.mark.real
@pytest.mark.timeout(180)
def test_recomputation_without_the_model_parallel_stream_differs(real_ranks, stored):
    """The negative control: torch's checkpoint restores only the default generators,
    so without restoring the model-parallel stream the recomputed masks differ."""
    broken = real_ranks(2).run(step, True, False)
    assert any(not torch.equal(s[1][n], b[1][n])
               for s, b in zip(stored, broken) for n in s[1])


def _saved_bytes(model, recompute, tp=1):
    """Bytes of activations (not parameters) autograd keeps for backward (one rank):
    a recomputed block keeps only its inputs."""
    x, y = batch()
    (sharded,) = shardplan.ranks.SimulatedRanks(tp).run(
        lambda ctx: shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                          example_inputs=(x, y), recompute=recompute))
    params = {p.untyped_storage().data_ptr() for p in sharded.parameters()}
    kept = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = sharded(x, y)[1]
    loss.backward()
    return sum(kept), {n: p.grad for n, p in sharded.named_parameters()}


def test_recomputation_keeps_fewer_activations():
    model = dropout_gpt(n_layer=3, dropout=0.0)
    stored, g0 = _saved_bytes(model, False)
    recomputed, g1 = _saved_bytes(model, True)
    assert recomputed < stored / 4, (recomputed, stored)
    for name in g0:
        assert torch.allclose(g0[name], g1[name], atol=1e-6), name


@pytest.mark.timeout(120)
def test_llama_gqa_gradients_on_simulated_ranks():
    """tp=4 over 2 K/V heads (replica groups with a gradient sum) and recomputed layers."""
    torch.manual_seed(0)
    model = build("llama-tiny", n_layers=1)
    x = torch.randint(0, model.config.vocab_size, (2, 8))

    def grads(recompute):
        def rank(ctx):
            s = shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=x,
                                      recompute=recompute)
            s(x)[0].float().pow(2).mean().backward()
            return {n: p.grad for n, p in s.named_parameters()}
        return shardplan.ranks.SimulatedRanks(4).run(rank)
    for g0, g1 in zip(grads(False), grads(True)):
        assert list(g0) == list(g1)
        for name in g0:
            torch.testing.assert_close(g0[name], g1[name], rtol=1e-5, atol=1e-6)


def test_parameter_names_and_layouts_do_not_change():
    model = dropout_gpt(n_layer=1)
    x, y = batch()

    def names(recompute):
        (s,) = shardplan.ranks.SimulatedRanks(1).run(
            lambda ctx: shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                              example_inputs=(x, y), recompute=recompute))
        return list(s.state_dict()), s.layouts
    assert names(False) == names(True)


def test_without_grad_blocks_run_once():
    model = dropout_gpt(n_layer=1, dropout=0.0).eval()
    x, y = batch()
    (s,) = shardplan.ranks.SimulatedRanks(1).run(
        lambda ctx: shardplan.parallelize(model, group=ctx.group, example_inputs=(x, y),
                                          recompute=["transformer.h.*"]))
    calls = []
    for mod in s.graph_module.modules():
        if isinstance(mod, Recomputed):
            mod.block.register_forward_pre_hook(lambda m, a, name=mod.name: calls.append(name))
    with torch.no_grad():
        logits, loss = s(x, y)
        want_logits, want_loss = model(x, y)
    assert calls == ["transformer.h.0"]  # called directly: no checkpoint, no recomputation
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(loss, want_loss)


@pytest.mark.parametrize("spec, want", [
    (True, ["layers.0", "layers.1"]),
    (["layers.1"], ["layers.1"]),
    (["layers.*", "layers.0.attention"], ["layers.0", "layers.1"]),  # not nested twice
    ("layers.0.feed_forward", ["layers.0.feed_forward"]),
])
def test_block_selection(spec, want):
    assert block_names(build("llama-tiny", n_layers=2), spec) == want


@pytest.mark.parametrize("spec, words", [
    (["decoder.*"], ["decoder.*", "matches no module"]),
    (3, ["neither a bool nor module names"]),
])
def test_bad_selection(spec, words):
    with pytest.raises(ConfigurationError) as e:
        block_names(build("llama-tiny", n_layers=2), spec)
    for w in words:
        assert w in str(e.value)
    assert e.value.fix


def test_recompute_true_needs_a_module_list():
    with pytest.raises(ConfigurationError, match="no nn.ModuleList"):
        block_names(torch.nn.Linear(2, 2), True)


@pytest.mark.timeout(180)
def test_hugging_face_gpt2_keeps_its_output_type_and_gradients():
    """The outlined graph returns what the model returns (a ModelOutput) and the
    gradients of a tp=2 run without recomputation."""
    pytest.importorskip("transformers")
    from hf_cases import build as build_hf, inputs
    model, kw = build_hf("gpt2"), inputs()

    def run(recompute):
        def rank(ctx):
            s = shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=kw,
                                      recompute=recompute)
            out = s(**kw)
            out.logits.pow(2).mean().backward()
            return type(out), {n: p.grad for n, p in s.named_parameters()}
        return shardplan.ranks.SimulatedRanks(2).run(rank)
    for (t0, g0), (t1, g1) in zip(run(False), run(True)):
        assert t0 is t1 is type(model(**kw))
        for name in g0:
            assert torch.equal(g0[name], g1[name]), name
