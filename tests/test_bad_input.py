"""A corpus of bad inputs: each must raise one specific ``ShardplanError`` subclass
whose message names what went wrong, where (module, graph node or argument, and
the user's source line where there is one) and how to fix it.

One small function per case; ``@bad(Error, *words)`` lists the expected error
and words its message must contain (``absent=`` words it must not). Every
message must carry a fix. Cases marked ``bug=`` are engine bugs and
``todo=`` features not built yet: both are strict xfails, so the case
starts failing (and its mark must go) the day the code is right.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn

import shardplan
from shardplan import (CaptureError, CheckpointError, CommunicationError, ConfigurationError,
                       DivisibilityError, LayoutError, RuleError)
from shardplan.models import build
from shardplan.ranks import RealRanks, SimulatedRanks

from planner_models import DataDependent, NoTokens, TinyLM

RULES = Path(__file__).resolve().parent.parent / "shardplan" / "rules" / "megatron.toml"
IDS = torch.zeros(2, 4, dtype=torch.long)


@dataclass(frozen=True)
class Case:
    run: Callable[..., object]  # its parameters are pytest fixtures (tmp)
    error: type
    words: tuple[str, ...]
    absent: tuple[str, ...] = ()
    xfail: str | None = None


CASES: dict[str, Case] = {}


def bad(error, *words, absent=(), bug=None, todo=None):
    """Register the decorated function as a case that must raise ``error``."""
    reason = f"engine bug: {bug}" if bug else f"not implemented yet: {todo}" if todo else None

    def register(fn):
        CASES[fn.__name__] = Case(fn, error, words, tuple(absent), reason)
        return fn
    return register


# --------------------------------------------------------------------------- helpers

class MLP(nn.Module):
    """Float inputs, no embedding: the smallest model with a region."""

    def __init__(self, dim=8, hidden=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class ItemSized(nn.Module):
    """Sizes a slice from a tensor's value: not capturable."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        n = int(x.abs().max().item()) + 1
        return self.fc(x)[..., :n]


def gpt(seed=0, **cfg):
    """gpt-tiny with one layer, the same weights for every call with the same seed."""
    torch.manual_seed(seed)
    return build("gpt-tiny", n_layer=1, **cfg)


def on_ranks(n: int, fn, timeout: float = 60.0):
    """Run ``fn(ctx)`` on ``n`` simulated ranks (models must be built outside: the
    rank threads share torch's RNG)."""
    return SimulatedRanks(n, timeout=timeout).run(fn)


def parallelized(model, n=2, **kw):
    """Every rank's ``parallelize(model)`` (a copy each)."""
    return on_ranks(n, lambda ctx: shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                                          **kw))


def rule_file(tmp: Path, old: str, new: str) -> Path:
    """The bundled rule file with one edit."""
    text = RULES.read_text()
    assert old in text, old
    path = tmp / "edited.toml"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("rules")


# --------------------------------------------------------------------------- sizes vs tp

@bad(DivisibilityError, "transformer.h.0.attn", "gpt.py:", "self.n_head",
     "fix: choose a tp dividing 6: 2, 3, 6 (tp=4 does not)")
def heads_not_dividing_tp_strict():
    shardplan.plan(gpt(n_head=6, n_embd=48), 4, strict=True)


@bad(DivisibilityError, "blocks.0", "planner_models.py:", "tp=4")
def fused_gqa_query_heads_not_dividing_tp_strict():
    # [q | k | v] = 48 + 16 + 16: 6 query heads do not split 4 ways (2 K/V heads fewer
    # than tp would be held by pairs of ranks: tests/test_robust.py)
    shardplan.plan(TinyLM(dim=48, heads=6, kv_heads=2, layers=1), 4, strict=True)


# Heads, an FFN, hidden layer or K/V projection whose width does not divide by tp are
# not refused without strict=True: that part stays replicated, a plan decision
# (tests/test_robust.py, tests/test_uneven_heads.py).


@bad(DivisibilityError, "transformer.h.0.attn", "gpt.py:", "choose a tp dividing 3: 3 (tp=2")
def heads_not_dividing_tp_in_parallelize_strict():
    parallelized(gpt(n_head=3, n_embd=24), 2, example_inputs=IDS, strict=True)


# --------------------------------------------------------------------------- tp and groups

@bad(ConfigurationError, "tp must be a positive integer", "got 0")
def tp_zero():
    shardplan.plan(MLP(), 0, example_inputs=torch.zeros(2, 8))


@bad(ConfigurationError, "tp must be a positive integer", "got -2")
def tp_negative():
    shardplan.plan(MLP(), -2, example_inputs=torch.zeros(2, 8))


@bad(ConfigurationError, "tp must be a positive integer", "got '2'")
def tp_not_an_int():
    shardplan.plan(MLP(), "2", example_inputs=torch.zeros(2, 8))


@bad(ConfigurationError, "tp must be a positive integer", "got 0")
def tp_zero_in_verify():
    shardplan.verify(MLP(), 0, example_inputs=torch.zeros(2, 8))


@bad(ConfigurationError, "tp=4", "2 ranks")
def tp_larger_than_world():
    parallelized(MLP(), 2, tp=4, example_inputs=torch.zeros(2, 8))


@bad(ConfigurationError, "tp=3", "4 ranks")
def tp_not_dividing_world():
    parallelized(MLP(), 4, tp=3, example_inputs=torch.zeros(2, 8))


@bad(ConfigurationError, "torch.distributed is not initialized", "init_process_group", "torchrun")
def no_process_group():
    shardplan.parallelize(MLP(), tp=2, example_inputs=torch.zeros(2, 8))


@bad(ConfigurationError, "compile=", "process group", "compile=False")
def compile_on_simulated_ranks():
    parallelized(MLP(), 2, compile="aot_eager", example_inputs=torch.zeros(2, 8))


@bad(ConfigurationError, "fsdp needs a device mesh", "no mesh", "ParallelDims")
def fsdp_without_a_mesh():
    parallelized(MLP(), 2, fsdp=True, example_inputs=torch.zeros(2, 8))


@bad(ConfigurationError, "sequence length 7", "tp=2", "sequence_parallel=False")
def sequence_length_not_dividing_tp():
    model = gpt()

    def rank(ctx):
        sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                        example_inputs=IDS, sequence_parallel=True)
        sharded(torch.zeros(2, 7, dtype=torch.long))
    on_ranks(2, rank)


# --------------------------------------------------------------------------- capture

@bad(CaptureError, "DataDependent", "planner_models.py:", "if x.sum() > 0",
     "no Python control flow")
def data_dependent_control_flow():
    shardplan.plan(DataDependent(), 2)


@bad(CaptureError, "ItemSized", "test_bad_input.py:", "x.abs().max().item()", "no .item()")
def item_in_forward():
    shardplan.plan(ItemSized(), 2, example_inputs=torch.ones(2, 8))


@bad(CaptureError, "NoTokens", "no token embedding", "example_inputs")
def no_example_inputs_without_embedding():
    shardplan.plan(NoTokens(), 2)


@bad(CaptureError, "NoTokens", "planner_models.py:", "self.fc1(x)", "example_inputs")
def example_inputs_of_wrong_shape():
    shardplan.plan(NoTokens(), 2, example_inputs=torch.zeros(3, 5))


@bad(CaptureError, "GPT", "indices", "Long", "example_inputs")
def float_token_ids():
    shardplan.plan(gpt(), 2, example_inputs=torch.zeros(2, 4))


@bad(CaptureError, "GPT", "example_inputs", absent=("inspect.py",))
def example_inputs_not_tensors():
    shardplan.plan(gpt(), 2, example_inputs="hello")


@bad(CaptureError, "GPT.forward", "numpy.ndarray", "targets", "torch.as_tensor", "gpt.py:")
def example_inputs_holding_an_array():
    import numpy as np
    shardplan.plan(gpt(), 2, example_inputs=(IDS, np.zeros((2, 4), dtype=np.int64)))


@bad(CaptureError, "GPT.forward(idx, targets=None)", "tokens=", "'idx'", "example_inputs")
def example_inputs_of_an_unknown_keyword():
    shardplan.plan(gpt(), 2, example_inputs={"tokens": IDS})


@bad(ConfigurationError, "nn.Module")
def not_a_module():
    shardplan.plan(lambda x: x * 2, 2, example_inputs=torch.zeros(2, 8))


# --------------------------------------------------------------------------- dtypes

@bad(ConfigurationError, "fc1", "Long", "Float")
def integer_inputs_to_float_model():
    shardplan.verify(MLP(), 2, example_inputs=torch.zeros(2, 8, dtype=torch.long))


@bad(ConfigurationError, "Double", "Float")
def float64_model_float32_inputs():
    shardplan.verify(MLP().double(), 2, example_inputs=torch.zeros(2, 8))


@bad(ConfigurationError, "fc2", "Double")
def mixed_parameter_dtypes():
    model = MLP()
    model.fc2.double()
    shardplan.verify(model, 2, example_inputs=torch.zeros(2, 8))


# --------------------------------------------------------------------------- already parallelized

@bad(ConfigurationError, "already parallelized", "ShardedModule", "unsharded model once")
def parallelize_twice():
    model = gpt()
    on_ranks(2, lambda ctx: shardplan.parallelize(
        shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=IDS),
        group=ctx.group))


@bad(ConfigurationError, "already parallelized", "ShardedModule")
def plan_of_parallelized_model():
    sharded = parallelized(gpt(), 2, example_inputs=IDS)[0]
    shardplan.plan(sharded, 2)


@bad(ConfigurationError, "already parallelized", "ShardedModule")
def verify_of_parallelized_model():
    sharded = parallelized(gpt(), 2, example_inputs=IDS)[0]
    shardplan.verify(sharded, 2)


# --------------------------------------------------------------------------- rule files

@bad(RuleError, "does not parse", "broken.toml", "line 2", "TOML syntax")
def rule_file_that_does_not_parse(tmp):
    path = tmp / "broken.toml"
    path.write_text("name = 'x'\nversion = = 1\n")
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=path)


@bad(RuleError, "not a valid rule set", "invalid.toml", "weight", "megatron.toml")
def rule_file_that_does_not_validate(tmp):
    path = tmp / "invalid.toml"
    path.write_text("name = 'x'\nversion = 1\n"
                    "[strategy]\nopen = [{ op = 'aten.linear.default' }]\n")
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=path)


@bad(RuleError, "unknown kind", "elementwize")
def rule_file_with_unknown_op_kind(tmp):
    path = rule_file(tmp, "elementwise = [", "elementwize = [")
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=path)


@bad(RuleError, "bad signature", "...k,nk->")
def rule_file_with_bad_signature(tmp):
    path = rule_file(tmp, '"...k,nk,n->...n"', '"...k,nk->...N"')
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=path)


@bad(RuleError, "megatorn", "'megatron'")
def unknown_bundled_rule_set():
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules="megatorn")


@bad(RuleError, "cannot read rule file", "missing.toml")
def missing_rule_file(tmp):
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=tmp / "missing.toml")


@bad(RuleError, "aten.linear.default", "einsum")
def rule_file_opener_without_signature(tmp):
    linear = '"aten.linear.default" = { sig = "...k,nk,n->...n", partial = true }\n'
    path = rule_file(tmp, linear, "")
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=path)


@bad(RuleError, "aten.relu.default", "elementwise", "reduce")
def rule_file_op_under_two_kinds(tmp):
    path = rule_file(tmp, '"aten.mean.dim" = { dim = "1", distributed = "mean" }',
                     '"aten.mean.dim" = { dim = "1" }\n"aten.relu.default" = { dim = "1" }')
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=path)


@bad(RuleError, "version 99")
def rule_file_of_unknown_version(tmp):
    path = rule_file(tmp, "version = 1", "version = 99")
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=path)


@bad(RuleError, "aten.sbu.Tensor", "not an ATen operator", "aten.<op>.<overload>")
def rule_file_with_misspelt_op(tmp):
    path = rule_file(tmp, '"aten.sub.Tensor"', '"aten.sbu.Tensor"')
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=path)


@bad(RuleError, "aten.add names no overload", "aten.add.Tensor")
def rule_file_op_without_overload(tmp):
    path = rule_file(tmp, '"aten.add.Tensor"', '"aten.add"')
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=path)


@bad(RuleError, "opener aten.linear.default", "factor 'k'", "'...n'")
def rule_file_opener_factor_not_in_output(tmp):
    path = rule_file(tmp, '{ op = "aten.linear.default", weight = 1, factor = "n" }',
                     '{ op = "aten.linear.default", weight = 1, factor = "k" }')
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=path)


@bad(RuleError, "opener aten.addmm.default", "weight = 3", "3 operands")
def rule_file_opener_weight_out_of_range(tmp):
    path = rule_file(tmp, '{ op = "aten.addmm.default", weight = 2,',
                     '{ op = "aten.addmm.default", weight = 3,')
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=path)


@bad(RuleError, "aten.scaled_dot_product_attention.default", "shardable '.x'", "'x'")
def rule_file_shardable_outside_signature(tmp):
    path = rule_file(tmp, 'shardable = ".h"', 'shardable = ".x"')
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=path)


@bad(RuleError, "not a valid rule set", "bad reduce dim 'last'", "last:N")
def rule_file_with_bad_reduce_dim(tmp):
    path = rule_file(tmp, '"aten.mean.dim" = { dim = "1", distributed = "mean" }',
                     '"aten.mean.dim" = { dim = "last" }')
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=path)


@bad(RuleError, "not a valid rule set", "distributed", "median")
def rule_file_with_unknown_distributed_form(tmp):
    path = rule_file(tmp, '"aten.mean.dim" = { dim = "1", distributed = "mean" }',
                     '"aten.mean.dim" = { dim = "1", distributed = "median" }')
    shardplan.plan(MLP(), 2, example_inputs=torch.zeros(2, 8), rules=path)


# --------------------------------------------------------------------------- bundled models

@bad(ConfigurationError, "gpt-huge", "gpt-tiny", "llama-tiny")
def unknown_model_preset():
    build("gpt-huge")


@bad(ConfigurationError, "n_heads", "n_head")
def unknown_preset_override():
    build("gpt-tiny", n_heads=3)


@bad(ConfigurationError, "n_embd=32", "n_head=5")
def inconsistent_preset_override():
    build("gpt-tiny", n_head=5)


@bad(ConfigurationError, "n_head=0", "integer >= 1")
def preset_override_of_zero_heads():
    build("gpt-tiny", n_head=0)


@bad(ConfigurationError, "n_heads=4", "n_kv_heads=3", "divisors of n_heads")
def preset_override_of_kv_heads_not_dividing_heads():
    build("llama-tiny", n_kv_heads=3)


@bad(ConfigurationError, "head dim", "48/16 = 3", "even")
def preset_override_of_odd_head_dim():
    build("llama-tiny", dim=48, n_heads=16, n_kv_heads=4)


# --------------------------------------------------------------------------- run time

@bad(ConfigurationError, "id 96", "[0, 96)", "tokenizer")
def token_id_too_large():
    model = gpt()
    on_ranks(2, lambda ctx: shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                                  example_inputs=IDS)(torch.full((2, 4), 96)))


@bad(ConfigurationError, "id -1", "[0, 96)")
def token_id_negative():
    model = gpt()
    on_ranks(2, lambda ctx: shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                                  example_inputs=IDS)(torch.full((2, 4), -1)))


@bad(ConfigurationError, "id 200", "[0, 96)", "targets")
def target_id_out_of_range():
    model = gpt()
    targets = torch.full((2, 4), 200)
    on_ranks(2, lambda ctx: shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                                  example_inputs=(IDS, IDS.clone()))(IDS, targets))


@bad(ConfigurationError, "id 96", "[0, 96)")
def token_id_out_of_range_in_verify():
    shardplan.verify(gpt(), 2, example_inputs=torch.full((2, 4), 96))


@bad(ConfigurationError, "id 200", "[0, 96)", "targets", "gpt.py:")
def target_id_out_of_range_in_verify():
    shardplan.verify(gpt(), 2, example_inputs=(IDS, torch.full((2, 4), 200)))


@bad(LayoutError, "no rule for aten.cumsum.default", "blocks.0", "planner_models.py:", "add a rule")
def op_without_rule_under_strict():
    shardplan.plan(TinyLM(mlp_op="cumsum", layers=1), 2, strict=True)


@bad(LayoutError, "no rule for aten.cumsum.default", "blocks.0", "planner_models.py:")
def op_without_rule_under_strict_in_parallelize():
    torch.manual_seed(0)
    parallelized(TinyLM(mlp_op="cumsum", layers=1), 2, strict=True)


# --------------------------------------------------------------------------- generation, estimate
# (every argument: tests/test_generate.py and tests/test_memory_estimate.py)

@bad(ConfigurationError, "max_new_tokens=-1", "integer >= 0", "generate")
def sharded_generate_of_negative_length():
    model = gpt()
    on_ranks(2, lambda ctx: shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                                  example_inputs=IDS).generate(
                                                      IDS, max_new_tokens=-1))


@bad(ConfigurationError, "top_p=1.5", "(0, 1]")
def sampling_with_top_p_above_one():
    from shardplan.generate import generate
    generate(gpt(), IDS, max_new_tokens=2, do_sample=True, top_p=1.5)


@bad(ConfigurationError, "batch=-1", "integer >= 1", "plan")
def estimate_of_a_negative_batch():
    shardplan.plan(gpt(), 2, batch=-1, seq=16)


@bad(ConfigurationError, "gpu_memory='80 gigs'", "not a memory size", "80GB")
def estimate_for_memory_that_is_not_a_size():
    shardplan.plan(gpt(), 2, batch=2, seq=8, gpu_memory="80 gigs")


# --------------------------------------------------------------------------- rank runners

@bad(ConfigurationError, "world_size")
def zero_simulated_ranks():
    SimulatedRanks(0).run(lambda ctx: None)


@bad(ConfigurationError, "world_size must be >= 1, got 0")
def zero_real_ranks():
    RealRanks(0)


@bad(CommunicationError, "simulated")
def rank_that_skips_a_collective():
    def body(ctx):
        if ctx.rank == 0:
            ctx.group.all_reduce(torch.ones(3))
    on_ranks(2, body, timeout=1)


# --------------------------------------------------------------------------- ranks that disagree

@bad(CommunicationError, "not the same model on every rank", "transformer.wte.weight", "same seed")
def model_differs_across_ranks():
    models = [gpt(seed=0), gpt(seed=1)]

    def body(ctx):  # every rank must raise it (caught here: see the next case for why)
        try:
            shardplan.parallelize(models[ctx.rank], group=ctx.group, example_inputs=IDS)
        except CommunicationError as e:
            return e
    errors = on_ranks(2, body)
    assert all(isinstance(e, CommunicationError) for e in errors), errors
    raise errors[1]


@bad(CommunicationError, "rank 1 gave up")
def root_cause_on_another_rank():
    def body(ctx):
        if ctx.rank == 1:
            raise CommunicationError("rank 1 gave up", fix="none needed")
        ctx.group.all_reduce(torch.ones(3))
    on_ranks(2, body, timeout=30)


@bad(ConfigurationError, "several devices", "transformer.h.0.mlp.c_fc.weight", "meta",
     "model.to(device)")
def parameters_on_different_devices():
    model = gpt()
    model.transformer.h[0].mlp.c_fc.to("meta")
    parallelized(model, 2, example_inputs=IDS)


@bad(CheckpointError, "meta", "never loaded", "load")
def meta_model_run_before_loading_weights():
    model = build("gpt-tiny", n_layer=1, device="meta")
    on_ranks(2, lambda ctx: shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                                  example_inputs=IDS)(IDS))


@bad(CommunicationError, "rank", "shape")
def ranks_disagree_on_input_shape():
    model = gpt()

    def body(ctx):
        sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=IDS)
        sharded(torch.zeros(2, 4 if ctx.rank == 0 else 3, dtype=torch.long))
    on_ranks(2, body, timeout=10)


@bad(CommunicationError, "timed out", "rank 1", "transformer.wte")
def collective_timeout_on_a_diverged_rank():
    model = gpt()

    def body(ctx):
        sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=IDS)
        if ctx.rank == 0:  # rank 1 diverged: it never runs the forward
            sharded(IDS)
    on_ranks(2, body, timeout=3)


# --------------------------------------------------------------------------- the test

def _param(name: str):
    case = CASES[name]
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [_param(n) for n in CASES])
def test_bad_input(name, request):
    case = CASES[name]
    args = [request.getfixturevalue(p) for p in inspect.signature(case.run).parameters]
    with pytest.raises(case.error) as info:
        case.run(*args)
    msg = str(info.value)
    for word in case.words:
        assert word in msg, f"{word!r} not in the message:\n{msg}"
    for word in case.absent:
        assert word not in msg, f"{word!r} in the message:\n{msg}"
    assert info.value.fix, f"no fix in the message:\n{msg}"


def test_corpus_size():
    assert len(CASES) == 70  # README: "a 70-case bad-input corpus"


# --------------------------------------------------------------------------- unusual, not bad

@pytest.mark.parametrize("tp", [1, 2])
def test_example_inputs_passing_one_tensor_twice(tp):
    model = gpt()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 96, (2, 4), generator=g)
    targets = torch.randint(0, 96, (2, 4), generator=g)

    def body(ctx):
        sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                        example_inputs=(IDS, IDS))
        return sharded(idx, targets)[0].detach()
    torch.testing.assert_close(on_ranks(tp, body)[0], model(idx, targets)[0].detach(),
                               atol=1e-5, rtol=1e-4)


def test_sequence_parallel_without_effect_says_so():
    """A model whose row-parallel outputs have no sequence dim plans as without sequence
    parallelism (the same collectives), and its one warning says so."""
    x = torch.zeros(2, 8)
    plan = shardplan.plan(MLP(), 2, example_inputs=x, sequence_parallel=True)
    plain = shardplan.plan(MLP(), 2, example_inputs=x)
    assert plan.collectives == plain.collectives and not plan.sequence_parallel
    assert len(plan.warnings) == 1 and "sequence_parallel=True has no effect" in \
        plan.warnings[0] and "sequence_parallel=False" in plan.warnings[0], plan.warnings
    on = shardplan.plan(gpt(), 2, sequence_parallel=True)  # where it has: no such warning
    assert on.sequence_parallel and not [w for w in on.warnings if "no effect" in w]
