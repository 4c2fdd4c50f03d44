"""The training-memory estimate (``plan(..., batch=, seq=)``) against measurement:
the bundled GPT at tp 2 on simulated ranks, each term within 5% of what a real
step holds (tensor bytes after an AdamW step; activations by
``saved_tensors_hooks``, plain, sequence-parallel and recomputed)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import shardplan
from shardplan.models import build
from shardplan.planner.memory import parse_bytes
from shardplan.ranks import SimulatedRanks

CFG = dict(n_embd=64, n_head=4, n_layer=3, vocab_size=128, block_size=32, dropout=0.0)
BATCH, SEQ, TP = 4, 32, 2


def _batch():
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, CFG["vocab_size"], (BATCH, SEQ), generator=g) for _ in range(2))


def _saved_bytes(sharded, batch) -> int:
    """Bytes of the storages autograd keeps for backward, each once, model state left out."""
    state = {t.untyped_storage().data_ptr() for t in (*sharded.parameters(), *sharded.buffers())}
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in state:
            kept[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = sharded(*batch)
    loss.backward()
    return sum(kept.values())


def _measure(ctx, model, batch, sp: bool, rc: bool) -> dict:
    sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=batch,
                                    gather_output=False, sequence_parallel=sp, recompute=rc)
    out = {"activations": _saved_bytes(sharded, batch)}
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    opt.step()
    params = list(sharded.parameters())
    out["params"] = sum(p.numel() * p.element_size() for p in params)
    out["grads"] = sum(p.grad.numel() * p.grad.element_size() for p in params)
    out["optimizer_state"] = sum(v.numel() * v.element_size() for s in opt.state.values()
                                 for k, v in s.items() if k != "step")
    return out


@pytest.mark.parametrize("sp,rc", [(False, False), (True, False), (False, True)],
                         ids=["plain", "sequence-parallel", "recompute"])
def test_estimate_within_5_percent_of_measured(sp, rc):
    torch.manual_seed(0)
    model = build("gpt-tiny", **CFG)
    batch = _batch()
    measured = SimulatedRanks(TP).run(_measure, model, batch, sp, rc)
    est = shardplan.plan(model, TP, batch=BATCH, seq=SEQ, sequence_parallel=sp,
                         recompute=rc).memory.training
    for term in ("params", "grads", "optimizer_state", "activations"):
        got = max(m[term] for m in measured)
        assert abs(getattr(est, term) - got) <= 0.05 * got, (term, getattr(est, term), got)


def test_fsdp_divides_state_and_mixed_precision_adds_a_master_copy():
    model = build("gpt-tiny", device="meta", **CFG)
    base = shardplan.plan(model, TP, batch=BATCH, seq=SEQ).memory.training
    fsdp = shardplan.plan(model, TP, batch=BATCH, seq=SEQ, dp=4, fsdp=True).memory.training
    assert fsdp.params == base.params // 4 and fsdp.optimizer_state == base.optimizer_state // 4
    assert fsdp.fsdp_transient == _gathered_block_bytes(model, dp=4)
    assert fsdp.activations == base.activations
    bf16 = shardplan.plan(model, TP, batch=BATCH, seq=SEQ, dtype=torch.bfloat16).memory.training
    assert bf16.params * 2 == base.params
    assert bf16.optimizer_state == base.optimizer_state * 3 // 2  # 2 moments + master, fp32
    assert bf16.activations < base.activations


@pytest.mark.parametrize("tp", [1, TP])
def test_hsdp_divides_state_by_the_shards_only(tp):
    """Mixed-precision AdamW holds 16 bytes a parameter (bf16 weight and gradient, fp32
    master and two moments); HSDP divides them by dp_shard, not by dp_replicate. At
    tp=1 a rank's parameters are the model's; at tp 2 its TP shards (the plan's)."""
    model = build("gpt-tiny", device="meta", **CFG)
    est = shardplan.plan(model, tp, batch=BATCH, seq=SEQ, dtype=torch.bfloat16,
                         dp_replicate=2, dp_shard=4).memory.training
    plain = shardplan.plan(model, tp, batch=BATCH, seq=SEQ, dtype=torch.bfloat16)
    local = sum(math.prod(p.local_shape) for p in plain.params)
    if tp == 1:
        assert local == sum(p.numel() for p in model.parameters())
    assert est.params + est.grads + est.optimizer_state == 16 * local // 4
    assert (est.dp, est.dp_replicate, est.dp_shard, est.fsdp) == (8, 2, 4, True)
    fsdp = shardplan.plan(model, tp, batch=BATCH, seq=SEQ, dtype=torch.bfloat16,
                          dp=4, fsdp=True).memory.training  # the alias: dp is the shards
    assert (fsdp.params, fsdp.optimizer_state, fsdp.fsdp_transient) == \
        (est.params, est.optimizer_state, est.fsdp_transient)
    assert "dp_replicate=2 x dp_shard=4 HSDP" in shardplan.plan(
        model, tp, batch=BATCH, seq=SEQ, dp_replicate=2, dp_shard=4).report()


def _gathered_block_bytes(model, dp: int) -> int:
    """FSDP's transient by hand: one block's TP-local fp32 parameters gathered over dp,
    and as many gradient bytes before their reduce-scatter, less the rank's own shard.
    Megatron's rule: every linear weight and the column-parallel (not ``c_proj``)
    biases are split over tp; the layer norms are whole. (The blocks are all alike.)"""
    elements = 0
    for name, p in model.transformer.h[0].named_parameters():
        split = name.endswith("weight") and "ln_" not in name or name.endswith(
            ("c_attn.bias", "c_fc.bias"))
        elements += p.numel() // TP if split else p.numel()
    return 2 * elements * 4 * (dp - 1) // dp


def test_fits_and_report_line():
    model = build("gpt-tiny", device="meta", **CFG)
    small = shardplan.plan(model, TP, batch=BATCH, seq=SEQ, gpu_memory=parse_bytes("1MB"))
    big = shardplan.plan(model, TP, batch=BATCH, seq=SEQ, gpu_memory=parse_bytes("80GB"))
    assert small.memory.training.fits is False and big.memory.training.fits is True
    assert "DOES NOT FIT" in small.report() and "FITS" in big.report()
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("141e9") == 141 * 10**9


# --------------------------------------------------------------------------- bad arguments

GOOD = dict(batch=BATCH, seq=SEQ)
BAD = {  # argument -> values the estimate refuses (each with the others valid), before capture
    "batch": [0, -1, 2.0, True, "4"],
    "seq": [0, -16, 8.5, False],
    "dp": [0, -2, 1.0, True],
    "dp_replicate": [0, -1, 2.0, False],
    "dp_shard": [0, -3, 1.5, True],
    "fsdp": [1, "yes", None],
    "sequence_parallel": [1, None],
    "recompute": [1, ["transformer.h.*"]],
    "dtype": [torch.int8, "fp16", "float8", 16],
    "optimizer": ["adam", "AdamW", 0],
    "gpu_memory": [0, -5, float("nan"), True, "80XB", "", "1.2.3GB", "-5GB", "1e999GB"],
}


@pytest.mark.parametrize("name,value", [pytest.param(k, v, id=f"{k}={v!r}")
                                        for k, vs in BAD.items() for v in vs])
def test_estimate_refuses_a_bad_argument(name, value):
    model = build("gpt-tiny", device="meta", **CFG)
    with pytest.raises(shardplan.ConfigurationError) as info:
        shardplan.plan(model, TP, **{**GOOD, name: value})
    msg = str(info.value)
    assert f"{name}={value!r}" in msg and info.value.fix and "where: plan" in msg, msg


@pytest.mark.parametrize("kw", [dict(batch=BATCH), dict(seq=SEQ),
                                dict(batch=BATCH, seq=SEQ, example_inputs=torch.zeros(2, 4))],
                         ids=["batch alone", "seq alone", "batch, seq and example_inputs"])
def test_estimate_refuses_a_shape_given_by_halves_or_twice(kw):
    model = build("gpt-tiny", device="meta", **CFG)
    with pytest.raises(shardplan.ConfigurationError, match="batch=.*seq=") as info:
        shardplan.plan(model, TP, **kw)
    assert "pass both batch and seq" in info.value.fix


def test_estimate_reads_names_and_sizes_at_the_edges():
    """batch 1, sequence 1; a dtype by name and gpu_memory as a size are the estimate of
    the dtype and the bytes they name."""
    model = build("gpt-tiny", device="meta", **CFG)
    named = shardplan.plan(model, TP, batch=1, seq=1, dtype="bfloat16",
                           gpu_memory="80GB").memory.training
    given = shardplan.plan(model, TP, batch=1, seq=1, dtype=torch.bfloat16,
                           gpu_memory=80 * 10**9).memory.training
    assert named == given and named.gpu_memory == 80 * 10**9 and named.dtype == "bfloat16"
    assert 0 < named.activations < shardplan.plan(model, TP, batch=2, seq=1,
                                                  dtype="bfloat16").memory.training.activations


def test_cli_prints_a_bad_size_as_the_error(capsys):
    from shardplan import cli
    assert cli.main(["plan", "gpt-tiny", "--tp", "2", "--batch", "2", "--seq", "8",
                     "--gpu-memory", "80XB"]) == 2
    err = capsys.readouterr().err
    assert "ConfigurationError: gpu_memory='80XB' is not a memory size" in err and "GiB" in err
