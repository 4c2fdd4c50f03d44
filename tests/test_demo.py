"""``shardplan demo``: the whole job as a user runs it, and its loss plot."""

from __future__ import annotations

import io
import json
import os
import re
import struct
import subprocess
import sys

import pytest

import shardplan
from shardplan.models import build
from shardplan.train import demo, plot


def png_size(path: str) -> tuple[int, int]:
    """(width, height) of a PNG file; checks the signature and that the header comes first."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def _figure(ok: bool = True):
    a = [5.5 - 0.03 * i for i in range(100)]
    b = [v + 1e-6 for v in a]
    return plot.loss_figure([plot.Curve("unsharded", b, "tab:orange", 5.0),
                             plot.Curve("tp=2 dp=1", a, "tab:blue", 1.5)],
                            title="shardplan demo: GPT tiny, training loss",
                            verdict=f"max |Δloss| 1.0e-06: {'match' if ok else 'DISAGREE'}")


def test_loss_figure_has_both_curves_and_the_verdict():
    fig = _figure()
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"unsharded", "tp=2 dp=1"}
    assert list(lines["tp=2 dp=1"].get_xdata()) == list(range(1, 101))
    assert lines["tp=2 dp=1"].get_ydata()[0] == 5.5
    assert lines["unsharded"].get_linewidth() > lines["tp=2 dp=1"].get_linewidth()
    # the thin curve is drawn over the thick one
    assert ax.get_lines().index(lines["tp=2 dp=1"]) > ax.get_lines().index(lines["unsharded"])
    assert ax.get_legend().get_title().get_text() == "max |Δloss| 1.0e-06: match"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("step", "loss")
    assert "training loss" in ax.get_title()
    plot.pyplot().close(fig)


def test_save_png_writes_a_png_of_the_plot_size(tmp_path):
    path = str(tmp_path / "loss.png")
    plot.save_png(_figure(ok=False), path)
    assert png_size(path) == plot.SIZE
    assert os.path.getsize(path) > 10_000  # text and lines, not an empty canvas


def test_progress_writes_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    p = demo.Progress(50, "tp=2 dp=1", out)
    for i in range(1, 51):
        p.update(i, 3.0, 1234.0)
    p.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and 5 <= len(lines) <= 12
    assert lines[-1].startswith("tp=2 dp=1 50/50 loss  3.0000")


def test_tolerance_is_tight_first_and_allows_amplified_rounding_later():
    assert demo.within_tolerance(1, 2.5000, 2.5000 + 1e-6)
    assert not demo.within_tolerance(3, 2.5, 2.5 + 1e-3)  # a real bug shows early
    assert demo.within_tolerance(demo.EARLY_STEPS + 1, 2.5, 2.5 + 1e-3)
    assert not demo.within_tolerance(demo.EARLY_STEPS + 1, 2.5, 2.6)
    assert not demo.within_tolerance(50, float("nan"), 2.5)


# The demo's tiny GPT, written out here rather than taken from the demo, and the layouts
# Megatron-LM gives its parameters, by name: a vocab-parallel embedding (tied to the head),
# column-parallel QKV (split per Q/K/V block) and MLP up-projection, row-parallel output
# projections (bias replicated, added after the all-reduce), everything else replicated.
DEMO_GPT = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
MEGATRON = [(r"transformer\.wte\.weight", "S(0)"),
            (r"transformer\.h\.\d+\.attn\.c_attn\.(weight|bias)", "S(0|64+64+64)"),
            (r"transformer\.h\.\d+\.mlp\.c_fc\.(weight|bias)", "S(0)"),
            (r"transformer\.h\.\d+\.(attn|mlp)\.c_proj\.weight", "S(1)"),
            (r".*", "R")]


def assert_megatron_plan(plan, tp: int = 2):
    """``plan`` (as the demo wrote it) against the model built here and Megatron's layouts:
    every parameter, its layout, and the per-rank memory those layouts imply."""
    model = build("gpt-tiny", device="meta", **DEMO_GPT)
    params = dict(model.named_parameters())  # tied weights once
    assert plan.tp == tp and sorted(p.name for p in plan.params) == sorted(params)
    want_bytes = 0
    for p in plan.params:
        layout = next(l for pattern, l in MEGATRON if re.fullmatch(pattern, p.name))
        assert p.layout == layout, (p.name, p.layout, layout)
        assert tuple(p.global_shape) == tuple(params[p.name].shape), p.name
        n = params[p.name].numel() * 4  # float32
        want_bytes += n if layout == "R" else n // tp
    assert plan.memory.param_bytes_per_rank == want_bytes
    assert plan.memory.param_bytes_unsharded == 4 * sum(p.numel() for p in params.values())


def test_megatron_reference_rejects_a_wrong_plan():
    """The reference above can fail: a plan with the MLP's row split put on the columns."""
    plan = shardplan.plan(build("gpt-tiny", **DEMO_GPT), 2)
    assert_megatron_plan(plan)  # the library's own plan of the same model agrees
    wrong = plan.model_copy(deep=True)
    row = next(p for p in wrong.params if p.name.endswith("mlp.c_proj.weight"))
    row.layout = "S(0)"
    with pytest.raises(AssertionError, match="mlp.c_proj.weight"):
        assert_megatron_plan(wrong)


def _run_demo(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    out = str(tmp_path / "demo-out")
    proc = subprocess.run([sys.executable, "-m", "shardplan.cli", "demo", *args, "--out", out],
                          capture_output=True, text=True, timeout=280, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out


@pytest.mark.real
@pytest.mark.timeout(300)
def test_demo_end_to_end(tmp_path):
    proc, out = _run_demo(tmp_path, "--steps", "6", "--size", "tiny")
    assert "parameters per rank" in proc.stdout and "communication per training step" in proc.stdout
    assert "the curves match" in proc.stdout
    for name in ("loss.png", "plan.json", "summary.json", "summary.md"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["match"] is True and summary["steps_out_of_tolerance"] == []
    assert len(summary["losses"]["sharded"]) == len(summary["losses"]["unsharded"]) == 6
    assert summary["max_abs_diff"] < 1e-4
    assert summary["losses"]["sharded"][-1] < summary["losses"]["sharded"][0]  # it learns
    w, h = png_size(os.path.join(out, summary["plot"]["file"]))
    assert (w, h) == (summary["plot"]["width"], summary["plot"]["height"])
    with open(os.path.join(out, "plan.json")) as f:
        plan = shardplan.Plan.from_json(f.read())
    assert_megatron_plan(plan)
    assert summary["plan"]["collectives_per_step"] == len(plan.collectives)
    markdown = open(os.path.join(out, "summary.md")).read()
    assert "match" in markdown
    # the summary ends with lines sampled from the trained sharded model, one per prompt
    assert len(summary["samples"]) == len(demo.SAMPLE_PROMPTS)
    for prompt, line in zip(demo.SAMPLE_PROMPTS, summary["samples"]):
        assert line.startswith(prompt) and len(line) > len(prompt) + 8, line
        assert repr(line) in markdown and repr(line) in proc.stdout


@pytest.mark.real
@pytest.mark.timeout(300)
def test_demo_with_data_parallelism(tmp_path, capsys):
    """dp=2: each replica trains on half the batch, gradients averaged; equal to the
    unsharded run on the whole batch. (tp=1 keeps it to two processes on a 2-core
    machine; tp=2 x dp=2 meshes are tested in test_train.py.) The command's ``main()``
    in this process: the test above runs it as a user does."""
    from shardplan.cli import main
    out = str(tmp_path / "demo-out")
    assert main(["demo", "--steps", "3", "--size", "tiny", "--tp", "1", "--dp", "2",
                 "--out", out]) == 0
    assert "starting 2 gloo processes (tp=1 x dp=2)" in capsys.readouterr().out
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["match"] is True and summary["config"]["dp"] == 2


def test_bad_options_exit_2(capsys):
    from shardplan.cli import main
    assert main(["demo", "--dp", "3"]) == 2  # 16 sequences do not split over 3 replicas
    assert "does not split over dp=3" in capsys.readouterr().err
    assert demo.main(["--dp", "3"]) == 2  # python -m shardplan.train.demo: the same
    assert "does not split over dp=3" in capsys.readouterr().err


@pytest.mark.real
@pytest.mark.timeout(300)
def test_demo_pp2_matches_unsharded(tmp_path, capsys):
    """pp=2 (tp=1: two processes): the pipeline's loss curve equals the unsharded run's,
    the plan shows the two stages, and no samples are drawn (generation does not run
    through a pipeline yet)."""
    from shardplan.cli import main
    out = str(tmp_path / "demo-out")
    assert main(["demo", "--steps", "3", "--size", "tiny", "--tp", "1", "--pp", "2",
                 "--out", out]) == 0
    text = capsys.readouterr().out
    assert "starting 2 gloo processes (pp=2 (1f1b, 2 microbatches) x tp=1 x dp=1)" in text
    assert "pipeline: pp=2, schedule 1f1b" in text and "the curves match" in text
    assert "no samples: generation does not run through a pipeline yet" in text
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["match"] is True and summary["mesh"] == "pp=2 tp=1 dp=1"
    assert summary["processes"] == 2 and summary["samples"] == []
    assert summary["max_abs_diff"] < 1e-4
    assert "| step | pp=2 tp=1 dp=1 |" in open(os.path.join(out, "summary.md")).read()


def test_demo_refuses_pp_with_what_it_does_not_run_yet(capsys):
    from shardplan.cli import main
    assert main(["demo", "--pp", "2", "--dp", "2"]) == 2
    assert "pp=2 with --dp: not supported with pp yet" in capsys.readouterr().err
    assert main(["demo", "--pp", "4", "--size", "tiny"]) == 2  # 4 stages, 2 blocks
    assert "4 stages (pp=4 x 1 per rank)" in capsys.readouterr().err
    assert main(["demo", "--pp", "2", "--microbatches", "3"]) == 2
    assert "microbatches=3 does not divide the batch of 16 rows" in capsys.readouterr().err
