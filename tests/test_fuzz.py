"""Fuzzing the planner with random small Transformer-like models.

The property: for any model the fuzzer builds (tests/fuzz_models.py) and any
tp, ``shardplan.verify`` either finds the sharded model equal to the
unsharded one, or shardplan refuses it with a ``ShardplanError``. Never a
silently wrong result (a report that is not ok), never another exception.
And a model made only of supported blocks whose split sizes divide by tp
must not be refused at all.

Each example costs one export (about a second), so the models are tiny.
``SHARDPLAN_FUZZ_EXAMPLES=2000`` runs more; ``SHARDPLAN_FUZZ_RANDOM=1`` draws
new examples instead of the fixed CI set.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Callable

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import shardplan

from dropout_cases import check_streams, dropout_run
from checks import ROW_PARALLEL, assert_equivalent, assert_megatron_plan, ledger_count
from fuzz_models import (TWISTS, AttnCfg, BlockCfg, MlpCfg, ModelCfg, build_model,
                         divides, example_inputs, megatron_block_count, twist_fits)
from shardplan.planner.capture import capture
from shardplan.planner.rules import load_rules
from shardplan.ranks import SimulatedRanks
from shardplan.runtime.ledger import CommLedger
from shardplan.sharded import ShardedModule

# 23 examples: 90 s on a loaded 2-core machine (a counted model: one export; any other:
# plan, then verify, two exports). The fixed set's mix: 1 at tp=1, 13 of the 22 at tp > 1
# sharded whole with their collectives counted, 9 verified with fallbacks (each refused
# under strict), none refused without it (the 6 it refused while a head split not dividing
# tp was an error now keep that attention whole). Two
# fewer than before: the train-mode dropout examples below take their place.
EXAMPLES = int(os.environ.get("SHARDPLAN_FUZZ_EXAMPLES", "23"))
RANDOM = os.environ.get("SHARDPLAN_FUZZ_RANDOM", "") not in ("", "0")

# Known engine bugs the fuzzer keeps meeting. A failing example is put down to
# one of them when the same model, changed by ``avoid``, verifies; anything else
# fails the test. Each has a strict xfail regression test below: when it is
# fixed, that test fails, and its entry here must go.
def _without_twist(op: str) -> Callable[[ModelCfg], ModelCfg]:
    def avoid(cfg: ModelCfg) -> ModelCfg:
        return dataclasses.replace(cfg, blocks=tuple(
            dataclasses.replace(b, twists=tuple(t for t in b.twists if t[1] != op))
            for b in cfg.blocks))
    return avoid


KNOWN_BUGS: dict[str, Callable[[ModelCfg], ModelCfg]] = {}


# --------------------------------------------------------------------------- strategies

def _pick(draw, choices, ok):
    good = [c for c in choices if ok(c)]
    return draw(st.sampled_from(good or list(choices)))


@st.composite
def attn_cfgs(draw, dim: int, tp: int, divisible: bool, plain: bool = False):
    qkv = draw(st.sampled_from(["fused", "separate", "interleaved"] + ["torch_mha"] * (not plain)))
    if qkv == "torch_mha":
        heads = _pick(draw, [h for h in (1, 2, 4, 8) if dim % h == 0],
                      lambda h: (h % tp == 0) == divisible)
        head_dim, kv = dim // heads, heads
    else:
        head_dim = draw(st.sampled_from([2, 4, 8]))
        heads = _pick(draw, [h for h in (1, 2, 4, 8) if h * head_dim <= 32],
                      lambda h: not divisible or h % tp == 0)
        kv = heads if qkv == "interleaved" else _pick(
            draw, [k for k in (1, 2, 4, 8) if heads % k == 0],
            lambda k: not divisible or k % tp == 0 or (k < tp and tp % k == 0 and qkv == "separate"
                                                       and k >= 2))  # K/V replica groups
    return AttnCfg(
        heads=heads, kv_heads=kv, head_dim=head_dim, qkv=qkv, bias=draw(st.booleans()),
        kernel=draw(st.sampled_from(["manual", "sdpa"] + ["einsum"] * (not plain))),
        mask=draw(st.sampled_from(["causal", "input", "none", "bool", "additive"])),
        repeat="expand" if plain else draw(st.sampled_from(["expand", "expand",
                                                            "repeat_interleave", "index"])),
        head_view=draw(st.sampled_from(["sizes", "minus1", "unflatten"])),
        merge=draw(st.sampled_from(["reshape", "view_minus1", "flatten"])))


@st.composite
def mlp_cfgs(draw, tp: int, divisible: bool):
    hidden = _pick(draw, (16, 24, 8, 12, 32, 48, 64, 6, 10),
                   lambda h: (h % tp == 0) or not divisible)
    return MlpCfg(hidden=hidden,
                  act=draw(st.sampled_from(["swiglu", "gelu", "swiglu_fused", "relu", "silu",
                                            "gelu_tanh", "moe"])),
                  bias=draw(st.booleans()))


def _sites(dim: int, a: AttnCfg | None, m: MlpCfg | None) -> dict[str, int | None]:
    """The twist sites a block has, with the size of their last dim (None: symbolic)."""
    sites: dict[str, int | None] = {"stream": dim}
    if m is not None and m.act != "moe":
        sites["ffn"] = m.hidden
    if a is not None and a.qkv == "torch_mha":
        sites["merged"] = dim
    elif a is not None:
        sites.update(q=a.heads * a.head_dim, heads=a.head_dim, merged=a.heads * a.head_dim,
                     scores=None, probs=None)
        if a.qkv in ("fused", "interleaved"):
            sites["qkv"] = (a.heads + 2 * a.kv_heads) * a.head_dim
    return sites


@st.composite
def block_cfgs(draw, dim: int, tp: int, divisible: bool, plain: bool = False):
    kind = draw(st.sampled_from(["both", "both", "both", "attn", "mlp"]))
    a = draw(attn_cfgs(dim, tp, divisible, plain)) if kind != "mlp" else None
    m = draw(mlp_cfgs(tp, divisible)) if kind != "attn" else None
    sites = _sites(dim, a, m)
    twists = []
    for _ in range(draw(st.sampled_from([1, 2, 0, 1, 2, 3]))):
        site = draw(st.sampled_from(sorted(sites)))
        ops = [op for op in TWISTS if twist_fits(op, site, sites[site])
               and (TWISTS[op].local or not plain)]
        twists.append((site, draw(st.sampled_from(ops))))
    return BlockCfg(attn=a, mlp=m,
                    norm=draw(st.sampled_from(["layer", "rms", "manual_rms", "none"])),
                    order=draw(st.sampled_from(["pre", "pre", "post"])),
                    residual=draw(st.sampled_from([True, True, True, False])),
                    twists=tuple(twists))


@st.composite
def cases(draw):
    tp = draw(st.sampled_from([2, 4, 2, 4, 1]))
    # plain (6 in 10): what Megatron's rules shard whole (local twists only, sizes dividing
    # tp, no einsum kernel), so that most models at tp > 1 get their collectives counted;
    # otherwise split sizes divide tp in about 80% of the models
    plain = draw(st.integers(0, 9)) < 6
    divisible = plain or draw(st.integers(0, 9)) < 8
    dim = draw(st.sampled_from([16, 32, 8, 24]))
    inputs = draw(st.sampled_from(["tokens", "tokens", "floats"]))
    tokens = inputs == "tokens"
    cfg = ModelCfg(
        dim=dim,
        blocks=tuple(draw(block_cfgs(dim, tp, divisible, plain))
                     for _ in range(draw(st.sampled_from([1, 1, 2, 1])))),  # 2 layers: 1 in 4
        inputs=inputs, vocab=draw(st.sampled_from([16, 32, 37, 64])),
        pos_embedding=draw(st.booleans()),
        final_norm=draw(st.sampled_from(["layer", "rms", "none"])),
        tie=tokens and draw(st.booleans()), head_bias=draw(st.booleans()),
        loss=tokens and draw(st.booleans()),
        batch=draw(st.sampled_from([2, 1, 3])), seq=draw(st.sampled_from([4, 1, 3, 5, 6])),
        seed=draw(st.integers(0, 2**16)))
    return cfg, tp


# --------------------------------------------------------------------------- the property

def supported(cfg: ModelCfg, tp: int) -> bool:
    """Only blocks and twists the Megatron rules handle locally, and sizes that divide tp."""
    if not divides(cfg, tp):
        return False
    for b in cfg.blocks:
        if any(not TWISTS[op].local for _, op in b.twists):
            return False
        a = b.attn
        if a is not None and (a.qkv == "torch_mha" or a.repeat != "expand"):
            return False
    return True


def _loss(out):
    return out[1] if isinstance(out, tuple) else out.float().square().mean()


def _counted_step(ctx, model, inputs, captured):
    try:  # planning this rank: a ShardplanError here is a refusal
        sharded = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(),
                                example=((), inputs), gather_output=True, strict=False,
                                captured=copy.deepcopy(captured))
    except shardplan.ShardplanError as e:
        return e
    with CommLedger() as ledger:
        out = sharded(**inputs)
        loss = _loss(out)
        loss.backward()
    grads = {n: p.grad for n, p in sharded.named_parameters(remove_duplicate=False)}
    logits = out[0] if isinstance(out, tuple) else out
    return logits.detach(), loss.detach(), grads, sharded.layouts, ledger.records


def counted_case(cfg: ModelCfg, tp: int, model, inputs):
    """A supported model at tp > 1, run on simulated ranks with a ledger: every rank's
    logits, loss and every copy of every gradient against the unsharded model
    (checks.assert_equivalent), every GEMM in the blocks split by Megatron's rule, and
    the blocks' collectives equal ``megatron_block_count`` of the description. One
    export for all of it."""
    try:
        captured = capture(model, (), inputs)
    except shardplan.ShardplanError as e:
        return e
    try:
        results = SimulatedRanks(tp).run(_counted_step, model, inputs, captured)
    except shardplan.ShardplanError as e:
        raise AssertionError(f"planned, then failed while running: {type(e).__name__}: {e}"
                             f"\n{cfg}\ntp={tp}") from e
    refusals = [r for r in results if isinstance(r, shardplan.ShardplanError)]
    if refusals:
        assert len(refusals) == tp, "some ranks refused the model, others did not"
        return refusals[0]
    ref = copy.deepcopy(model)
    out = ref(**inputs)
    loss = _loss(out)
    loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert_equivalent(results, ((out[0] if isinstance(out, tuple) else out).detach(),
                                loss.detach(), grads))
    layouts = results[0][3]
    for mod_name, mod in model.named_modules():  # Megatron's split, from names and types
        if mod_name.startswith("blocks.") and isinstance(mod, nn.Linear):
            want_dim = 1 if mod_name.rsplit(".", 1)[-1] in ROW_PARALLEL else 0
            lay = layouts[f"{mod_name}.weight"]
            assert isinstance(lay, shardplan.Shard) and lay.dim % 2 == want_dim, \
                f"{mod_name}.weight should be split on dim {want_dim} at tp={tp}, is {lay}"
    for name in layouts:  # experts: each expert's gate | up column, down row parallel
        if name.startswith("blocks.") and name.endswith((".w_up", ".w_down")):
            want = "S(1|" if name.endswith("w_up") else "S(2)"
            assert str(layouts[name]).startswith(want), f"{name} is {layouts[name]} at tp={tp}"
    head_sharded = isinstance(layouts["head.weight"], shardplan.Shard)
    want = megatron_block_count(cfg, tp, head_sharded)
    for rank, r in enumerate(results):
        got = ledger_count(r[4])
        got["forward"] = ledger_count([x for x in r[4] if x.direction == "forward"
                                       and "@blocks." in f"@{x.site}"])["forward"]
        assert got == want, f"rank {rank}: {got} != Megatron's {want}\n{cfg}\ntp={tp}"
        assert all(x.group_size == tp for x in r[4]), rank
    return "counted"


def verify_case(cfg: ModelCfg, tp: int):
    """``verify``'s report, or the ShardplanError ``plan`` refused the model with.

    A refusal must come at plan time: an error raised while the sharded model runs
    (a ``CommunicationError``, a shape error) is a crash, not a refusal, and fails.
    For a supported model, the plan must also split every GEMM the generator put in
    a region (column-parallel in, row-parallel out), read from the model alone.
    """
    model = build_model(cfg)
    inputs = example_inputs(cfg)
    with torch.no_grad():
        model(**inputs)  # the fuzzer's own check: the unsharded model runs
    if tp > 1 and supported(cfg, tp):
        return counted_case(cfg, tp, model, inputs)
    try:
        plan = shardplan.plan(model, tp, example_inputs=inputs)
    except shardplan.ShardplanError as e:
        return e
    if supported(cfg, tp):
        assert_megatron_plan(model, plan, prefix="blocks.")
    if plan.warnings:  # a fallback the rules could not avoid: strict refuses it, with a fix
        with pytest.raises(shardplan.LayoutError) as refused:
            shardplan.plan(model, tp, example_inputs=inputs, strict=True)
        assert refused.value.fix, refused.value
    try:
        return shardplan.verify(model, tp, example_inputs=inputs)
    except shardplan.ShardplanError as e:
        raise AssertionError(f"planned, then failed while running: {type(e).__name__}: {e}"
                             f"\n{cfg}\ntp={tp}") from e


def known_bug(cfg: ModelCfg, tp: int, refused: bool = False) -> str | None:
    """The known bug a failing example is put down to, if any: the model changed to
    avoid it verifies (or, for a wrong result or a crash, is refused)."""
    for name, avoid in KNOWN_BUGS.items():
        changed = avoid(cfg)
        if changed == cfg:
            continue
        try:
            result = verify_case(changed, tp)
        except Exception:
            continue
        if isinstance(result, shardplan.ShardplanError):
            if not refused:
                return name
        elif result == "counted" or result.ok:
            return name
    return None


def run_case(cfg: ModelCfg, tp: int) -> str:
    """'ok', the name of the ShardplanError shardplan refused the model with, or the
    known bug it met."""
    try:
        result = verify_case(cfg, tp)
    except Exception:
        if bug := known_bug(cfg, tp):
            return f"known bug: {bug}"
        raise
    if isinstance(result, shardplan.ShardplanError):
        assert result.fix, f"{type(result).__name__} without a fix: {result}"
        if supported(cfg, tp) and (bug := known_bug(cfg, tp, refused=True)):
            return f"known bug: {bug}"
        assert not supported(cfg, tp), f"a supported model was refused:\n{cfg}\ntp={tp}\n{result}"
        return type(result).__name__
    if result == "counted":
        return "sharded"
    if not result.ok and (bug := known_bug(cfg, tp)):
        return f"known bug: {bug}"
    assert result.ok, f"silently wrong result:\n{cfg}\ntp={tp}\n{result}"
    return "ok"


# the sample and its mix run in one process (pytest-xdist: one worker for the group)
@pytest.mark.xdist_group("fuzz-sample")
@pytest.mark.timeout(max(1800, 5 * EXAMPLES))  # ~1 s an example; the suite default is 300 s
@settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_sharded_model_verifies_or_is_refused(case):
    cfg, tp = case
    event(f"tp={tp}")
    outcome = run_case(cfg, tp)
    event(outcome)
    MIX.append((tp, outcome))


MIX: list[tuple[int, str]] = []  # (tp, outcome) of every example the test above ran


@pytest.mark.xdist_group("fuzz-sample")
def test_fuzz_mix():
    """The fixed CI sample exercises what it is meant to: tp=1 models, models verified
    with a fallback (which strict refuses, ``verify_case``), and at tp > 1 a majority
    sharded by Megatron's rules with their collectives counted (``counted_case``). Runs
    after the property test, from the outcomes it recorded."""
    if not MIX:
        pytest.skip("test_sharded_model_verifies_or_is_refused did not run in this session")
    mix = {"tp=1": sum(tp == 1 for tp, _ in MIX),
           "sharded (counted)": sum(o == "sharded" for _, o in MIX),
           "verified, not all Megatron": sum(tp > 1 and o == "ok" for tp, o in MIX),
           "refused": sum(o not in ("ok", "sharded") and not o.startswith("known bug")
                          for _, o in MIX),
           "known bug": sum(o.startswith("known bug") for _, o in MIX)}
    print(f"\nfuzz mix over {len(MIX)} examples: {mix}")
    above_1 = sum(tp > 1 for tp, _ in MIX)
    if RANDOM or len(MIX) < 20:
        return  # the bounds below are for the fixed CI sample
    assert mix["tp=1"] >= 1 and mix["verified, not all Megatron"] >= 1, mix
    assert mix["sharded (counted)"] * 2 >= above_1, mix


# --------------------------------------------------------------------------- known bugs

class TwoMLPs(nn.Module):
    """Two MLPs back to back: the second reads the first's all-reduced output directly."""

    def __init__(self, bias=True):
        super().__init__()
        self.up1, self.down1 = nn.Linear(8, 16, bias=bias), nn.Linear(16, 8, bias=bias)
        self.up2, self.down2 = nn.Linear(8, 16, bias=bias), nn.Linear(16, 8, bias=bias)

    def forward(self, x):
        return self.down2(torch.relu(self.up2(self.down1(torch.relu(self.up1(x))))))


@pytest.mark.parametrize("bias", [True, False])
def test_output_of_g_read_directly_by_next_region(bias):
    """A region opened right on the output of g (or of the bias added after it) gets its f."""
    torch.manual_seed(0)
    report = shardplan.verify(TwoMLPs(bias), 2, example_inputs=torch.randn(4, 8))
    assert report.ok, str(report)


CRASH = ModelCfg(dim=16, vocab=16, final_norm="none", blocks=(
    BlockCfg(attn=AttnCfg(heads=4, kv_heads=4, head_dim=8, mask="additive"), mlp=None),))


def test_g_output_is_sliced_for_a_sharded_add():
    """The vocab-parallel embedding's output (after its g) meeting a sharded tensor is sliced."""
    report = verify_case(CRASH, 4)
    assert report == "counted", str(report)  # sharded whole, equal, Megatron's collectives


def test_sdpa_with_a_2d_mask_is_sharded():
    """A [T, T] attn_mask broadcasts over batch and heads: the attention is sharded."""
    cfg = dataclasses.replace(CRASH, final_norm="layer")
    plan = shardplan.plan(build_model(cfg), 4, example_inputs=example_inputs(cfg))
    assert plan.param("blocks.0.attn.wq.weight").layout.startswith("S(0")


class Unsqueezed(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(self.up(x).unsqueeze(-2).squeeze(-2))


@pytest.mark.parametrize("tp", [2, 4])
def test_unsqueeze_before_the_sharded_dim(tp):
    """A new size-1 dim in front of the split dim: the shard stays on the split dim."""
    torch.manual_seed(0)
    report = shardplan.verify(Unsqueezed(), tp, example_inputs=torch.randn(2, 3, 8))
    assert report.ok, str(report)


DIST_NORM = ModelCfg(dim=16, vocab=32, loss=True, blocks=(BlockCfg(
    attn=AttnCfg(heads=4, kv_heads=4, head_dim=4), mlp=MlpCfg(hidden=32, act="silu"),
    twists=(("q", "dist_rms"), ("ffn", "center"))),))


@pytest.mark.parametrize("tp", [2, 4])
def test_norm_over_a_split_dim_runs_distributed(tp):
    """The fuzzer's written-out RMSNorm on the split queries and a centring of the split
    FFN hidden dim: verified on every rank, attention and MLP still split, each reduction
    one stat all-reduce of b*s numbers."""
    model, kw = build_model(DIST_NORM), example_inputs(DIST_NORM)
    report = verify_case(DIST_NORM, tp)
    assert getattr(report, "ok", False), str(report)
    plan = shardplan.plan(model, tp, example_inputs=kw)
    for name in ("wq", "wk", "wv", "wo"):
        assert plan.param(f"blocks.0.attn.{name}.weight").layout == ("S(1)" if name == "wo" else "S(0)")
    assert plan.param("blocks.0.mlp.down.weight").layout == "S(1)"
    stats = [c.elements for c in plan.collectives if c.purpose == "stat"]
    assert stats == [DIST_NORM.batch * DIST_NORM.seq] * 2
    assert all(c.chosen == "distributed" for c in plan.choices)


WRITTEN_OUT = ModelCfg(dim=16, vocab=32, loss=True, blocks=(
    BlockCfg(attn=AttnCfg(heads=4, kv_heads=4, head_dim=4), mlp=MlpCfg(hidden=32, act="silu"),
             twists=(("q", "normalize"), ("ffn", "amax_ties"))),
    BlockCfg(attn=AttnCfg(heads=4, kv_heads=4, head_dim=4), mlp=MlpCfg(hidden=32, act="silu"),
             twists=(("q", "layer_norm_2d"), ("ffn", "group_norm")))))


def test_written_out_reductions_and_group_norm_stay_sharded():
    """The fuzzer's F.normalize and LayerNorm over two trailing dims on the split queries,
    a max with tied maxima and GroupNorm (2 groups) on the split FFN hidden dim, at tp 2:
    verified on every rank, every attention and MLP GEMM still split, the reductions
    distributed, GroupNorm local (one group per rank)."""
    model, kw = build_model(WRITTEN_OUT), example_inputs(WRITTEN_OUT)
    report = shardplan.verify(model, 2, example_inputs=kw)
    assert report.ok, str(report)
    plan = shardplan.plan(model, 2, example_inputs=kw)
    for b in range(2):
        for name in ("wq", "wk", "wv", "wo"):
            assert plan.param(f"blocks.{b}.attn.{name}.weight").layout == \
                ("S(1)" if name == "wo" else "S(0)"), (b, name)
        assert plan.param(f"blocks.{b}.mlp.down.weight").layout == "S(1)"
    assert [c.chosen for c in plan.choices] == ["distributed"] * 3
    assert not plan.warnings


EINSUM = ModelCfg(dim=16, vocab=32, blocks=(BlockCfg(
    attn=AttnCfg(heads=2, kv_heads=2, head_dim=2, qkv="fused", bias=True, kernel="einsum"),
    mlp=MlpCfg(hidden=16, act="swiglu", bias=False)),))


def test_einsum_attention_is_sharded():
    """Attention by ``torch.einsum``: split by Megatron's rule, equal on every rank, with
    Megatron's collectives (counted_case), as the fuzzer's other kernels."""
    plan = shardplan.plan(build_model(EINSUM), 2, example_inputs=example_inputs(EINSUM))
    assert_megatron_plan(build_model(EINSUM), plan, prefix="blocks.")
    assert run_case(EINSUM, 2) == "sharded"


MOE = ModelCfg(dim=16, loss=True, blocks=(BlockCfg(
    attn=AttnCfg(heads=4, kv_heads=4, head_dim=4), mlp=MlpCfg(hidden=16, act="moe")),))


@pytest.mark.parametrize("tp", [2, 4])
def test_moe_experts_are_counted(tp):
    """The fuzzer's experts, fixed (the drawn sample may not hold one): equal on every
    rank, each expert split Megatron's way, and Megatron's collectives plus the routing
    weights' f (counted_case)."""
    assert run_case(MOE, tp) == "sharded"


# --------------------------------------------------------------------------- train-mode dropout

# The examples above run in eval mode, where dropout does nothing. These put train-mode
# dropout (p=0.25) on the residual stream (replicated) and at a site inside a sharded
# region of a fuzz model, and run it on 2 real ranks (simulated ranks share one
# generator): every mask must come from the stream its input calls for, redrawn bit for
# bit (tests/dropout_cases.py). About 5 s an example once the rank pool is up.
DROPOUT_EXAMPLES = int(os.environ.get("SHARDPLAN_FUZZ_DROPOUT_EXAMPLES", "2"))


@st.composite
def dropout_cases(draw):
    cfg, _ = draw(cases())
    assume(supported(cfg, 2))
    b = cfg.blocks[0]
    inside = draw(st.sampled_from(sorted(set(_sites(cfg.dim, b.attn, b.mlp)) - {"stream"})))
    b = dataclasses.replace(b, twists=b.twists + (("stream", "dropout"), (inside, "dropout")))
    return dataclasses.replace(cfg, blocks=(b,) + cfg.blocks[1:])


DROPOUT_STREAMS: list[set[str]] = []  # the streams each example above checked


@pytest.mark.real
@pytest.mark.xdist_group("fuzz-dropout")
@pytest.mark.timeout(max(300, 30 * DROPOUT_EXAMPLES))
@settings(max_examples=DROPOUT_EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
          suppress_health_check=list(HealthCheck))
@given(cfg=dropout_cases())
def test_train_mode_dropout_draws_from_the_right_stream(real_ranks, cfg):
    results = real_ranks(2).run(dropout_run, cfg)
    assert not any(isinstance(r, shardplan.ShardplanError) for r in results), \
        f"a supported model was refused:\n{cfg}\n{results[0]}"
    seen = check_streams(results)
    event(f"dropout streams: {sorted(seen)}")
    DROPOUT_STREAMS.append(seen)


@pytest.mark.xdist_group("fuzz-dropout")
def test_dropout_mix():
    """The fixed sample checks both streams (runs after the test above)."""
    if not DROPOUT_STREAMS:
        pytest.skip("test_train_mode_dropout_draws_from_the_right_stream did not run")
    assert set().union(*DROPOUT_STREAMS) == {"replicated", "model-parallel"}, DROPOUT_STREAMS
