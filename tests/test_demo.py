"""``shardplan demo``: the whole job as a user runs it, and its hand-written PNG."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib

import pytest

import shardplan
from shardplan.train import demo


def read_png(path: str) -> tuple[int, int, bytes]:
    """(width, height, RGB bytes) of an 8-bit RGB PNG; checks signature, CRCs, filters."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.append((kind, body))
        pos += 12 + n
    assert [k for k, _ in chunks][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, color, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    stride = 3 * width
    assert len(raw) == height * (stride + 1)
    rows = [raw[y * (stride + 1):(y + 1) * (stride + 1)] for y in range(height)]
    assert all(r[0] == 0 for r in rows)  # filter type None on every row
    return width, height, b"".join(r[1:] for r in rows)


def test_png_writer_round_trip(tmp_path):
    w, h = 7, 5
    px = bytes(v for y in range(h) for x in range(w) for v in (x * 30, y * 50, 255 - x - y))
    path = str(tmp_path / "t.png")
    demo.write_png(path, w, h, px)
    assert read_png(path) == (w, h, px)
    with pytest.raises(ValueError):
        demo.write_png(path, w, h, px[:-1])


def test_plot_draws_axes_text_and_both_curves(tmp_path):
    path = str(tmp_path / "plot.png")
    a = [5.5 - 0.03 * i for i in range(100)]
    demo.plot_curves(path, [("unsharded", a, (240, 150, 40), 5), ("tp=2", a, (30, 70, 200), 1)],
                     title="title", note="max |Δloss| 0.0e+00", xlabel="step", ylabel="loss",
                     size=(400, 300))
    w, h, px = read_png(path)
    assert (w, h) == (400, 300)
    colors = {px[i:i + 3] for i in range(0, len(px), 3)}
    assert bytes((240, 150, 40)) in colors and bytes((30, 70, 200)) in colors
    assert bytes((30, 30, 30)) in colors  # axes, ticks and labels
    # the thin curve is drawn over the thick one, which shows on both sides of it
    assert sum(px[i:i + 3] == bytes((240, 150, 40)) for i in range(0, len(px), 3)) > 200


def test_nice_ticks_cover_the_range():
    for lo, hi in [(2.31, 5.57), (0, 150), (1.0, 1.0), (1e-7, 3e-6)]:
        t = demo.nice_ticks(lo, hi)
        assert t[0] <= lo and t[-1] >= hi and 2 <= len(t) <= 12


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
    w, h, _ = read_png(os.path.join(out, summary["plot"]["file"]))
    assert (w, h) == (summary["plot"]["width"], summary["plot"]["height"])
    with open(os.path.join(out, "plan.json")) as f:
        plan = shardplan.Plan.from_json(f.read())
    assert plan.tp == 2 and plan.memory.param_bytes_per_rank < plan.memory.param_bytes_unsharded
    assert summary["plan"]["collectives_per_step"] == len(plan.collectives)
    assert "match" in open(os.path.join(out, "summary.md")).read()


@pytest.mark.real
@pytest.mark.timeout(300)
def test_demo_with_data_parallelism(tmp_path):
    """dp=2: each replica trains on half the batch, gradients averaged; equal to the
    unsharded run on the whole batch. (tp=1 keeps it to two processes on a 2-core
    machine; tp=2 x dp=2 meshes are tested in test_train.py.)"""
    proc, out = _run_demo(tmp_path, "--steps", "3", "--size", "tiny", "--tp", "1", "--dp", "2")
    assert "starting 2 gloo processes (tp=1 x dp=2)" in proc.stdout
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["match"] is True and summary["config"]["dp"] == 2


def test_bad_options_exit_2(capsys):
    from shardplan.cli import main
    assert main(["demo", "--dp", "3"]) == 2  # 16 sequences do not split over 3 replicas
    assert "does not split over dp=3" in capsys.readouterr().err
