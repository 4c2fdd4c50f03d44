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

import dataclasses
import os
from typing import Callable

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import shardplan

from checks import assert_megatron_plan
from fuzz_models import (TWISTS, AttnCfg, BlockCfg, MlpCfg, ModelCfg, build_model,
                         divides, example_inputs, twist_fits)

# 40 examples: about 4 minutes on a loaded 2-core machine (plan, then verify: two exports
# an example); 25 of the fixed set measured 138 s, 96% shardable at tp > 1
EXAMPLES = int(os.environ.get("SHARDPLAN_FUZZ_EXAMPLES", "40"))
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
def attn_cfgs(draw, dim: int, tp: int, divisible: bool):
    qkv = draw(st.sampled_from(["fused", "separate", "interleaved", "torch_mha"]))
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
            lambda k: not divisible or k % tp == 0)
    return AttnCfg(
        heads=heads, kv_heads=kv, head_dim=head_dim, qkv=qkv, bias=draw(st.booleans()),
        kernel=draw(st.sampled_from(["manual", "sdpa", "einsum"])),
        mask=draw(st.sampled_from(["causal", "input", "none", "bool", "additive"])),
        repeat=draw(st.sampled_from(["expand", "expand", "repeat_interleave", "index"])),
        head_view=draw(st.sampled_from(["sizes", "minus1", "unflatten"])),
        merge=draw(st.sampled_from(["reshape", "view_minus1", "flatten"])))


@st.composite
def mlp_cfgs(draw, tp: int, divisible: bool):
    hidden = _pick(draw, (16, 24, 8, 12, 32, 48, 64, 6, 10),
                   lambda h: (h % tp == 0) or not divisible)
    return MlpCfg(hidden=hidden,
                  act=draw(st.sampled_from(["swiglu", "gelu", "swiglu_fused", "relu", "silu",
                                            "gelu_tanh"])),
                  bias=draw(st.booleans()))


def _sites(dim: int, a: AttnCfg | None, m: MlpCfg | None) -> dict[str, int | None]:
    """The twist sites a block has, with the size of their last dim (None: symbolic)."""
    sites: dict[str, int | None] = {"stream": dim}
    if m is not None:
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
def block_cfgs(draw, dim: int, tp: int, divisible: bool):
    kind = draw(st.sampled_from(["both", "both", "both", "attn", "mlp"]))
    a = draw(attn_cfgs(dim, tp, divisible)) if kind != "mlp" else None
    m = draw(mlp_cfgs(tp, divisible)) if kind != "attn" else None
    sites = _sites(dim, a, m)
    twists = []
    for _ in range(draw(st.sampled_from([1, 2, 0, 1, 2, 3]))):
        site = draw(st.sampled_from(sorted(sites)))
        ops = [op for op in TWISTS if twist_fits(op, site, sites[site])]
        twists.append((site, draw(st.sampled_from(ops))))
    return BlockCfg(attn=a, mlp=m,
                    norm=draw(st.sampled_from(["layer", "rms", "manual_rms", "none"])),
                    order=draw(st.sampled_from(["pre", "pre", "post"])),
                    residual=draw(st.sampled_from([True, True, True, False])),
                    twists=tuple(twists))


@st.composite
def cases(draw):
    tp = draw(st.sampled_from([2, 4, 2, 4, 1]))
    divisible = draw(st.integers(0, 9)) < 8  # split sizes divide tp in about 80% of the models
    dim = draw(st.sampled_from([16, 32, 8, 24]))
    inputs = draw(st.sampled_from(["tokens", "tokens", "floats"]))
    tokens = inputs == "tokens"
    cfg = ModelCfg(
        dim=dim,
        blocks=tuple(draw(block_cfgs(dim, tp, divisible))
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


def layout_gap(cfg: ModelCfg) -> str | None:
    """A known planner gap: the model verifies, but a region stays replicated. Each has a
    strict xfail below; when it is fixed, that test fails and its entry here must go."""
    if any(b.attn is not None and b.attn.kernel == "einsum" for b in cfg.blocks):
        return "einsum attention kept replicated"
    return None


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
    try:
        plan = shardplan.plan(model, tp, example_inputs=inputs)
    except shardplan.ShardplanError as e:
        return e
    if supported(cfg, tp) and not layout_gap(cfg):
        assert_megatron_plan(model, plan, prefix="blocks.")
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
        elif result.ok:
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
    if not result.ok and (bug := known_bug(cfg, tp)):
        return f"known bug: {bug}"
    assert result.ok, f"silently wrong result:\n{cfg}\ntp={tp}\n{result}"
    return "ok"


@pytest.mark.timeout(max(1800, 5 * EXAMPLES))  # ~1 s an example; the suite default is 300 s
@settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_sharded_model_verifies_or_is_refused(case):
    cfg, tp = case
    event(f"tp={tp}")
    event(run_case(cfg, tp))


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
    assert not isinstance(report, Exception) and report.ok, str(report)


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


EINSUM = ModelCfg(dim=16, vocab=32, blocks=(BlockCfg(
    attn=AttnCfg(heads=2, kv_heads=2, head_dim=2, qkv="fused", bias=True, kernel="einsum"),
    mlp=MlpCfg(hidden=16, act="swiglu", bias=False)),))


def test_einsum_attention_is_sharded():
    plan = shardplan.plan(build_model(EINSUM), 2, example_inputs=example_inputs(EINSUM))
    assert_megatron_plan(build_model(EINSUM), plan, prefix="blocks.")
