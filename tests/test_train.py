"""The training recipe (shardplan.train.optim) and entry point (shardplan.train).

Clipping and the schedule are checked against torch and hand computations on
simulated ranks (threads). The training runs use 4 real gloo processes as a
(dp=2, tp=2) mesh on the bundled gpt-tiny with a byte vocabulary, small
batches and short sequences, so the file stays well under two minutes.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardplan import faults
from shardplan.planner.capture import capture
from shardplan.errors import ConfigurationError
from shardplan.models import build
from shardplan.train.optim import (build_optimizer, clip_grad_norm_, cosine_scheduler, grad_norm,
                             lr_schedule)
from shardplan.ranks import SimulatedRanks
from shardplan.layouts import Placement, Shard
from shardplan.train.trainer import (TokenData, TrainConfig, build_model, parallel_dims,
                                     parse_args, resolve_checkpoint, resume_point)
from checks import full_gradient
from train_cases import (BASE, clip_dp_rank, clip_rank, nonfinite_dp_rank, nonfinite_rank,
                         pipeline_rank, reference_losses, reference_training, rel_close,
                         resume_rank, torch_clip, train_rank, trainer_rank)


# -- the schedule -----------------------------------------------------------------------------

def test_schedule_by_hand():
    s = dict(lr=1.0, warmup=10, total=110, min_lr=0.1)
    assert lr_schedule(0, **s) == pytest.approx(0.1)          # warm-up: (step + 1) / warmup
    assert lr_schedule(4, **s) == pytest.approx(0.5)
    assert lr_schedule(9, **s) == pytest.approx(1.0)          # peak at the end of warm-up
    assert lr_schedule(10, **s) == pytest.approx(1.0)         # cosine starts at the peak
    assert lr_schedule(60, **s) == pytest.approx(0.55)        # half-way: (lr + min_lr) / 2
    assert lr_schedule(35, **s) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_schedule(110, **s) == pytest.approx(0.1)        # floor at total, and after
    assert lr_schedule(10_000, **s) == pytest.approx(0.1)
    assert lr_schedule(0, lr=2.0, warmup=0, total=10, min_lr=0.0) == pytest.approx(2.0)
    lrs = [lr_schedule(i, **s) for i in range(120)]
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    with pytest.raises(ConfigurationError):
        lr_schedule(0, lr=1.0, warmup=0, total=10, min_lr=2.0)


def test_lambda_scheduler_follows_schedule():
    w = torch.nn.Parameter(torch.zeros(2, 2))
    b = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [w], "lr": 1e-3}, {"params": [b], "lr": 5e-4}])
    sched = cosine_scheduler(opt, warmup=4, total=20, min_lr=1e-5)
    for step in range(25):
        for group, peak in zip(opt.param_groups, (1e-3, 5e-4)):
            want = lr_schedule(step, lr=peak, warmup=4, total=20, min_lr=1e-5)
            assert group["lr"] == pytest.approx(want, rel=1e-12), (step, peak)
        opt.step()
        sched.step()


# -- the optimizer --------------------------------------------------------------------------

def test_build_optimizer_groups():
    model = build("gpt-tiny")
    opt = build_optimizer(model, 1e-3)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-8 and decay["lr"] == 1e-3
    assert all(p.dim() == 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    assert any(n.endswith("ln_1.weight") for n in no_decay["param_names"])
    assert "transformer.wte.weight" in decay["param_names"]  # embeddings decay, tied once
    assert "lm_head.weight" not in decay["param_names"]
    n = sum(len(g["params"]) for g in opt.param_groups)
    assert n == len(list(model.parameters()))


# -- clipping ---------------------------------------------------------------------------------

def _batch(vocab, b=4, t=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


CLIP_CASES = {
    # gpt: fused QKV blocks, tied vocab-parallel embedding/LM head; vocab 97 is padded at tp 2
    "gpt-tp2": ("gpt-tiny", dict(vocab_size=97), 2, 2.0),
    # llama at tp 4: 2 KV heads held by pairs of ranks (Shard replicas=2) -> counted once
    "llama-tp4": ("llama-tiny", {}, 4, 2.0),
    "llama-tp2-inf": ("llama-tiny", {}, 2, math.inf),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(CLIP_CASES))
def test_clip_matches_torch(case):
    preset, cfg, tp, norm_type = CLIP_CASES[case]
    torch.manual_seed(0)
    model = build(preset, **cfg)
    x, y = _batch(model.config.vocab_size)
    scale, max_norms = 10.0, (0.05, 1e6)  # one that clips, one that does not
    captured = capture(model, (x, y), {})
    per_rank = SimulatedRanks(tp).run(clip_rank, model, captured, x, y, scale, max_norms,
                                      norm_type)
    layouts = per_rank[0][1]
    for i, max_norm in enumerate(max_norms):
        want_norm, ref = torch_clip(model, x, y, scale, max_norm, norm_type)
        results = [r[0][i] for r in per_rank]
        norms = [r[0] for r in results]
        assert all(torch.equal(n, norms[0]) for n in norms), "ranks disagree on the norm"
        torch.testing.assert_close(norms[0], want_norm, rtol=1e-5, atol=0)
        assert (want_norm > max_norm) == (max_norm < 1)  # the first case really clips
        for name, g0 in results[0][1].items():
            want = ref.get_parameter(name).grad
            # replicas (and members of a K/V replica group) stay identical across ranks
            got = full_gradient(layouts[name], [r[1][name] for r in results], want.shape, name)
            atol = 1e-6 * max(want.abs().max().item(), 1e-6)  # fp32 noise of summation order
            torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=f"{max_norm} {name}")


@pytest.mark.timeout(60)
def test_clip_averages_over_dp_first():
    torch.manual_seed(0)
    model = build("gpt-tiny")
    x, y = _batch(96)
    want_norm, ref = torch_clip(model, x, y, 10.0, 0.05)
    results = SimulatedRanks(2).run(clip_dp_rank, model, x, y, 10.0, 0.05)
    for norm, grads in results:
        torch.testing.assert_close(norm, want_norm, rtol=1e-5, atol=0)
        for name, g in grads.items():
            want = ref.get_parameter(name).grad
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_grad_norm_of_a_plain_module_is_torchs():
    torch.manual_seed(0)
    model = build("gpt-tiny")
    x, y = _batch(96)
    model(x, y)[1].backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch.testing.assert_close(grad_norm(model), want, rtol=1e-6, atol=0)
    before = [p.grad.clone() for p in model.parameters()]
    clip_grad_norm_(model, None)  # measures only
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))


# -- data and configuration ----------------------------------------------------------------

def test_data_is_deterministic_and_split_by_replica(tmp_path):
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(256)) * 20)
    for path in (None, str(text)):
        two = TokenData(path, seq_len=8, batch_size=2, dp=2, seed=1)
        one = TokenData(path, seq_len=8, batch_size=4, dp=1, seed=1)
        for step in (0, 7):
            x, y = one.global_batch(step)
            parts = [two.batch(step, d) for d in range(2)]
            assert torch.equal(torch.cat([p[0] for p in parts]), x)
            assert torch.equal(torch.cat([p[1] for p in parts]), y)
            assert torch.equal(x[:, 1:], y[:, :-1])
            assert x.dtype == torch.int64 and 0 <= x.min() and x.max() < 256
        assert not torch.equal(one.global_batch(0)[0], one.global_batch(1)[0])
    x, _ = TokenData(str(text), seq_len=8, batch_size=4, dp=1, seed=1).global_batch(0)
    assert all(((row[1:] - row[:-1]) % 256 == 1).all() for row in x)  # windows of the file
    with pytest.raises(ConfigurationError, match="fewer than"):
        TokenData(str(text), seq_len=6000, batch_size=1, dp=1, seed=0)


def test_parse_args():
    c = parse_args(["--tp", "2", "--dp", "2", "--model", "llama-tiny", "--steps", "7",
                    "--batch-size", "3", "--seq-len", "24", "--lr", "1e-3", "--warmup", "2",
                    "--min-lr", "1e-4", "--clip", "0.5", "--weight-decay", "0.1", "--seed", "9",
                    "--data", "x.txt", "--save", "ck", "--save-every", "5", "--resume", "old",
                    "--check-replicas-every", "3", "--bf16", "--log-every", "1",
                    "--recompute"])
    assert c == TrainConfig(model="llama-tiny", tp=2, dp=2, steps=7, batch_size=3, seq_len=24,
                            lr=1e-3, warmup=2, min_lr=1e-4, clip=0.5, weight_decay=0.1, seed=9,
                            data="x.txt", save="ck", save_every=5, resume="old",
                            check_replicas_every=3, bf16=True, log_every=1, recompute=True)
    assert parse_args([]).floor_lr == pytest.approx(TrainConfig().lr / 10)
    with pytest.raises(ConfigurationError):
        parse_args(["--steps", "0"])
    with pytest.raises(ConfigurationError):
        parse_args(["--min-lr", "1", "--lr", "0.1"])


@pytest.mark.parametrize("argv,sizes,fsdp", [
    (["--tp", "2", "--dp", "2"], {"tp": 2, "dp_replicate": 2, "dp_shard": None}, False),
    (["--tp", "2", "--dp", "2", "--fsdp"], {"tp": 2, "dp_replicate": None, "dp_shard": 2}, True),
    (["--tp", "2", "--fsdp"], {"tp": 2, "dp_replicate": 1, "dp_shard": None}, True),
    (["--dp-replicate", "2", "--dp-shard", "2"],
     {"tp": None, "dp_replicate": 2, "dp_shard": 2}, True),          # dp_shard > 1: FSDP2
    (["--dp-replicate", "2"], {"tp": None, "dp_replicate": 2, "dp_shard": None}, False),
])
def test_data_parallel_flags(argv, sizes, fsdp):
    """--dp is --dp-shard with --fsdp, else --dp-replicate; --fsdp alone shards the ranks
    tp leaves; --dp-shard > 1 is FSDP2."""
    c = parse_args(argv)
    assert c.parallel_sizes() == sizes and c.fsdp is fsdp


def test_data_parallel_flags_refused_and_documented(capsys):
    with pytest.raises(ConfigurationError, match="dp=2 with dp_replicate=None, dp_shard=2"):
        parse_args(["--dp", "2", "--dp-shard", "2"])
    with pytest.raises(ConfigurationError, match="dp_replicate=0 must be >= 1"):
        parse_args(["--dp-replicate", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--dp-shard with --fsdp, else --dp-replicate" in text
    assert "> 1 turns --fsdp on" in text


def test_on_nonfinite_option():
    assert parse_args([]).on_nonfinite == "stop"
    assert parse_args(["--on-nonfinite", "skip"]).on_nonfinite == "skip"
    with pytest.raises(SystemExit):
        parse_args(["--on-nonfinite", "ignore"])
    with pytest.raises(ConfigurationError, match="on_nonfinite='ignore'"):
        TrainConfig(on_nonfinite="ignore")


@pytest.mark.timeout(60)
def test_nonfinite_loss_on_one_replica_skips_every_replica():
    """Two simulated replicas, rank 1's loss NaN (its gradients finite): agreed, both skip
    and neither changes; the control without agreement lets rank 0 step alone."""
    torch.manual_seed(0)
    model = build("gpt-tiny")
    x, y = _batch(96)
    agreed = SimulatedRanks(2).run(nonfinite_dp_rank, model, x, y, True)
    assert agreed == [(True, {"loss": [1]}, False)] * 2
    alone = SimulatedRanks(2).run(nonfinite_dp_rank, model, x, y, False)
    assert [(skipped, changed) for skipped, _, changed in alone] == [(False, True), (True, False)]


@pytest.mark.real
@pytest.mark.timeout(180)
def test_nonfinite_skip_and_stop_agree_on_every_rank(real_ranks):
    """dp 2 x tp 2. skip: a NaN in rank 1's gradient of a replicated parameter at step 2
    (averaged into rank 3's; no rank's global norm sees it) skips step 2 on every rank, no
    parameter changes, training goes on, the counter says 1, the replicas stay equal.
    stop: rank 1's loss NaN at step 2 raises on every rank, naming the step and the rank."""
    runs = real_ranks(4).run(nonfinite_rank, dict(BASE, steps=3))
    for r in runs:
        assert r["changed"] == [True, False, True]
        assert [h["skipped"] for h in r["history"]] == [False, True, False]
        assert [h["skipped_steps"] for h in r["history"]] == [0, 1, 1]
        assert all(math.isfinite(h["grad_norm"]) for h in r["history"])  # only the local check
        assert r["history"] == runs[0]["history"]
        step, message = r["stopped"]
        assert step == 1 and "step 2: non-finite loss on rank 1\n" in message, message
    for r in runs:  # every replica holds what its peers hold (check_replicas passed too)
        peer = runs[r["tp_rank"]]
        assert r["fingerprints"] == peer["fingerprints"]


def test_resolve_checkpoint(tmp_path):
    for step in (5, 20, 100):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / "index.json").write_text("{}")
    (tmp_path / ".step-00000200.partial").mkdir()
    assert resolve_checkpoint(tmp_path).name == "step-00000100"
    assert resolve_checkpoint(tmp_path / "step-00000020").name == "step-00000020"
    with pytest.raises(ConfigurationError, match="no checkpoint"):
        resolve_checkpoint(tmp_path / "nothing")


def test_resume_point(tmp_path, monkeypatch):
    """--resume auto, and a torchrun restart with --save: the newest complete checkpoint of
    the save directory (none yet: a fresh start); a first attempt resumes only if told."""
    save = tmp_path / "ck"
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert resume_point(TrainConfig(save=str(save), resume="auto")) is None
    for name in ("step-00000002", "step-00000004", ".step-00000006.partial"):
        (save / name).mkdir(parents=True)
        (save / name / ".metadata").write_bytes(b"")  # the partial one is not committed
    assert resume_point(TrainConfig(save=str(save), resume="auto")).name == "step-00000004"
    assert resume_point(TrainConfig(save=str(save))) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume_point(TrainConfig(save=str(save))).name == "step-00000004"
    assert resume_point(TrainConfig(save=str(save), resume=str(save / "step-00000002"))) \
        .name == "step-00000002"
    assert resume_point(TrainConfig()) is None  # nothing saved, nothing to resume
    with pytest.raises(ConfigurationError, match="--resume auto"):
        TrainConfig(resume="auto")


def test_fault_injection_spec(monkeypatch):
    """A fault for another rank, point or later arrival does nothing; a malformed one is a
    ConfigurationError naming the variable and the entry."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv(faults.VARIABLE, "kill step=1 rank=1; hang save=1 attempt=3; kill step=99")
    faults.inject("step")  # this process is rank 0 of attempt 0, at step 1 of 99: alive
    monkeypatch.setenv(faults.VARIABLE, "kill step=1 rank=1; explode step=2")
    with pytest.raises(ConfigurationError, match="SHARDPLAN_FAULT_INJECTION.*'explode step=2'"):
        faults.inject("step")


# -- training on 4 gloo processes (dp 2 x tp 2) ------------------------------------------------

@pytest.fixture(scope="module")
def tp_dp_run(real_ranks):
    """20 steps on dp 2 x tp 2 (replicas checked every 5), then one replicated parameter
    nudged on rank 1 and the replica check run again; every rank's report."""
    cfg = dict(BASE, steps=20)
    return cfg, real_ranks(4).run(trainer_rank, cfg, True)


@pytest.mark.real
@pytest.mark.timeout(120)
def test_tp_dp_training_equals_unsharded(tp_dp_run):
    cfg, runs = tp_dp_run
    assert [(r["dp_rank"], r["tp_rank"]) for r in runs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["history"] == runs[0]["history"] for r in runs), "ranks report different losses"
    want, want_norms = reference_losses(cfg, dp=2)
    losses = [h["loss"] for h in runs[0]["history"]]
    assert losses[-1] < losses[0]  # it learns
    rel_close(losses, want, 1e-5, "loss")
    rel_close([h["grad_norm"] for h in runs[0]["history"]], want_norms, 1e-4, "grad norm")
    lrs = [lr_schedule(i, lr=cfg["lr"], warmup=cfg["warmup"], total=cfg["steps"],
                       min_lr=cfg["min_lr"]) for i in range(cfg["steps"])]
    assert [h["lr"] for h in runs[0]["history"]] == lrs


@pytest.mark.real
@pytest.mark.timeout(120)
def test_replicas_stay_identical(tp_dp_run):
    _, runs = tp_dp_run
    by_tp = {}
    for r in runs:
        by_tp.setdefault(r["tp_rank"], []).append(r["fingerprints"])
        for name in r["replicated"]:  # the same on all four ranks, not just close
            if name in r["fingerprints"]:
                assert r["fingerprints"][name] == runs[0]["fingerprints"][name], name
    for prints in by_tp.values():  # data-parallel replicas hold identical shards
        assert prints[0] == prints[1]
    # the check is live: one nudged replica on rank 1 is caught on every rank
    assert all(r["caught"] and "drifted" in r["caught"] for r in runs), [r["caught"] for r in runs]


@pytest.mark.real
@pytest.mark.timeout(120)
def test_resume_continues_exactly(real_ranks, tmp_path):
    # dropout on: the resumed run must also restore both RNG streams of every rank
    cfg = dict(BASE, steps=50, dropout=0.1, check_replicas_every=25)
    first = dict(cfg, save=str(tmp_path / "ck"), save_every=25)
    second = dict(cfg, resume=str(tmp_path / "ck" / "step-00000025"))
    runs = real_ranks(4).run(resume_rank, first, second)
    full, resumed = runs[0]
    assert len(full) == 50 and len(resumed) == 25
    assert resumed == full[25:], (resumed[:3], full[25:28])
    assert all(r == runs[0] for r in runs)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000025",
                                                                   "step-00000050"]


@pytest.mark.real
@pytest.mark.timeout(120)
def test_async_save_resumes_exactly(real_ranks, tmp_path):
    """``--async-save`` every 2 steps (each written while the next steps run): resumed
    from step 2, the losses are the uninterrupted run's bit for bit; every checkpoint is
    complete and no staging directory is left."""
    cfg = dict(BASE, steps=6, dropout=0.1)
    first = dict(cfg, save=str(tmp_path / "ck"), save_every=2, async_save=True)
    second = dict(cfg, resume=str(tmp_path / "ck" / "step-00000002"))
    runs = real_ranks(4).run(resume_rank, first, second)
    full, resumed = runs[0]
    assert len(full) == 6 and resumed == full[2:], (resumed, full[2:])
    assert all(r == runs[0] for r in runs)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "step-00000002", "step-00000004", "step-00000006"]
    assert all((p / ".metadata").is_file() for p in (tmp_path / "ck").iterdir())


@pytest.mark.real
@pytest.mark.timeout(120)
def test_bf16_autocast_is_close_to_fp32(real_ranks):
    cfg = dict(BASE, steps=8, bf16=True)
    runs = real_ranks(4).run(train_rank, cfg)
    want, _ = reference_losses(dict(cfg, bf16=False), dp=2)
    assert all(math.isfinite(x) for x in runs[0])
    assert runs[0] != want  # bf16 really ran
    rel_close(runs[0], want, 2e-2, "bf16 loss")


@pytest.mark.real
@pytest.mark.timeout(120)
def test_recomputation_with_dropout_trains_identically(real_ranks):
    """dp 2 x tp 2, dropout 0.1: the same losses with and without recomputed blocks."""
    cfg = dict(BASE, steps=4, dropout=0.1)
    stored = real_ranks(4).run(train_rank, cfg)
    recomputed = real_ranks(4).run(train_rank, dict(cfg, recompute=True))
    assert stored == recomputed
    dropout_free = real_ranks(4).run(train_rank, dict(cfg, dropout=0.0))
    assert stored != dropout_free  # dropout really drew masks


@pytest.mark.real
@pytest.mark.timeout(120)
def test_factory_model_llama_tp4(real_ranks):
    # package.module:factory, and Llama at tp 4: its 2 KV heads are held by pairs of ranks
    cfg = dict(BASE, model="train_cases:tiny_llama", tp=4, dp=1, steps=4, dropout=None)
    runs = real_ranks(4).run(train_rank, cfg)
    want, _ = reference_losses(cfg, dp=1)
    rel_close(runs[0], want, 1e-5, "llama tp4 loss")


# The real entry point under torchrun (the default group from its environment, a data file,
# checkpoints, logging on rank 0 only, a clean exit): the uninterrupted run of
# test_cli_e2e.py's test_torchrun_resume_continues_the_uninterrupted_run, one launch for both.


# -- pipeline parallelism (--pp) ---------------------------------------------------------------

@pytest.mark.parametrize("argv,flags", [
    (["--pp", "2", "--dp", "2"], ["--dp"]),
    (["--pp", "2", "--dp-replicate", "2"], ["--dp-replicate"]),
    (["--pp", "2", "--dp-shard", "2"], ["--dp-shard", "--fsdp"]),
    (["--pp", "2", "--fsdp"], ["--fsdp"]),
    (["--pp", "2", "--sequence-parallel"], ["--sequence-parallel"]),
    (["--pp", "2", "--save", "ck"], ["--save"]),
    (["--pp", "2", "--resume", "ck"], ["--resume"]),
    (["--pp", "2", "--fp16"], ["--fp16"]),
    (["--pp", "2", "--bf16", "--recompute", "--compile"], ["--bf16", "--recompute", "--compile"]),
])
def test_pp_refuses_the_options_it_does_not_run_yet(argv, flags):
    with pytest.raises(ConfigurationError) as e:
        parse_args(argv)
    text = str(e.value)
    assert f"pp=2 with {', '.join(flags)}: not supported with pp yet" in text, text


def test_pp_refuses_data_parallel_ranks_left_by_the_world():
    """pp 2 x tp 1 on 4 ranks would leave 2 replicas: refused; tp left out takes the rest."""
    with pytest.raises(ConfigurationError, match="leaves 2 data-parallel ranks: data "
                                                 "parallelism is not supported with pp yet"):
        parallel_dims(parse_args(["--pp", "2", "--tp", "1"]), 4)
    dims = parallel_dims(parse_args(["--pp", "2"]), 4)
    assert (dims.pp, dims.tp, dims.dp) == (2, 2, 1)


@pytest.mark.parametrize("argv,words", [
    (["--pp", "2", "--batch-size", "6", "--microbatches", "4"],
     ["microbatches=4 does not divide the batch of 6 rows"]),
    (["--pp", "4", "--batch-size", "6"], ["microbatches=4 does not divide the batch of 6 rows"]),
    (["--pp", "2", "--microbatches", "1"], ["'1f1b' needs at least pp=2 microbatches"]),
    (["--pp", "2", "--microbatches", "0"], ["microbatches=0 must be a positive int"]),
    (["--pp", "2", "--schedule", "gpipe", "--virtual-stages", "2"],
     ["virtual_stages=2 with schedule='gpipe'", "interleaved"]),
    (["--microbatches", "2"], ["--microbatches without --pp"]),
    (["--schedule", "gpipe", "--virtual-stages", "2"],
     ["--schedule, --virtual-stages without --pp"]),
    (["--pp", "0"], ["pp=0 must be >= 1"]),
])
def test_pp_arguments_are_checked(argv, words):
    with pytest.raises(ConfigurationError) as e:
        parse_args(argv)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_pp_defaults_and_schedules():
    c = parse_args(["--pp", "2"])
    assert (c.schedule, c.microbatches, c.virtual_stages) == ("1f1b", 2, None)
    c = parse_args(["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                    "--microbatches", "4"])
    assert (c.pp, c.schedule, c.microbatches, c.virtual_stages) == (2, "interleaved", 4, 2)
    assert parse_args(["--pp", "2", "--schedule", "gpipe", "--microbatches", "1"]).pp == 2
    with pytest.raises(SystemExit):  # argparse lists the schedules
        parse_args(["--pp", "2", "--schedule", "zigzag"])
    with pytest.raises(ConfigurationError, match="unknown schedule 'zigzag'"):
        TrainConfig(pp=2, schedule="zigzag")


#: 3 steps of 4 sequences, clipped at a norm the gradients are far above
PP_BASE = dict(BASE, dp=None, batch_size=4, steps=3, clip=0.05, check_replicas_every=0)
#: case -> (world size, the pipeline's options)
PP_RUNS = {"pp2": (2, dict(pp=2, tp=1, schedule="1f1b", microbatches=2)),
           "pp2-tp2": (4, dict(pp=2, tp=2, schedule="1f1b", microbatches=2))}


def _slice(full: torch.Tensor, layout: str, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` held as ``layout`` over ``tp`` ranks."""
    lay = Placement.parse(layout)
    return lay.slice(full, rank, tp) if isinstance(lay, Shard) else full


@pytest.mark.real
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(PP_RUNS))
def test_pp_training_equals_unsharded(real_ranks, case):
    """pp 2 (2 ranks) and pp 2 x tp 2 (4 ranks): on every rank the losses and clipped
    gradient norms of each step are the unsharded model's on the global batch (torch's
    clip_grad_norm_, biting at every step), and after the last step each parameter the
    rank holds is its slice of the unsharded one; each rank holds its stage only."""
    world, sizes = PP_RUNS[case]
    cfg = dict(PP_BASE, **sizes)
    pp, tp = sizes["pp"], sizes["tp"]
    want, want_norms, state = reference_training(cfg, dp=1)
    assert all(n > 10 * cfg["clip"] for n in want_norms), want_norms  # the clip bites
    model = build_model(TrainConfig(**cfg))
    total = sum(p.numel() for p in model.parameters())
    runs = real_ranks(world).run(pipeline_rank, cfg)
    held = set()
    for rank, r in enumerate(runs):
        assert (r["pp_rank"], r["tp_rank"]) == divmod(rank, tp) and r["stages"] == [r["pp_rank"]]
        assert r["history"] == runs[0]["history"], f"rank {rank} reports other losses"
        rel_close([h["loss"] for h in r["history"]], want, 1e-5, f"rank {rank} loss")
        rel_close([h["grad_norm"] for h in r["history"]], want_norms, 1e-4,
                  f"rank {rank} grad norm")
        params = r["params"]
        for n, t in params.items():
            torch.testing.assert_close(t, _slice(state[n], r["layouts"][n], r["tp_rank"], tp),
                                       rtol=0, atol=1e-4, msg=f"rank {rank} {n}")
        mine = sum(t.numel() for t in params.values())
        assert mine < 1.4 * total / (pp * tp), f"rank {rank} holds {mine} of {total}"
        assert {n for n in params if n.startswith("transformer.h.")} == \
            {n for n in state if n.startswith(f"transformer.h.{r['pp_rank']}.")}, rank
        if tp > 1:
            assert any(lay != "R" for lay in r["layouts"].values()), f"rank {rank} unsplit"
        held |= set(params)
    assert held == {n for n, _ in model.named_parameters(remove_duplicate=False)}
