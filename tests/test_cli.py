"""The ``shardplan`` command end to end: ``main()`` in this process (a torch import per
command would cost seconds of CPU each), and as a user runs it in a subprocess where the
process itself is the point (exit status and stderr of ``python -m shardplan.cli``; the
installed console script is in test_cli_e2e.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import shardplan
from shardplan.cli import main

USER_MODULE = textwrap.dedent("""
    import sys
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 32)
            self.up = nn.Linear(32, 128)
            self.down = nn.Linear(128, 32)

        def forward(self, idx):
            x = self.emb(idx)
            return x + self.down(torch.relu(self.up(x)))

    def factory():
        print("factory device:", torch.empty(1).device, file=sys.stderr)
        return Tiny()

    def broken():
        raise ValueError("boom: no such checkpoint")

    def not_a_module():
        return 42
""")


def _env(pythonpath: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    return env


def run_cli(*argv: str, pythonpath: str | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "shardplan.cli", *argv], capture_output=True,
                          text=True, env=_env(pythonpath), timeout=timeout)


@pytest.fixture
def cli(capsys, monkeypatch):
    """``cli(*argv, pythonpath=None)``: ``main(argv)`` in this process, as
    (exit status, stdout, stderr); ``pythonpath`` is on sys.path for the call only."""
    def call(*argv: str, pythonpath: str | None = None):
        with monkeypatch.context() as m:
            if pythonpath:
                m.syspath_prepend(pythonpath)
                m.delitem(sys.modules, "user_models", raising=False)
            code = main(list(argv))
            sys.modules.pop("user_models", None)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, out.out, out.err)
    return call


@pytest.fixture
def user_module(tmp_path):
    (tmp_path / "user_models.py").write_text(USER_MODULE)
    return str(tmp_path)


def test_plan_preset_prints_report_and_writes_json(tmp_path, cli):
    out = tmp_path / "plan.json"
    r = cli("plan", "gpt-tiny", "--tp", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "shardplan plan: GPT at tp=2" in r.stdout
    assert "parameters per rank:" in r.stdout and "unsharded" in r.stdout
    assert "transformer.h.0-1 (2 identical blocks)" in r.stdout
    assert "all_reduce" in r.stdout
    p = shardplan.Plan.from_json(out.read_text())
    assert p.tp == 2 and p.model == "GPT"
    assert p.memory.param_bytes_per_rank < p.memory.param_bytes_unsharded


def test_plan_70b_on_meta(cli):
    r = cli("plan", "llama-70b", "--tp", "8")
    assert r.returncode == 0, r.stderr
    assert "Llama at tp=8" in r.stdout
    assert "of 262.83 GiB unsharded" in r.stdout
    assert "layers.0-79 (80 identical blocks)" in r.stdout


def test_plan_import_string_builds_on_meta(user_module, cli):
    r = cli("plan", "user_models:factory", "--tp", "4", pythonpath=user_module)
    assert r.returncode == 0, r.stderr
    assert "factory device: meta" in r.stderr
    assert "Tiny at tp=4" in r.stdout
    assert "up.weight" in r.stdout and "down.weight" in r.stdout


BAD_TARGETS = {
    "gpt-nonexistent": "unknown target 'gpt-nonexistent': not a bundled preset",
    "no_such_module:f": "cannot import 'no_such_module'",
    "user_models:missing": "'user_models' has no attribute 'missing'",
    "user_models:broken": "user_models:broken() raised ValueError: boom: no such checkpoint",
    "user_models:not_a_module": "returned int, not a torch.nn.Module",
    "missing/config.json": "cannot read a Hugging Face config from missing/config.json",
}


def _check_bad_target(target: str, code: int, stderr: str):
    assert code == 2, (target, stderr)
    assert BAD_TARGETS[target] in stderr, (target, stderr)
    assert "Traceback" not in stderr, (target, stderr)
    errors = [line for line in stderr.splitlines() if line.startswith("shardplan: error:")]
    assert len(errors) == 1, (target, stderr)


@pytest.mark.parametrize("target", ["gpt-nonexistent", "user_models:broken"])
def test_bad_target_exits_2_with_one_clear_line(user_module, target):
    r = run_cli("plan", target, "--tp", "2", pythonpath=user_module)
    _check_bad_target(target, r.returncode, r.stderr)


def test_bad_targets_in_process(user_module, monkeypatch, capsys):
    # The same main() as above, without paying a torch import per case.
    monkeypatch.syspath_prepend(user_module)  # sys.path is restored afterwards
    monkeypatch.delitem(sys.modules, "user_models", raising=False)
    for target in BAD_TARGETS:
        code = main(["plan", target, "--tp", "2"])
        _check_bad_target(target, code, capsys.readouterr().err)
    sys.modules.pop("user_models", None)


def test_shardplan_error_exits_2_with_where_and_fix():
    r = run_cli("plan", "gpt-small", "--tp", "8", "--strict")  # 12 heads do not divide by 8
    assert r.returncode == 2
    assert r.stderr.startswith("shardplan: DivisibilityError:")
    assert "transformer.h.0.attn" in r.stderr
    assert "fix: choose a tp dividing 12: 2, 3, 4, 6, 12 (tp=8 does not)" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_tp_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "gpt-tiny", "--tp", "0"])
    assert e.value.code == 2 and "tp must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for command in ("plan", "verify", "diff", "demo", "bench"):
        assert command in out


def test_verify_preset_ok(cli):
    r = cli("verify", "gpt-tiny", "--tp", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("OK")


def test_plan_html_and_diff(tmp_path, cli):
    """plan --json/--html at two tp values, then diff: the changed layouts and memory."""
    a, b, page = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "a.html"
    assert cli("plan", "llama-tiny", "--tp", "2", "--json", str(a), "--html",
               str(page)).returncode == 0
    assert cli("plan", "llama-tiny", "--tp", "1", "--json", str(b)).returncode == 0
    html = page.read_text()
    assert html.lstrip().lower().startswith("<!doctype html>") and "Llama" in html
    assert "<script src" not in html and "https://" not in html  # self-contained
    r = cli("diff", str(a), str(b))
    assert r.returncode == 0, r.stderr
    assert "tp: 2 -> 1" in r.stdout and "parameters per rank" in r.stdout
    assert "attention.wq.weight" in r.stdout
    bad = cli("diff", str(a), str(tmp_path / "missing.json"))
    assert bad.returncode == 2 and "cannot read plan" in bad.stderr


def test_bench_lists_the_benchmarks(capfd):
    assert main(["bench", "--list"]) == 0  # runs python -m benchmarks: its output is on fd 1
    out = capfd.readouterr().out
    for name in ("step_time", "comm_volume", "memory", "plan_scale"):
        assert name in out


def test_plan_hugging_face_config_json(tmp_path, cli):
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, vocab_size=100,
                                      architectures=["LlamaForCausalLM"])
    path = tmp_path / "config.json"
    config.to_json_file(path)
    r = cli("plan", str(path), "--tp", "2")
    assert r.returncode == 0, r.stderr
    assert "LlamaForCausalLM at tp=2" in r.stdout
    assert "model.layers.0-2 (3 identical blocks)" in r.stdout
