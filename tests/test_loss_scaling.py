"""fp16 with dynamic loss scaling (shardplan.train.optim.TPGradScaler, shardplan.train --fp16).

The scaler's overflow check must agree across ranks: an inf in one rank's gradient
shard makes every rank skip the step. Checked on 2 real gloo ranks, with plain
``torch.amp.GradScaler`` as the control that disagrees; then fp16 training on the
(dp=2, tp=2) mesh of tests/test_train.py against fp32, and its exact resume.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from shardplan.errors import ConfigurationError
from shardplan.train.optim import TPGradScaler
from shardplan.train.trainer import parse_args
from train_cases import (BASE, OVERFLOW_MODES, fp16_resume_rank, overflow_rank,
                         reference_losses, rel_close, trainer_rank)

INIT_SCALE, BACKOFF = 2.0 ** 16, 0.5  # torch.amp.GradScaler's defaults


def test_configuration():
    assert parse_args(["--fp16"]).fp16 and not parse_args([]).fp16
    with pytest.raises(ConfigurationError, match="bf16 and fp16"):
        parse_args(["--fp16", "--bf16"])
    with pytest.raises(ConfigurationError, match="not initialized"):
        TPGradScaler("cpu")  # no process group in the test process: nothing to agree over


@pytest.mark.real
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", OVERFLOW_MODES)
def test_overflow_on_one_rank_skips_everywhere(real_ranks, mode):
    ranks = real_ranks(2)
    agreed = ranks.run(overflow_rank, True, mode)
    for rank, (bad, clean) in enumerate(agreed):
        assert bad["changed"] == [False, False], f"rank {rank} stepped on an overflow"
        assert bad["scale"] == INIT_SCALE * BACKOFF and bad["tracker"] == 0, rank
        assert clean["changed"] == [True, True], f"rank {rank} skipped a clean step"
        assert clean["scale"] == INIT_SCALE * BACKOFF and clean["tracker"] == 1, rank
        if mode == "unscale":
            assert bad["found_inf"] is True and clean["found_inf"] is False
    assert torch.equal(agreed[0][1]["shared"], agreed[1][1]["shared"])  # no drift

    # the control: torch's own scaler sees only its rank's gradients
    (steps, _), (skips, _) = ranks.run(overflow_rank, False, mode)
    assert steps["changed"] == [True, True] and steps["scale"] == INIT_SCALE
    assert skips["changed"] == [False, False] and skips["scale"] == INIT_SCALE * BACKOFF
    assert not torch.equal(steps["shared"], skips["shared"])  # the replicated one drifted


@pytest.mark.real
@pytest.mark.timeout(120)
def test_fp16_training_is_close_to_fp32(real_ranks):
    cfg = dict(BASE, steps=8, fp16=True)
    runs = real_ranks(4).run(trainer_rank, cfg, False)
    history = runs[0]["history"]
    assert all(r["history"] == history for r in runs), "ranks report different steps"
    assert [h["scale"] for h in history] == [INIT_SCALE] * 8  # no overflow at this size
    assert not any(h["skipped"] for h in history)
    want, _ = reference_losses(dict(cfg, fp16=False), dp=2)
    losses = [h["loss"] for h in history]
    assert losses != want  # fp16 really ran
    rel_close(losses, want, 5e-3, "fp16 loss")


@pytest.mark.real
@pytest.mark.timeout(120)
def test_fp16_resume_continues_exactly(real_ranks, tmp_path):
    # growth every step: the scale reaches 2**20, overflows at step 5 and backs off, so
    # the checkpoint at step 6 holds a scale and growth interval that are not the defaults
    cfg = dict(BASE, steps=12, fp16=True, check_replicas_every=6)
    first = dict(cfg, save=str(tmp_path / "ck"), save_every=6)
    second = dict(cfg, resume=str(tmp_path / "ck" / "step-00000006"))
    runs = real_ranks(4).run(fp16_resume_rank, first, second, 1)
    full, resumed, full_state, resumed_state = runs[0]
    assert all(json.dumps(r) == json.dumps(runs[0]) for r in runs)  # nan-safe, exact
    skipped = [h["step"] for h in full if h["skipped"]]
    assert skipped and min(skipped) <= 6 < max(skipped), skipped  # overflow on both sides
    for h in full:  # a skip halves the scale, a clean step doubles it (growth interval 1)
        if h["step"] < 12:
            want = h["scale"] * (BACKOFF if h["skipped"] else 2)
            assert full[h["step"]]["scale"] == want, h
    assert json.dumps(resumed) == json.dumps(full[6:])  # losses, norms, skips and scales
    assert resumed_state == full_state
    import torch.distributed.checkpoint as dcp
    state = {"extra": ""}  # the checkpoint's extra, as its JSON text
    dcp.load(state, checkpoint_id=str(tmp_path / "ck" / "step-00000006"), no_dist=True)
    saved = json.loads(state["extra"])
    assert saved["scaler"]["scale"] == full[6]["scale"] and saved["scaler"]["growth_interval"] == 1


@pytest.mark.real
@pytest.mark.timeout(180)
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="the NCCL path (overflow flag on the GPU) needs 2 CUDA devices")
def test_fp16_torchrun_on_cuda(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "shardplan.train", "--tp", "2", "--steps", "4", "--batch-size", "2",
           "--seq-len", "16", "--warmup", "1", "--fp16", "--log-every", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 4 and all("scale 65536" in s for s in steps), proc.stdout
    assert "nccl on cuda" in proc.stdout and "fp16" in proc.stdout
