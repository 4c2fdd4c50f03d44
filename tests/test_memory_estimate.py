"""The training-memory estimate (``plan(..., batch=, seq=)``) against measurement:
the bundled GPT at tp 2 on simulated ranks, each term within 5% of what a real
step holds (tensor bytes after an AdamW step; activations by
``saved_tensors_hooks``, plain, sequence-parallel and recomputed)."""

from __future__ import annotations

import copy

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
