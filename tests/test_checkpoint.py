"""Checkpoints (torch DCP): save/load and resume, async saves, resharding on load, full
state dicts, crashes, errors.

Models: the bundled GPT with vocabulary 97 (padded at every tp > 1, fused QKV
as blocks, tied embedding/LM head) and the bundled Llama (GQA). A save at tp > 1
needs real ranks: one launch on 2 gloo processes (the shared ``real_ranks``
pool) covers resume, async save and the errors; simulated ranks (threads, built
from one capture per model) then load what it wrote at other tps. One case kills
a forked child process with SIGKILL mid-save.
"""

from __future__ import annotations

import copy
import functools
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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, filesystem

from shardplan.checkpoint import dcp as ck_dcp
from shardplan.checkpoint.chunks import LoadPlanner, chunks_of
from shardplan.checkpoint.chunks import Entry
from shardplan.planner.shards import local_shape
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


# -- save / load / resume / async, on real gloo ---------------------------------------

def real_checkpoints(ctx, path):
    """On each of 2 real ranks: resume after a save, an async save that training outruns,
    GQA with SGD, and every error (as its message)."""
    s = shard(ctx, "gpt", model("gpt"))
    opt = OPTIMIZERS["adamw"](s.parameters())
    for i in range(2):
        step(s, opt, *data("gpt", i))
    ck.save(s, f"{path}/sync", optimizer=opt, extra={"step": 2, "data": [2, 0]})
    saved, saved_opt = local_state(s), copy.deepcopy(opt.state_dict())
    expected = [step(s, opt, *data("gpt", i)) for i in (2, 3)]
    pending = ck.async_save(s, f"{path}/async", optimizer=opt, extra={"step": 4})
    staged, staged_opt = local_state(s), copy.deepcopy(opt.state_dict())
    step(s, opt, *data("gpt", 4))  # changes the tensors while they are written
    pending.wait()

    s2 = shard(ctx, "gpt", model("gpt", seed=1))
    opt2 = OPTIMIZERS["adamw"](s2.parameters(), lr=1.0)  # the checkpoint's lr must win
    extra = ck.load(s2, f"{path}/sync", optimizer=opt2)
    loaded, loaded_opt = local_state(s2), copy.deepcopy(opt2.state_dict())
    weights = ck.gather_full_state_dict(s2)
    got = [step(s2, opt2, *data("gpt", i)) for i in (2, 3)]
    s3 = shard(ctx, "gpt", model("gpt", seed=1))
    opt3 = OPTIMIZERS["adamw"](s3.parameters())
    async_extra = ck.load(s3, f"{path}/async", optimizer=opt3)
    gpt = (extra, saved, loaded, saved_opt, loaded_opt, expected, got,
           async_extra, staged, local_state(s3), staged_opt, copy.deepcopy(opt3.state_dict()))

    g = shard(ctx, "llama", model("llama"))
    gopt = OPTIMIZERS["sgd"](g.parameters())
    step(g, gopt, *data("llama", 0))
    ck.save(g, f"{path}/llama", optimizer=gopt)
    g2 = shard(ctx, "llama", model("llama", seed=1))
    gopt2 = OPTIMIZERS["sgd"](g2.parameters())
    ck.load(g2, f"{path}/llama", optimizer=gopt2)
    llama = (local_state(g), local_state(g2), gopt.state_dict(), gopt2.state_dict())

    ck.save(s, f"{path}/no-opt")
    return gpt, llama, errors(ctx, s, path), weights


def errors(ctx, s, path):
    """Each mismatch, as the message of the CheckpointError it raised (on every rank)."""
    out = {}

    def expect(key, fn, *args, **kwargs):
        with pytest.raises(CheckpointError) as e:
            fn(*args, **kwargs)
        out[key] = str(e.value)

    expect("extra", ck.save, s, f"{path}/x", extra={"rng": torch.get_rng_state()})
    expect("optimizer class", ck.load, s, f"{path}/sync",
           optimizer=torch.optim.SGD(s.parameters(), lr=0.1))
    expect("no optimizer", ck.load, s, f"{path}/no-opt",
           optimizer=torch.optim.AdamW(s.parameters()))
    expect("not a checkpoint", ck.load, s, f"{path}/nothing")
    expect("not ours", ck.save, s, f"{path}/other-dir")
    expect("old format", ck.load, s, f"{path}/old")
    expect("shape", ck.load, shard(ctx, "gpt96", model("gpt96")), f"{path}/sync")
    expect("names", ck.load, shard(ctx, "llama", model("llama")), f"{path}/sync")
    full = dict(model_cache("gpt").state_dict())
    del full["lm_head.weight"]  # fine: tied, found under its other name
    ck.load_full_state_dict(s, full)
    full["transformer.wpe.weight"] = torch.zeros(31, 32)
    expect("full shape", ck.load_full_state_dict, s, full)
    del full["transformer.wpe.weight"]
    expect("full missing", ck.load_full_state_dict, s, full)
    return out


def simulated_load(ctx, path):
    """Load a checkpoint saved at tp 2 at this tp: (full weights, full optimizer state,
    logits of a batch)."""
    s = shard(ctx, "gpt", model("gpt", seed=3))
    opt = OPTIMIZERS["adamw"](s.parameters(), lr=1.0)
    ck.load(s, path, optimizer=opt)
    with torch.no_grad():
        logits, _ = s(*data("gpt", 1))
    return ck.gather_full_state_dict(s), full_optimizer_state(s, opt), logits


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


@pytest.mark.real
@pytest.mark.timeout(180)
def test_save_load_async_and_errors_on_real_gloo(real_ranks, tmp_path):
    (tmp_path / "other-dir").mkdir()
    (tmp_path / "other-dir" / "notes.txt").write_text("mine")
    (tmp_path / "old").mkdir()  # what the retired format wrote
    (tmp_path / "old" / "index.json").write_text('{"format": "shardplan-checkpoint", "tp": 2}')
    results = real_ranks(2).run(real_checkpoints, str(tmp_path))
    for rank, (gpt, llama, msgs, _) in enumerate(results):
        (extra, saved, loaded, saved_opt, loaded_opt, expected, got,
         async_extra, staged, async_loaded, staged_opt, async_opt) = gpt
        assert extra == {"step": 2, "data": [2, 0]}
        assert_equal_dicts(saved, loaded)
        assert_same_optimizer(saved_opt, loaded_opt)
        assert torch.equal(torch.stack(expected), torch.stack(got)), (rank, expected, got)
        assert async_extra == {"step": 4}
        assert_equal_dicts(staged, async_loaded)  # what was staged, not the later step
        assert_same_optimizer(staged_opt, async_opt)
        assert any(not torch.equal(staged[k], saved[k]) for k in staged)
        assert_equal_dicts(llama[0], llama[1])
        assert_same_optimizer(llama[2], llama[3])
        assert "extra['rng']" in msgs["extra"] and ".tolist()" in msgs["extra"]
        assert "AdamW" in msgs["optimizer class"] and "SGD" in msgs["optimizer class"]
        assert "no optimizer state" in msgs["no optimizer"]
        assert ".metadata is missing" in msgs["not a checkpoint"]
        assert "refusing to replace" in msgs["not ours"]
        assert "retired" in msgs["old format"] and "shardplan-checkpoint" in msgs["old format"]
        assert "transformer.wte.weight" in msgs["shape"] and "[97, 32]" in msgs["shape"]
        assert "missing" in msgs["names"] and "unexpected" in msgs["names"]
        assert "transformer.wpe.weight" in msgs["full shape"] and "[31, 32]" in msgs["full shape"]
        assert "missing" in msgs["full missing"] and "transformer.wpe.weight" in msgs["full missing"]
    assert (tmp_path / "other-dir" / "notes.txt").exists()
    assert not list(tmp_path.glob(".*.partial"))
    # the plain model reads the model part of the checkpoint, strictly
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(tmp_path / "sync", tmp_path / "sync.pt")
    plain = model("gpt", seed=4)
    plain.load_state_dict(torch.load(tmp_path / "sync.pt")["model"], strict=True)
    weights = results[0][3]
    assert_equal_dicts(weights, plain.state_dict())
    # resharding on load: the same weights, optimizer state and logits at tp 4 and 1
    ref = SimulatedRanks(2).run(simulated_load, tmp_path / "sync")[0]
    assert "transformer.wte.weight/exp_avg" in ref[1]
    for tp in (4, 1):
        w, state, logits = SimulatedRanks(tp).run(simulated_load, tmp_path / "sync")[0]
        assert_equal_dicts(weights, w)
        assert_equal_dicts(ref[1], state)
        torch.testing.assert_close(logits, ref[2], atol=1e-5, rtol=1e-5)


def test_simulated_ranks_cannot_save(tmp_path):
    with pytest.raises(CheckpointError, match="needs torch.distributed"):
        SimulatedRanks(2).run(save, "gpt", model_cache("gpt"), tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def save_trained(ctx, path):
    s = shard(ctx, "gpt", model("gpt"))
    opt = OPTIMIZERS["adamw"](s.parameters())
    step(s, opt, *data("gpt", 0))
    ck.save(s, path, optimizer=opt, extra={"step": 1})


def test_checkpoints_of_before_the_shardplan_entry_load(tmp_path):
    """A DCP checkpoint without the ``"shardplan"`` entry (tied names, optimizer class),
    as the save of before wrote: it loads with its optimizer state at tp 2 and exports."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
    SimulatedRanks(1).run(save_trained, tmp_path / "new")
    dcp_to_torch_save(tmp_path / "new", tmp_path / "all.pt")
    state = torch.load(tmp_path / "all.pt", weights_only=False)
    del state["shardplan"]
    torch.save(state, tmp_path / "all.pt")
    torch_save_to_dcp(tmp_path / "all.pt", tmp_path / "old")
    for path in ("new", "old"):
        weights, optim, _ = SimulatedRanks(2).run(simulated_load, tmp_path / path)[0]
        if path == "new":
            want = weights, optim
    assert_equal_dicts(want[0], weights)
    assert_equal_dicts(want[1], optim)
    ck.export_hf(tmp_path / "old", tmp_path / "hf")  # both tied names, as separate tensors
    exported = safetensors.torch.load_file(next((tmp_path / "hf").glob("*.safetensors")))
    assert torch.equal(exported["lm_head.weight"], want[0]["lm_head.weight"])


# -- full state dicts ----------------------------------------------------------------

def full_round_trip(ctx, name, fresh, full, file):
    s = shard(ctx, name, fresh)
    ck.load_full_state_dict(s, full)
    from_dict = local_state(s)
    gathered = ck.gather_full_state_dict(s)
    s2 = shard(ctx, name, fresh)
    ck.load_full_state_dict(s2, file)
    with torch.no_grad():
        logits, _ = s(*data(name, 1))
    return from_dict, gathered, local_state(s2), logits, s.layouts


def spy_reads(monkeypatch) -> list[tuple[str, int]]:
    """(tensor name, elements) of every read an HF storage reader makes."""
    reads: list[tuple[str, int]] = []
    real = HuggingFaceStorageReader._process_read_request

    def spy(self, f, req, planner):
        reads.append((req.storage_index.fqn, int(torch.Size(req.lengths).numel())))
        return real(self, f, req, planner)

    monkeypatch.setattr(HuggingFaceStorageReader, "_process_read_request", spy)
    return reads


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_full_state_dict_round_trip(tmp_path, monkeypatch, name):
    original = model(name)
    full = original.state_dict()
    file = tmp_path / "model.safetensors"
    safetensors.torch.save_model(original, file)  # tied weights under safetensors' choice of name
    (tmp_path / "other.safetensors").write_bytes(b"not read")  # beside the file given
    reads = spy_reads(monkeypatch)
    results = SimulatedRanks(2).run(full_round_trip, name, model(name, seed=1), full, file)

    gathered = results[0][1]
    assert results[1][1] is None  # only rank 0 gets it
    assert_equal_dicts(full, gathered)  # bit-identical, every alias key, padding dropped
    model(name, seed=2).load_state_dict(gathered, strict=True)
    for from_dict, _, from_file, _, _ in results:
        assert_equal_dicts(from_dict, from_file)
    layouts = results[0][4]
    sharded = {k for k, lay in layouts.items() if isinstance(lay, Shard)}
    read = {}
    for k, n in reads:
        read[k] = read.get(k, 0) + n
    for k in sharded & set(read):  # each rank reads its part: the two add up to the tensor
        assert read[k] == full[k].numel(), k
    assert sharded & set(read)
    if name == "gpt":  # padding rows are zero on the last rank
        assert results[1][0]["transformer.wte.weight"][-1].abs().sum() == 0
    with torch.no_grad():
        logits, _ = original(*data(name, 1))
    torch.testing.assert_close(results[0][3], logits, atol=1e-5, rtol=1e-5)


# -- crashes -------------------------------------------------------------------------

def save(ctx, name, m, path, optimizer=False):
    s = shard(ctx, name, m)
    opt = OPTIMIZERS["adamw"](s.parameters()) if optimizer else None
    if opt is not None:
        step(s, opt, *data(name, 0))
    ck.save(s, path, optimizer=opt)


def load_full(ctx, name, fresh, path):
    s = shard(ctx, name, fresh)
    ck.load(s, path)
    return ck.gather_full_state_dict(s)


def kill_mid_save(path):
    """In a child process: save, then save other weights, SIGKILLed inside a data file."""
    SimulatedRanks(1).run(save, "gpt", model("gpt"), path)
    real, count = filesystem._write_item, [0]

    def die(transforms, stream, data, item, *args):
        count[0] += 1
        if count[0] == 3:
            stream.write(b"\0" * 5)
            stream.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real(transforms, stream, data, item, *args)

    filesystem._write_item = die
    SimulatedRanks(1).run(save, "gpt", model("gpt", seed=1), path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks a child process")
def test_killed_process_mid_save_keeps_previous_checkpoint(tmp_path):
    """A real process death (SIGKILL) halfway through a data file: the torn save is never
    loaded, the previous checkpoint is, and the next save replaces it.

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
    torn = tmp_path / ".ckpt.partial"
    assert list(torn.glob("*.distcp")) and not (torn / ".metadata").exists()
    got = SimulatedRanks(2).run(load_full, "gpt", model("gpt", seed=2), path)[0]
    assert_equal_dicts(model("gpt").state_dict(), got)
    SimulatedRanks(1).run(save, "gpt", model("gpt", seed=1), path)
    got = SimulatedRanks(2).run(load_full, "gpt", model("gpt", seed=2), path)[0]
    assert_equal_dicts(model("gpt", seed=1).state_dict(), got)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_save_replaces_a_checkpoint(tmp_path):
    """A save over a checkpoint replaces it (the previous one renamed aside, then removed)."""
    path, v1, v2 = tmp_path / "ckpt", model("gpt"), model("gpt", seed=1)
    SimulatedRanks(1).run(save, "gpt", v1, path)
    SimulatedRanks(1).run(save, "gpt", v2, path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    got = SimulatedRanks(1).run(load_full, "gpt", v1, path)[0]
    assert_equal_dicts(v2.state_dict(), got)


# -- layouts, without a model -------------------------------------------------------------

def read_rank(folder, lay, shape, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s part of tensor ``w`` of the safetensors file in ``folder``, as the
    chunks of its layout read through DCP's HF reader."""
    target = torch.zeros(local_shape(shape, lay, tp))
    entry = Entry("w", [], target, lay, tuple(shape))
    reader = HuggingFaceStorageReader(str(folder))
    ck_dcp.quietly(dcp.load, {"w": chunks_of(target, entry, rank, tp)}, storage_reader=reader,
                   planner=LoadPlanner(), no_dist=True)
    return target


LAYOUTS = [Shard(0), Shard(1), Shard(0, (8, 4, 4)), Shard(0, None, 12), Shard(0, None, 20),
           Shard(0, None, None, 2), Shard(0, (8, 4, 4), None, 2),  # replicas: K/V heads < tp
           Shard(0, (8, 4, 4), None, (1, 2, 2)), Shard(0, (8, 4, 4), None, (1, 4, 4))]  # per block
CASES = [(lay, tp) for lay in LAYOUTS for tp in (1, 2, 4)
         if max(lay.block_replicas()) <= tp and not (lay.padded and lay.padded % tp)]


@pytest.mark.parametrize("lay,tp", CASES, ids=lambda x: str(x))
def test_sliced_reads_equal_layout_slice(tmp_path, lay, tp):
    """What a rank reads of a file by its chunks is exactly ``Shard.slice`` (padding zero)."""
    full = torch.randn(16 if not lay.padded else 10, 6) if lay.dim == 0 else torch.randn(6, 16)
    safetensors.torch.save_file({"w": full}, tmp_path / "t.safetensors")
    for rank in range(tp):
        assert torch.equal(read_rank(tmp_path, lay, full.shape, rank, tp),
                           lay.slice(full, rank, tp)), rank


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
