"""Mutation guards: the suite's checks must fail when the code is wrong.

Each test applies one fault in memory (a rule set that opens nothing, one rank's
wrong gradient, a missing f, a collective error while running) and asserts that
the check the real tests use (tests/checks.py, ``shardplan.verify``, the fuzzer's
``run_case``) reports it. A check that stays green under its fault is a defect.
"""

from __future__ import annotations

import copy
import importlib
import re
from pathlib import Path

import pytest

import shardplan
from shardplan.planner.capture import capture
from shardplan.ranks import SimulatedRanks
from shardplan.runtime import mappings

from checks import assert_equivalent, assert_megatron_layouts, full_gradient
from fuzz_models import AttnCfg, BlockCfg, MlpCfg, ModelCfg
from planner_cases import batch, make_model, reference, sharded_step
from test_fuzz import run_case

pytestmark = pytest.mark.timeout(180)

GQA = dict(n_heads=8, n_kv_heads=2, dim=32)  # at tp=4: each K/V head held by 2 ranks
KV = "layers.0.attention.wk.weight"
verify_mod = importlib.import_module("shardplan.verify")  # the module, not the function
RULES = Path(shardplan.__file__).parent / "rules" / "megatron.toml"


@pytest.fixture(scope="module")
def gqa_tp4():
    """Llama with K/V heads fewer than tp, one step on 4 simulated ranks, and its reference."""
    model = make_model("llama", **GQA)
    idx, tgt = batch(64, 2, 5)
    results = SimulatedRanks(4).run(sharded_step, model, idx, tgt, True, capture(model, (idx, tgt)))
    return model, results, reference(model, idx, tgt)


def _mutated(results, rank, name, factor):
    out = [list(r) for r in results]
    out[rank][2] = {**out[rank][2], name: out[rank][2][name] * factor}
    return out


def test_unmutated_gqa_passes(gqa_tp4):
    model, results, ref = gqa_tp4
    assert results[0][3][KV].replicas == 2  # the replica groups the mutations below aim at
    assert_equivalent(results, ref)


@pytest.mark.parametrize("ranks", [(1, 3), (2,)])
def test_wrong_kv_gradient_on_replica_members_fails(gqa_tp4, ranks):
    """Ranks 1 and 3 (never the first of their replica group) with half their K/V grad."""
    _, results, ref = gqa_tp4
    for r in ranks:
        results = _mutated(results, r, KV, 0.5)
    with pytest.raises(AssertionError, match="replica group|wk"):
        assert_equivalent(results, ref)
    with pytest.raises(AssertionError):
        full_gradient(results[0][3][KV], [r[2][KV] for r in results], ref[2][KV].shape, KV)


@pytest.mark.parametrize("rank", [1, 3])
def test_drifting_replicated_gradient_on_one_rank_fails(gqa_tp4, rank):
    _, results, ref = gqa_tp4
    name = "layers.0.attention_norm.weight" if "layers.0.attention_norm.weight" in ref[2] \
        else next(n for n, lay in results[0][3].items() if not isinstance(lay, shardplan.Shard))
    with pytest.raises(AssertionError, match="replica|differs"):
        assert_equivalent(_mutated(results, rank, name, 1.0 + 1e-3), ref)


@pytest.mark.parametrize("what", ["output", "loss"])
def test_wrong_output_or_loss_on_one_rank_fails(gqa_tp4, what):
    _, results, ref = gqa_tp4
    out = [list(r) for r in results]
    i = 0 if what == "output" else 1
    out[3][i] = out[3][i] + 0.01
    with pytest.raises(AssertionError, match="rank 3"):
        assert_equivalent(out, ref)


class _Wrong(SimulatedRanks):
    """Simulated ranks whose results are changed after the run, as a wrong rank would."""

    fault = None

    def run(self, fn, *args, **kwargs):
        results = super().run(fn, *args, **kwargs)
        return type(self).fault(results)


@pytest.mark.parametrize("fault", ["kv_replica", "replicated", "loss_rank_3"])
def test_verify_sees_every_rank(monkeypatch, fault):
    """``shardplan.verify`` fails when one non-zero rank is wrong."""
    model = make_model("llama", n_layers=1, **GQA)
    inputs = batch(64, 2, 5)

    def mutate(results):
        out = [list(r) for r in results]
        if fault == "loss_rank_3":
            out[3][1] = out[3][1] + 0.01
        else:
            name = KV if fault == "kv_replica" else "norm.weight"
            out[1][2] = {**out[1][2], name: out[1][2][name] * (0.5 if fault == "kv_replica" else 1.01)}
            if fault == "kv_replica":
                out[3][2] = {**out[3][2], name: out[3][2][name] * 0.5}
        return [tuple(r) for r in out]

    _Wrong.fault = staticmethod(mutate)
    assert shardplan.verify(model, 4, example_inputs=inputs).ok  # the control
    monkeypatch.setattr(verify_mod, "SimulatedRanks", _Wrong)
    report = shardplan.verify(model, 4, example_inputs=inputs)
    assert not report.ok, str(report)


def test_missing_f_fails_verify(monkeypatch):
    """f without its backward all-reduce: the input gradients of every region are partial."""
    model = make_model("gpt", n_layer=1)
    inputs = batch(64, 2, 5)
    monkeypatch.setattr(mappings._CopyToRegion, "backward",
                        staticmethod(lambda ctx, grad: (grad, None, None)))
    assert not shardplan.verify(model, 2, example_inputs=inputs).ok


def test_rules_that_open_nothing_fail_the_layout_check(tmp_path):
    """A rule set with no region openers replicates everything; verify is then right to say
    ok, so only the layout check (what was sharded) can catch it."""
    text = RULES.read_text()
    text = re.sub(r"(?ms)^open = \[.*?^\]", "open = []", text)
    text = re.sub(r"(?m)^vocab_embedding = .*$", "", text)
    rules = tmp_path / "nothing.toml"
    rules.write_text(text)
    model = make_model("gpt", n_layer=1)
    idx, tgt = batch(64, 2, 5)
    layouts = SimulatedRanks(2).run(lambda ctx: shardplan.parallelize(
        copy.deepcopy(model), group=ctx.group, example_inputs=(idx, tgt), rules=str(rules)).layouts)
    assert shardplan.verify(model, 2, example_inputs=(idx, tgt), rules=str(rules)).ok
    with pytest.raises(AssertionError, match="should be split"):
        assert_megatron_layouts(model, layouts[0], 2)
    from checks import assert_megatron_plan
    with pytest.raises(AssertionError, match="should be split"):
        assert_megatron_plan(model, shardplan.plan(model, 2, example_inputs=(idx, tgt),
                                                   rules=str(rules)), prefix="transformer.h.")


SUPPORTED = ModelCfg(dim=16, blocks=(BlockCfg(attn=AttnCfg(heads=4, kv_heads=4, head_dim=4),
                                              mlp=MlpCfg(hidden=16)),))


def test_collective_error_while_running_fails_the_fuzzer(monkeypatch):
    """A CommunicationError raised by g while the sharded model runs is a crash, not a
    refusal: the fuzzer's ``run_case`` must fail, not score it as 'refused'."""
    assert run_case(SUPPORTED, 2) == "sharded"  # the control: sharded whole and counted

    def broken(ctx, x, group, site):
        raise shardplan.errors.CommunicationError("ranks disagree", fix="none")

    monkeypatch.setattr(mappings._ReduceFromRegion, "forward", staticmethod(broken))
    with pytest.raises(AssertionError, match="failed while running"):
        run_case(SUPPORTED, 2)


def test_rules_that_open_nothing_fail_the_fuzzer(monkeypatch, tmp_path):
    text = RULES.read_text()
    rules = tmp_path / "nothing.toml"
    rules.write_text(re.sub(r"(?ms)^open = \[.*?^\]", "open = []", text))
    real_plan = shardplan.plan
    monkeypatch.setattr(shardplan, "plan", lambda *a, **k: real_plan(*a, **k, rules=str(rules)))
    import test_fuzz  # its counted path loads the rules itself
    real_load = test_fuzz.load_rules
    monkeypatch.setattr(test_fuzz, "load_rules", lambda *a: real_load(str(rules)))
    with pytest.raises(AssertionError, match="should be split"):
        run_case(SUPPORTED, 2)


def test_dropped_padding_idx_fails_the_padding_tests(monkeypatch):
    """A vocab lookup that ignores ``padding_idx`` (the pad row gets a gradient) fails
    both padding tests: the graph path's (tests/test_kinds.py) and the layer's
    (tests/test_layers.py, the seeded cases with a padding id)."""
    from shardplan.runtime import graph_ops, layers
    import test_kinds
    import test_layers

    real = layers.vocab_lookup

    def without_padding(weight, ids, start, end, padding_idx=None):
        return real(weight, ids, start, end, None)

    monkeypatch.setattr(graph_ops, "vocab_lookup", without_padding)
    monkeypatch.setattr(layers, "vocab_lookup", without_padding)
    with pytest.raises(AssertionError):
        test_kinds.test_graph_vocab_lookup_gives_the_pad_row_no_gradient_on_every_rank()
    # the layer's property test, at one case with a padding id, called without hypothesis
    case = test_layers.test_vocab_parallel_embedding_matches_embedding.hypothesis.inner_test
    with pytest.raises(AssertionError):
        case(tp=2, b=2, s=3, vocab=7, d=4, pad=True, seed=0)
    monkeypatch.undo()
    case(tp=2, b=2, s=3, vocab=7, d=4, pad=True, seed=0)  # the same case passes unmutated


DROPOUT = ModelCfg(dim=16, vocab=32, seq=5, blocks=(BlockCfg(
    attn=AttnCfg(heads=2, kv_heads=2, head_dim=4), mlp=MlpCfg(hidden=16, act="gelu"),
    twists=(("ffn", "dropout"), ("stream", "dropout"))),))


@pytest.mark.real
def test_dropout_on_the_wrong_stream_fails_the_dropout_fuzzer(real_ranks):
    """``ModelParallelRNG`` drawing from the replicated stream (dropout inside a region
    with the same mask on every rank) fails the train-mode fuzz check. The fault is
    applied in each worker process (``dropout_run``'s ``broken``), where the model runs."""
    from dropout_cases import check_streams, dropout_run

    pool = real_ranks(2)
    assert check_streams(pool.run(dropout_run, DROPOUT)) == {"replicated", "model-parallel"}
    with pytest.raises(AssertionError, match="did not draw from the model-parallel stream"):
        check_streams(pool.run(dropout_run, DROPOUT, True))
