"""Checkpoints: sharded save/load and resume, offline resharding, full state dicts, crashes.

Models: the bundled GPT with vocabulary 97 (padded at every tp > 1, fused QKV
as blocks, tied embedding/LM head) and the bundled Llama (GQA). Simulated
ranks build their shards from one capture per model (made once here), so a
case costs milliseconds. One case runs on real gloo processes (the shared
``real_ranks`` pool); one kills a forked child process with SIGKILL mid-save.
"""

from __future__ import annotations

import copy
import functools
import json
import multiprocessing
import os
import signal
import sys

import pytest
import safetensors.torch
import torch

from planner_cases import batch
from shardplan import CheckpointError, Shard
from shardplan import checkpoint as ck
from shardplan.checkpoint import atomic, entries, files, full as full_sd, resharding
from shardplan.planner.capture import capture
from shardplan.models import build
from shardplan.ranks import SimulatedRanks
from shardplan.planner.rules import load_rules
from shardplan.sharded import ShardedModule

pytestmark = pytest.mark.timeout(60)

CONFIGS = {
    "gpt": ("gpt-tiny", dict(vocab_size=97)),  # 97: padded at tp 2 and 4; c_attn blocks 32+32+32
    "gpt96": ("gpt-tiny", dict(vocab_size=96)),
    "llama": ("llama-tiny", {}),  # 4 query heads, 2 KV heads
}


def model(name: str, seed: int = 0):
    """A fresh unsharded model (build it in the main thread: seeding is process-wide)."""
    preset, cfg = CONFIGS[name]
    with torch.random.fork_rng(devices=[]):  # leaves the session's RNG alone
        torch.manual_seed(seed)
        return build(preset, **cfg)


def data(name: str, step: int):
    return batch(CONFIGS[name][1].get("vocab_size", 128), 2, 8, seed=100 + step)


@functools.lru_cache(maxsize=None)
def captured(name: str):
    return capture(model(name), data(name, 0), {})


@functools.lru_cache(maxsize=None)
def model_cache(name):
    return model(name)


@pytest.fixture(autouse=True)
def warm():
    """Captures and shared models made here, in the main thread, before ranks ask for them."""
    for name in CONFIGS:
        captured(name)
        model_cache(name)


def shard(ctx, name: str, m):
    """This rank's ShardedModule of ``m`` (a copy), from the cached capture."""
    return ShardedModule(copy.deepcopy(m), ctx.group, load_rules(), example=(data(name, 0), {}),
                         gather_output=True, strict=False, captured=copy.deepcopy(captured(name)))


def step(sharded, opt, idx, tgt):
    opt.zero_grad(set_to_none=True)
    _, loss = sharded(idx, tgt)
    loss.backward()
    opt.step()
    return loss.detach()


def local_state(sharded):
    return {k: t.detach().clone() for k, t in sharded.state_dict().items()}


def assert_equal_dicts(a: dict, b: dict):
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_same_optimizer(a: dict, b: dict):
    """Two optimizer state_dicts: same hyperparameters, bit-identical state."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (i, k)


OPTIMIZERS = {
    "adamw": lambda ps, lr=1e-2: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1),
    "sgd": lambda ps, lr=1e-2: torch.optim.SGD(ps, lr=lr, momentum=0.9, nesterov=True),
}


# -- save / load / resume ----------------------------------------------------------

def resume(ctx, name, opt_name, m, fresh, path, k=2, n=2):
    """Train k steps, save, train n more; a fresh model+optimizer loads and trains the same n."""
    s = shard(ctx, name, m)
    opt = OPTIMIZERS[opt_name](s.parameters())
    for i in range(k):
        step(s, opt, *data(name, i))
    ck.save_sharded(s, path, optimizer=opt, extra={"step": k, "rank": ctx.rank, "data": [k, 0]})
    saved, saved_opt = local_state(s), copy.deepcopy(opt.state_dict())
    expected = [step(s, opt, *data(name, i)) for i in range(k, k + n)]

    s2 = shard(ctx, name, fresh)
    opt2 = OPTIMIZERS[opt_name](s2.parameters(), lr=1.0)  # the checkpoint's lr must win
    extra = ck.load_sharded(s2, path, optimizer=opt2)
    loaded, loaded_opt = local_state(s2), copy.deepcopy(opt2.state_dict())
    got = [step(s2, opt2, *data(name, i)) for i in range(k, k + n)]
    return extra, saved, loaded, saved_opt, loaded_opt, expected, got


@pytest.mark.parametrize("name,opt_name", [("gpt", "adamw"), ("llama", "sgd")])
def test_save_load_resume_is_exact(tmp_path, name, opt_name):
    path = tmp_path / "ckpt"
    results = SimulatedRanks(2).run(resume, name, opt_name, model(name), model(name, seed=1), path)
    for rank, (extra, saved, loaded, saved_opt, loaded_opt, expected, got) in enumerate(results):
        assert extra == {"step": 2, "rank": rank, "data": [2, 0]}  # each rank's own extra
        assert_equal_dicts(saved, loaded)
        assert_same_optimizer(saved_opt, loaded_opt)
        assert torch.equal(torch.stack(expected), torch.stack(got)), (expected, got)

    assert sorted(os.listdir(path)) == ["index.json", "rank00000-of-00002.safetensors",
                                        "rank00001-of-00002.safetensors"]
    assert not (tmp_path / ".ckpt.partial").exists()
    index = json.loads((path / "index.json").read_text())
    assert (index["format"], index["version"], index["tp"]) == (ck.FORMAT, ck.VERSION, 2)
    assert index["extra"] == {"step": 2, "rank": 0, "data": [2, 0]}
    assert index["plan"]["tp"] == 2
    assert index["optimizer"]["param_groups"][0]["lr"] == 1e-2
    with safetensors.safe_open(path / "rank00001-of-00002.safetensors", "pt") as f:
        keys = set(f.keys())
    if name == "gpt":
        wte = index["tensors"]["model/transformer.wte.weight"]
        assert wte["aliases"] == ["lm_head.weight"] and "model/lm_head.weight" not in keys
        assert index["model"]["lm_head.weight"] == "model/transformer.wte.weight"
        assert wte["layout"] == {"type": "shard", "dim": 0, "blocks": None, "padded": 98,
                                 "replicas": 1}
        assert (wte["shape"], wte["local_shape"]) == ([97, 32], [49, 32])
        qkv = index["tensors"]["model/transformer.h.0.attn.c_attn.weight"]["layout"]
        assert qkv["blocks"] == [32, 32, 32]
        assert {"optim/transformer.wte.weight/exp_avg", "optim/transformer.wte.weight/step"} <= keys
    else:
        assert "optim/layers.0.attention.wk.weight/momentum_buffer" in keys


@pytest.mark.real
@pytest.mark.timeout(120)
def test_resume_on_real_gloo(real_ranks, tmp_path):
    results = real_ranks(2).run(real_resume, str(tmp_path))
    for expected, got, _ in results:
        assert torch.equal(expected, got), (expected, got)
    full = results[0][2]
    reference = model("gpt", seed=5)
    safetensors.torch.load_model(reference, tmp_path / "full.safetensors")  # strict
    assert_equal_dicts(reference.state_dict(), full)


def real_resume(ctx, path):
    """On a real rank: resume equivalence over gloo, plus save_full (one capture per worker)."""
    m, fresh = model("gpt"), model("gpt", seed=1)
    s = shard(ctx, "gpt", m)
    opt = OPTIMIZERS["adamw"](s.parameters())
    for i in range(2):
        step(s, opt, *data("gpt", i))
    ck.save_sharded(s, f"{path}/ckpt", optimizer=opt, extra={"step": 2})
    expected = torch.stack([step(s, opt, *data("gpt", i)) for i in (2, 3)])
    s2 = shard(ctx, "gpt", fresh)
    opt2 = OPTIMIZERS["adamw"](s2.parameters())
    assert ck.load_sharded(s2, f"{path}/ckpt", optimizer=opt2) == {"step": 2}
    got = torch.stack([step(s2, opt2, *data("gpt", i)) for i in (2, 3)])
    ck.save_full(s2, f"{path}/full.safetensors")
    return expected, got, ck.gather_full_state_dict(s2)


# -- resharding ----------------------------------------------------------------------

def train_and_save(ctx, m, path):
    s = shard(ctx, "gpt", m)
    opt = OPTIMIZERS["adamw"](s.parameters())
    step(s, opt, *data("gpt", 0))
    ck.save_sharded(s, path, optimizer=opt)
    return continue_run(s, opt)


def load_and_continue(ctx, fresh, path):
    s = shard(ctx, "gpt", fresh)
    opt = OPTIMIZERS["adamw"](s.parameters(), lr=1.0)
    ck.load_sharded(s, path, optimizer=opt)
    return continue_run(s, opt)


def continue_run(s, opt):
    """(full weights, logits of the next batch, full optimizer state)."""
    with torch.no_grad():
        logits, _ = s(*data("gpt", 1))
    return ck.gather_full_state_dict(s), logits, full_optimizer_state(s, opt)


def full_optimizer_state(s, opt):
    """Every optimizer state tensor reassembled to full size, by parameter name (collective)."""
    out = {}
    for name, p in s.named_parameters():
        lay = s.layouts[name]
        for k, v in sorted(opt.state[p].items()):
            if isinstance(lay, Shard) and v.shape == p.shape:
                parts = s.group.all_gather(v.unsqueeze(0), 0).unbind(0)
                v = lay.unshard(list(parts), s.plan.param(name).global_shape[lay.dim])
            out[f"{name}/{k}"] = v.clone()
    return out


def test_reshard_to_other_tp_gives_same_model(tmp_path):
    src = tmp_path / "tp2"
    weights, logits, state = SimulatedRanks(2).run(train_and_save, model("gpt"), src)[0]
    assert "transformer.wte.weight/exp_avg" in state
    fresh = model("gpt", seed=1)
    for tp in (4, 1):
        ck.reshard(src, tmp_path / f"tp{tp}", tp)
        index = json.loads((tmp_path / f"tp{tp}" / "index.json").read_text())
        padded = {4: 100, 1: None}[tp]
        assert index["tensors"]["model/transformer.wte.weight"]["layout"]["padded"] == padded
        w, lg, st = SimulatedRanks(tp).run(load_and_continue, fresh, tmp_path / f"tp{tp}")[0]
        assert_equal_dicts(weights, w)  # resharding is exact
        assert_equal_dicts(state, st)  # the optimizer state followed its parameters
        torch.testing.assert_close(lg, logits, atol=1e-5, rtol=1e-5)

    # and back: tp 2 -> 4 -> 2 reproduces every file's tensors bit for bit
    ck.reshard(tmp_path / "tp4", tmp_path / "back", 2)
    for r in range(2):
        name = ck.rank_file(r, 2)
        with safetensors.safe_open(src / name, "pt") as f, \
                safetensors.safe_open(tmp_path / "back" / name, "pt") as g:
            assert set(f.keys()) == set(g.keys())
            for k in f.keys():
                assert torch.equal(f.get_tensor(k), g.get_tensor(k)), k


# -- full state dicts ----------------------------------------------------------------

def full_round_trip(ctx, name, fresh, full, files):
    s = shard(ctx, name, fresh)
    ck.load_full_state_dict(s, full)
    from_dict = local_state(s)
    gathered = ck.gather_full_state_dict(s)
    ck.save_full(s, files[0])
    from_files = []
    for file in files:
        s2 = shard(ctx, name, fresh)
        ck.load_full_state_dict(s2, file)
        from_files.append(local_state(s2))
    with torch.no_grad():
        logits, _ = s(*data(name, 1))
    return from_dict, gathered, from_files, logits, s.layouts


class SpyOpen:
    """safe_open that records which tensors were read whole."""

    def __init__(self, real, log, *args, **kwargs):
        self.f, self.log = real(*args, **kwargs), log

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def get_tensor(self, key):
        self.log.append(key)
        return self.f.get_tensor(key)

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_full_state_dict_round_trip(tmp_path, monkeypatch, name):
    original = model(name)
    full = original.state_dict()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    safetensors.torch.save_model(original, theirs)  # tied weights under safetensors' choice of name
    read_whole: list[str] = []
    monkeypatch.setattr(files, "safe_open", functools.partial(SpyOpen, files.safe_open, read_whole))
    results = SimulatedRanks(2).run(full_round_trip, name, model(name, seed=1), full, [ours, theirs])

    gathered = results[0][1]
    assert results[1][1] is None  # only rank 0 gets it
    assert_equal_dicts(full, gathered)  # bit-identical, every alias key, padding dropped
    model(name, seed=2).load_state_dict(gathered, strict=True)
    reloaded = model(name, seed=3)
    safetensors.torch.load_model(reloaded, ours)  # the unsharded class reads save_full's file
    assert_equal_dicts(full, reloaded.state_dict())
    with safetensors.safe_open(ours, "pt") as f:
        assert len(list(f.keys())) == len({id(t) for t in original.state_dict(keep_vars=True).values()})

    layouts = results[0][4]
    for from_dict, _, from_files, _, _ in results:
        for from_file in from_files:
            assert_equal_dicts(from_dict, from_file)
    assert not [k for k in read_whole if isinstance(layouts.get(k), Shard)]  # sliced reads only
    if name == "gpt":  # padding rows are zero on the last rank
        assert results[1][0]["transformer.wte.weight"][-1].abs().sum() == 0
    with torch.no_grad():
        logits, _ = original(*data(name, 1))
    torch.testing.assert_close(results[0][3], logits, atol=1e-5, rtol=1e-5)


# -- crashes -------------------------------------------------------------------------

def save(ctx, name, m, path, optimizer=False):
    s = shard(ctx, name, m)
    opt = OPTIMIZERS["adamw"](s.parameters()) if optimizer else None
    ck.save_sharded(s, path, optimizer=opt)


def load_gather_then_save(ctx, name, fresh, path, then):
    s = shard(ctx, name, fresh)
    ck.load_sharded(s, path)
    first = ck.gather_full_state_dict(s)
    s2 = shard(ctx, name, then)
    ck.save_sharded(s2, path)
    ck.load_sharded(s, path)
    return first, ck.gather_full_state_dict(s)


def test_crash_while_writing_a_rank_file_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    v1, v2 = model("gpt"), model("gpt", seed=1)
    SimulatedRanks(2).run(save, "gpt", v1, path, True)
    written: dict[str, int] = {}
    real = files.write_tensor

    def failing(f, t):
        written[f.name] = written.get(f.name, 0) + 1
        if "rank00001" in f.name and written[f.name] == 3:
            f.write(b"\0" * 7)  # half a tensor
            raise OSError(28, "No space left on device (simulated)")
        real(f, t)

    monkeypatch.setattr(files, "write_tensor", failing)
    with pytest.raises(CheckpointError, match="rank 1.*No space left"):
        SimulatedRanks(2).run(save, "gpt", v2, path, True)
    monkeypatch.undo()
    assert (tmp_path / ".ckpt.partial").is_dir()  # the failed attempt, never swapped in
    first, second = SimulatedRanks(2).run(load_gather_then_save, "gpt", model("gpt", seed=2),
                                          path, v2)[0]
    assert_equal_dicts(v1.state_dict(), first)  # the previous checkpoint loads
    assert_equal_dicts(v2.state_dict(), second)  # the next save replaces it
    assert not (tmp_path / ".ckpt.partial").exists()


def test_directory_swap_without_renameat2(tmp_path, monkeypatch):
    """Where an atomic exchange is unsupported: two renames, and loads find the old one between."""
    monkeypatch.setattr(atomic, "swap_paths", lambda a, b: False)
    path, v1, v2 = tmp_path / "ckpt", model("gpt"), model("gpt", seed=1)
    SimulatedRanks(1).run(save, "gpt", v1, path)
    SimulatedRanks(1).run(save, "gpt", v2, path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    os.rename(path, tmp_path / ".ckpt.old")  # died between the two renames
    first, second = SimulatedRanks(1).run(load_gather_then_save, "gpt", v1, path, v1)[0]
    assert_equal_dicts(v2.state_dict(), first)
    assert_equal_dicts(v1.state_dict(), second)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def kill_mid_save(path):
    """In a child process: save, change the weights, save again; SIGKILL inside rank 1's file."""
    v1 = model("gpt")
    SimulatedRanks(2).run(save, "gpt", v1, path, True)
    v2 = model("gpt", seed=1)
    real = files.write_tensor
    count = {}

    def die(f, t):
        count[f.name] = count.get(f.name, 0) + 1
        if "rank00001" in f.name and count[f.name] == 3:
            f.write(b"\0" * 5)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        real(f, t)

    files.write_tensor = die
    SimulatedRanks(2).run(save, "gpt", v2, path, True)


def load_full(ctx, name, fresh, path):
    s = shard(ctx, name, fresh)
    ck.load_sharded(s, path)
    return ck.gather_full_state_dict(s)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks a child process")
def test_killed_process_mid_save_keeps_previous_checkpoint(tmp_path):
    """A real process death (SIGKILL) halfway through a rank's file.

    The child is forked so it inherits the cached capture (a fresh interpreter
    would spend seconds importing and exporting); it does no heavy compute.
    """
    path = tmp_path / "ckpt"
    child = multiprocessing.get_context("fork").Process(target=kill_mid_save, args=(path,))
    child.start()
    child.join(50)
    if child.is_alive():
        child.kill()
        pytest.fail("the child saving the checkpoint hung")
    assert child.exitcode == -signal.SIGKILL
    assert (tmp_path / ".ckpt.partial" / ck.rank_file(1, 2)).is_file()  # the torn file
    got = SimulatedRanks(2).run(load_full, "gpt", model("gpt", seed=1), path)[0]
    assert_equal_dicts(model("gpt").state_dict(), got)


# -- errors --------------------------------------------------------------------------

def errors_tp2(ctx, path, other):
    """Each mismatch, as the message of the CheckpointError it raised."""
    out = {}

    def expect(key, fn, *args, **kwargs):
        with pytest.raises(CheckpointError) as e:
            fn(*args, **kwargs)
        out[key] = str(e.value)

    s = shard(ctx, "gpt", model_cache("gpt"))
    expect("extra", ck.save_sharded, s, path / "x", extra={"rng": torch.get_rng_state()})
    expect("optimizer class", ck.load_sharded, s, path / "gpt",
           optimizer=torch.optim.SGD(s.parameters(), lr=0.1))
    expect("no optimizer", ck.load_sharded, s, path / "gpt-no-opt",
           optimizer=torch.optim.AdamW(s.parameters()))
    expect("not a checkpoint", ck.load_sharded, s, path / "nothing")
    expect("not ours", ck.save_sharded, s, path / "other-dir")
    expect("shape", ck.load_sharded, shard(ctx, "gpt96", other["gpt96"]), path / "gpt")
    expect("names", ck.load_sharded, shard(ctx, "llama", other["llama"]), path / "gpt")
    full = dict(model_cache("gpt").state_dict())
    del full["lm_head.weight"]  # fine: tied, found under its other name
    ck.load_full_state_dict(s, full)
    full["transformer.wpe.weight"] = torch.zeros(31, 32)
    expect("full shape", ck.load_full_state_dict, s, full)
    del full["transformer.wpe.weight"]
    expect("full missing", ck.load_full_state_dict, s, full)
    expect("corrupt", ck.load_sharded, s, path / "corrupt")
    return out


def test_mismatches_raise_checkpoint_errors(tmp_path):
    SimulatedRanks(2).run(resume_save, tmp_path)
    (tmp_path / "other-dir").mkdir()
    (tmp_path / "other-dir" / "notes.txt").write_text("mine")
    corrupt = tmp_path / "corrupt"
    ck.reshard(tmp_path / "gpt", corrupt, 2)
    f = corrupt / ck.rank_file(1, 2)
    f.write_bytes(f.read_bytes()[:100])
    other = {"gpt96": model("gpt96"), "llama": model("llama")}
    msgs = SimulatedRanks(2).run(errors_tp2, tmp_path, other)
    m = msgs[0]
    assert "extra['rng']" in m["extra"] and ".tolist()" in m["extra"]
    assert "AdamW" in m["optimizer class"] and "SGD" in m["optimizer class"]
    assert "no optimizer state" in m["no optimizer"]
    assert "index.json" in m["not a checkpoint"]
    assert "refusing to replace" in m["not ours"] and (tmp_path / "other-dir" / "notes.txt").exists()
    assert "transformer.wte.weight" in m["shape"] and "[97, 32]" in m["shape"]
    assert "missing" in m["names"] and "unexpected" in m["names"]
    assert "transformer.wpe.weight" in m["full shape"] and "[31, 32]" in m["full shape"]
    assert "missing" in m["full missing"] and "transformer.wpe.weight" in m["full missing"]
    assert msgs[1]["corrupt"].count(ck.rank_file(1, 2)) >= 1  # the rank that read it
    assert ck.rank_file(1, 2) in m["corrupt"]  # its peers quote that rank's error

    with pytest.raises(CheckpointError, match=r"tp=2.*tp=4(.|\n)*reshard"):
        SimulatedRanks(4).run(load_full, "gpt", model_cache("gpt"), tmp_path / "gpt")
    with pytest.raises(CheckpointError, match=r"c_attn.*tp=3: its blocks 32\+32\+32"):
        ck.reshard(tmp_path / "gpt", tmp_path / "tp3", 3)
    assert not (tmp_path / "tp3").exists()


def resume_save(ctx, path):
    s = shard(ctx, "gpt", model_cache("gpt"))
    opt = OPTIMIZERS["adamw"](s.parameters())
    step(s, opt, *data("gpt", 0))
    ck.save_sharded(s, path / "gpt", optimizer=opt)
    ck.save_sharded(s, path / "gpt-no-opt")


# -- layouts, without a model -------------------------------------------------------------

LAYOUTS = [Shard(0), Shard(1), Shard(0, (8, 4, 4)), Shard(0, None, 12), Shard(0, None, 20),
           Shard(0, None, None, 2), Shard(0, (8, 4, 4), None, 2),  # replicas: K/V heads < tp
           Shard(0, (8, 4, 4), None, (1, 2, 2)), Shard(0, (8, 4, 4), None, (1, 4, 4))]  # per block
CASES = [(lay, tp) for lay in LAYOUTS for tp in (1, 2, 4)
         if max(lay.block_replicas()) <= tp and not (lay.padded and lay.padded % tp)]


@pytest.mark.parametrize("lay,tp", CASES, ids=lambda x: str(x))
def test_sliced_reads_equal_layout_slice(tmp_path, lay, tp):
    """What load_full_state_dict reads from a file by ranges is exactly ``Shard.slice``."""
    full = torch.randn(16 if not lay.padded else 10, 6) if lay.dim == 0 else torch.randn(6, 16)
    file = tmp_path / "t.safetensors"
    safetensors.torch.save_file({"w": full}, file)
    entry = entries.Entry("w", [], torch.empty(0), lay, tuple(full.shape))
    with safetensors.safe_open(file, "pt") as f:
        for rank in range(tp):
            assert torch.equal(full_sd._read_local(f, "w", entry, rank, tp), lay.slice(full, rank, tp))


def test_relayout_for_another_tp():
    assert resharding._relayout(Shard(0, None, 98), [97, 32], 4, 2, "k") == Shard(0, None, 100)
    assert resharding._relayout(Shard(0, None, 98), [97, 32], 1, 2, "k") == Shard(0)
    assert resharding._relayout(Shard(0, (32, 32, 32)), [96, 32], 4, 2, "k") == Shard(0, (32, 32, 32))
    with pytest.raises(CheckpointError, match="blocks 32\\+32\\+32 do not divide by 3"):
        resharding._relayout(Shard(0, (32, 32, 32)), [96, 32], 3, 2, "k")
    two = Shard(0, None, None, 2)  # 2 K/V heads held by pairs of ranks at tp=4
    assert resharding._relayout(two, [32, 8], 8, 4, "k") == Shard(0, None, None, 4)
    assert resharding._relayout(two, [32, 8], 2, 4, "k") == Shard(0)
    with pytest.raises(CheckpointError, match="2 parts"):
        resharding._relayout(two, [32, 8], 3, 4, "k")


def test_meta_model_loads_its_shards_from_a_full_file_and_runs(tmp_path):
    """A model too big to materialize: built on meta, parallelized, then each rank reads
    only its slices of the full .safetensors file; it then computes what the real one does."""
    real = build("gpt-tiny", vocab_size=97)
    file = tmp_path / "full.safetensors"
    safetensors.torch.save_model(real, file)
    on_meta = build("gpt-tiny", vocab_size=97, device="meta")
    idx, tgt = batch(97, 2, 5)
    want_logits, want_loss = real(idx, tgt)

    def body(ctx):
        s = ShardedModule(on_meta, ctx.group, load_rules(), example=((idx, tgt), {}),
                          gather_output=True, strict=False)
        assert all(p.is_meta for p in s.parameters())
        ck.load_full_state_dict(s, file)
        assert not any(p.is_meta for p in s.parameters())
        assert s.transformer.wte.weight is s.lm_head.weight  # still tied
        return s(idx, tgt)

    for logits, loss in SimulatedRanks(2).run(body):
        torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
