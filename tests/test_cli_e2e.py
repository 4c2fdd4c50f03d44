"""The ``shardplan`` commands end to end, in subprocesses with a timeout: verify's exit
status on a wrong rule set, plan --strict on an op with no rule, the installed console
script, ``torchrun -m shardplan.train --resume``, and ``torchrun -m shardplan.cli
generate`` on a Hugging Face folder. Their controls (the right rule set, plan without
--strict) call the same ``main()`` in this process: a torch import costs seconds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

RULES = Path(__file__).resolve().parent.parent / "shardplan" / "rules" / "megatron.toml"

# Embedding -> column-parallel up -> an op on the split hidden dim -> row-parallel down.
MODELS = textwrap.dedent("""
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self, op):
            super().__init__()
            self.op = op
            self.emb = nn.Embedding(64, 32)
            self.up = nn.Linear(32, 128)
            self.down = nn.Linear(128, 32)

        def forward(self, idx):
            h = self.up(self.emb(idx))
            if self.op == "softmax":
                h = h.softmax(-1)       # a reduction across the split hidden dim
            else:
                h = h.sort(-1).values   # the megatron rules have no rule for sort
            return self.down(h)

    def softmax_mlp():
        torch.manual_seed(0)
        return Tiny("softmax")

    def sort_mlp():
        torch.manual_seed(0)
        return Tiny("sort")
""")


def _env(pythonpath: str | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    return env


def shardplan_cmd() -> list[str]:
    """The installed console script (beside sys.executable, as ``pip install -e .`` puts it).
    CI must have it; locally, without it, ``python -m shardplan.cli`` with a note."""
    script = Path(sys.executable).with_name("shardplan")
    if script.is_file():
        return [str(script)]
    if os.environ.get("CI"):
        pytest.fail(f"the shardplan console script is not installed at {script} "
                    "(CI installs with pip install -e '.[test,hf,demo,libs]')")
    print(f"note: no console script at {script}; using {sys.executable} -m shardplan.cli")
    return [sys.executable, "-m", "shardplan.cli"]


def run(*argv: str, pythonpath: str | None = None, timeout: float = 120, cwd=None):
    return subprocess.run([*shardplan_cmd(), *argv], capture_output=True, text=True,
                          env=_env(pythonpath), timeout=timeout, cwd=cwd)


@pytest.fixture
def user_models(tmp_path):
    (tmp_path / "e2e_models.py").write_text(MODELS)
    return str(tmp_path)


@pytest.fixture
def wrong_rules(tmp_path):
    """The megatron rules with softmax wrongly called elementwise (as in
    test_planner_rules.py): the softmax then normalises each rank's half of the hidden
    dim on its own, a silently wrong model."""
    text = RULES.read_text()
    right = '"aten.softmax.int" = { dim = "1" }\n'
    assert right in text and "elementwise = [\n" in text  # the edit below really applies
    text = text.replace(right, "").replace("elementwise = [\n",
                                           'elementwise = [\n  "aten.softmax.int",\n')
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    return str(bad)


def test_verify_exits_1_on_a_mismatch_and_0_when_right(user_models, wrong_rules, monkeypatch,
                                                        capsys):
    wrong = run("verify", "e2e_models:softmax_mlp", "--tp", "2", "--rules", wrong_rules,
                pythonpath=user_models)
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert wrong.stdout.startswith("MISMATCH"), wrong.stdout
    assert "first divergent node: softmax" in wrong.stdout
    # the same model and command with the bundled rules: sharded == unsharded (main() in
    # this process: a second torch import would show nothing more)
    from shardplan.cli import main
    monkeypatch.syspath_prepend(user_models)
    monkeypatch.delitem(sys.modules, "e2e_models", raising=False)
    capsys.readouterr()  # what this test printed so far (shardplan_cmd's note)
    code = main(["verify", "e2e_models:softmax_mlp", "--tp", "2"])
    sys.modules.pop("e2e_models", None)
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("OK"), out


def test_plan_strict_fails_on_an_op_with_no_rule(user_models, monkeypatch):
    strict = run("plan", "e2e_models:sort_mlp", "--tp", "2", "--strict", pythonpath=user_models)
    assert strict.returncode == 2, strict.stdout + strict.stderr
    err = strict.stderr
    assert "LayoutError" in err and "no rule for aten.sort" in err and "on a sharded input" in err
    assert "fix:" in err and strict.stdout == ""
    # without --strict the same model plans (the sort's region stays replicated), and
    # --strict is no failure on a model the rules cover: main() in this process (the
    # process's exit status is shown above)
    from shardplan.cli import main
    monkeypatch.syspath_prepend(user_models)
    monkeypatch.delitem(sys.modules, "e2e_models", raising=False)
    assert main(["plan", "e2e_models:sort_mlp", "--tp", "2"]) == 0
    assert main(["plan", "gpt-tiny", "--tp", "2", "--strict"]) == 0
    sys.modules.pop("e2e_models", None)


def test_console_script_prints_the_plan():
    r = run("plan", "gpt-tiny", "--tp", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("shardplan plan: GPT at tp=2"), r.stdout[:500]
    # Megatron's layouts, named by parameter: vocab-parallel embedding, fused QKV split by
    # blocks, output projections by rows (their bias replicated), norms replicated
    rows = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and re.fullmatch(r"[\w.]+\.(weight|bias)", parts[0]):
            rows[parts[0]] = parts[1]
    assert rows == {**{f"transformer.{n}": l for n, l in (
        ("wte.weight", "S(0)"), ("wpe.weight", "R"), ("ln_f.weight", "R"), ("ln_f.bias", "R"))},
        "ln_1.weight": "R", "ln_1.bias": "R", "ln_2.weight": "R", "ln_2.bias": "R",
        "attn.c_attn.weight": "S(0|32+32+32)", "attn.c_attn.bias": "S(0|32+32+32)",
        "attn.c_proj.weight": "S(1)", "attn.c_proj.bias": "R",
        "mlp.c_fc.weight": "S(0)", "mlp.c_fc.bias": "S(0)",
        "mlp.c_proj.weight": "S(1)", "mlp.c_proj.bias": "R"}, r.stdout


# -- torchrun -m shardplan.train --resume --------------------------------------------------

TEXT = b"the quick brown fox jumps over the lazy dog. " * 20
STEP = re.compile(r"^step\s+(\d+)/(\d+) \| loss (\S+) \| lr (\S+) \| grad norm (\S+) \|")


def _torchrun(tmp_path, *extra: str, restarts: int = 0, faults: str = "", timeout: int = 120):
    """A 4-step run of ``shardplan.train`` on 2 ranks: (step -> its printed loss, lr and grad
    norm, stdout, stderr). ``faults``: ``shardplan.faults`` to inject."""
    text = tmp_path / "text.txt"
    if not text.exists():
        text.write_bytes(TEXT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(restarts),
           "-m", "shardplan.train", "--tp", "2", "--model", "gpt-tiny", "--steps", "4",
           "--batch-size", "2", "--seq-len", "8", "--warmup", "1", "--lr", "1e-2",
           "--dropout", "0.1", "--data", str(text), "--log-every", "1", "--device", "cpu",
           *extra]
    env = dict(_env(), SHARDPLAN_FAULT_INJECTION=faults)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = {}
    for line in proc.stdout.splitlines():
        m = STEP.match(line)
        if m:
            steps.setdefault(int(m[1]), []).append((m[3], m[4], m[5]))  # loss, lr, grad norm
    return steps, proc.stdout, proc.stderr


def _saved(step_dir: Path) -> dict:
    """A checkpoint as one dict (``dcp_to_torch_save``): model, optimizer state, extra."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    file = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, file)
    return torch.load(file, weights_only=False)


def _weights(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model and optimizer state), by its full name."""
    saved = _saved(step_dir)
    out = {f"model/{k}": v for k, v in saved["model"].items()}
    for fqn, state in saved["optim"]["state"].items():
        out.update({f"optim/{fqn}/{k}": v for k, v in state.items()})
    return out


def _assert_same_tensors(want_dir: Path, got_dir: Path) -> None:
    want, got = _weights(want_dir), _weights(got_dir)
    assert want and sorted(want) == sorted(got) and "optim/transformer.wte.weight/exp_avg" in want
    for k in want:
        assert torch.equal(want[k], got[k]), k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted 4-step run, saving every 2 steps: (printed steps, stdout, its
    directory), the reference of the resumed and the restarted runs below."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    full, out, _ = _torchrun(tmp_path, "--save", str(tmp_path / "full"), "--save-every", "2")
    return {step: lines[0] for step, lines in full.items()}, out, tmp_path / "full"


@pytest.mark.real
@pytest.mark.timeout(300)
def test_torchrun_resume_continues_the_uninterrupted_run(uninterrupted, tmp_path):
    """A 4-step run saving every 2 steps (also the check of the training entry point under
    torchrun), then a run resumed from its step-2 checkpoint:
    steps 3 and 4 print the same loss, lr and grad norm, and both write the same step-4
    weights and optimizer state. Dropout is on and the lr is high, so a resume that lost
    the RNG streams, the data position or the optimizer moments would show."""
    full, out, full_dir = uninterrupted
    resumed_dir = tmp_path / "resumed"
    assert sorted(full) == [1, 2, 3, 4]
    # the entry point itself: torchrun's environment gives the default group, rank 0 alone
    # logs, the data file is read, a checkpoint every 2 steps records the step, the data
    # file and both RNG streams
    lines = [line for line in out.splitlines() if STEP.match(line)]
    assert len(lines) == 4 and "tok/s" in lines[0], out
    assert "dp_replicate 1 x dp_shard 1 x tp 2" in out
    assert sorted(p.name for p in full_dir.iterdir() if p.is_dir()) == ["step-00000002",
                                                                  "step-00000004"]
    extra = json.loads(_saved(full_dir / "step-00000004")["extra"])
    assert extra["step"] == 4 and extra["data"]["tokens"] == len(TEXT)
    assert len(extra["rng"]) == 2  # each rank's streams
    assert all(set(rng) == {"replicated", "model-parallel"} for rng in extra["rng"])
    ck = full_dir / "step-00000002"
    assert ck.is_dir(), sorted(p.name for p in full_dir.iterdir())
    resumed, out, _ = _torchrun(tmp_path, "--resume", str(ck), "--save", str(resumed_dir))
    assert f"resumed {ck} at step 2" in out, out
    assert resumed == {3: [full[3]], 4: [full[4]]}, (full, resumed)
    # the printed losses move from step to step (the comparison above is not of constants)
    assert full[3][0] != full[4][0]
    _assert_same_tensors(full_dir / "step-00000004", resumed_dir / "step-00000004")


@pytest.mark.real
@pytest.mark.timeout(400)
def test_torchrun_restarts_a_killed_or_hung_rank_from_the_last_complete_checkpoint(
        uninterrupted, tmp_path):
    """``torchrun --max-restarts 3`` with a checkpoint every step and ``--timeout 10``:
    rank 1 SIGKILLs itself in step 3 (after its backward, rank 0 inside the gradient
    norm's all-reduce); in the restart, resumed from step-2, rank 0 SIGKILLs itself while
    saving step 3 (every rank's part and DCP's metadata written, not committed); the
    second restart resumes from step-2 again, never from the torn save, saves step 3, and
    rank 1 stops answering in step 4: rank 0's all-reduce times out naming the step and
    the collective, and the third restart resumes from step-3. Every step printed by any
    attempt and the final weights and optimizer state equal the uninterrupted run's."""
    full, _, full_dir = uninterrupted
    ck = tmp_path / "ck"
    steps, out, err = _torchrun(tmp_path, "--save", str(ck), "--save-every", "1",
                                "--timeout", "10", restarts=3, timeout=360,
                                faults="kill step=3 rank=1 attempt=0; kill save=1 rank=0 "
                                       "attempt=1; hang step=2 rank=1 attempt=2")
    assert "kill rank 1 at step 3 (attempt 0)" in out and "kill rank 0 at save 1 (attempt 1)" in out
    assert "hang rank 1 at step 2 (attempt 2)" in out  # its second step: step 4
    assert "step 4: rank 0: all_reduce at grad norm timed out after 10s" in err, err[-3000:]
    assert out.count(f"resumed {ck / 'step-00000002'} at step 2") == 2, out
    assert out.count(f"resumed {ck / 'step-00000003'} at step 3") == 1, out
    # steps 1-2 in attempt 0 (killed in step 3), step 3 in attempts 1 and 2, step 4 in the
    # last (attempt 2 hung in it): each as the uninterrupted run printed it
    assert {s: len(lines) for s, lines in steps.items()} == {1: 1, 2: 1, 3: 2, 4: 1}, out
    assert all(line == full[s] for s, lines in steps.items() for line in lines), (steps, full)
    assert sorted(p.name for p in ck.iterdir()) == [f"step-0000000{i}" for i in (1, 2, 3, 4)]
    _assert_same_tensors(full_dir / "step-00000004", ck / "step-00000004")


# -- torchrun -m shardplan.cli generate --------------------------------------------------


@pytest.mark.real
@pytest.mark.timeout(240)
def test_torchrun_generate_from_a_pretrained_folder_prints_hf_greedy_tokens(tmp_path):
    """``shardplan generate FOLDER --tp 2`` under torchrun (each process one gloo rank) on a
    tiny HF Llama saved in several files: rank 0 prints HF's own greedy ``generate``."""
    import hf_cases
    model = hf_cases.build("llama")
    model.save_pretrained(tmp_path / "llama", max_shard_size="20KB")
    assert len(list((tmp_path / "llama").glob("model-*.safetensors"))) >= 3
    prompt = [5, 6, 7, 8]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "shardplan.cli", "generate", str(tmp_path / "llama"), "--tp", "2",
           "--prompt", " ".join(map(str, prompt)), "--max-new-tokens", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.split() == [str(int(t)) for t in expected[0]], proc.stdout  # rank 0 only
