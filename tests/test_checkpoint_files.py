"""Full checkpoints in several files: ``save_pretrained(max_shard_size=...)`` loads like one file.

The HF GPT-2 here (vocabulary 101, padded at tp 2; fused c_attn) is built on
meta and captured once; simulated ranks build their shards from that capture.
One case measures resident memory on real gloo ranks.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import sys
import threading

import pytest
import safetensors.torch
import torch

import hf_cases
from memory_cases import CONFIG, load_peak
from shardplan import CheckpointError
from shardplan import checkpoint as ck
from shardplan.models import build
from shardplan.planner.capture import capture
from shardplan.planner.rules import load_rules
from shardplan.ranks import SimulatedRanks
from shardplan.sharded import ShardedModule

pytestmark = pytest.mark.timeout(120)

KW = {"input_ids": torch.zeros(2, 4, dtype=torch.long)}


@functools.lru_cache(maxsize=None)
def model():
    return hf_cases.build("gpt2")


@functools.lru_cache(maxsize=None)
def meta_model():
    with torch.device("meta"):
        m = type(model())(model().config)
    return m.eval()


@functools.lru_cache(maxsize=None)
def captured():
    return capture(meta_model(), (), {k: v.to("meta") for k, v in KW.items()})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(one-file folder, several-files folder) of the same weights, as save_pretrained writes."""
    root = tmp_path_factory.mktemp("pretrained")
    model().save_pretrained(root / "one")
    model().save_pretrained(root / "split", max_shard_size="100KB")
    captured()
    return root / "one", root / "split"


def load(ctx, path):
    """This rank's tensors after loading ``path`` into a meta-built sharded model; the
    error instead when loading fails, with whether the model was left callable."""
    s = ShardedModule(copy.deepcopy(meta_model()), ctx.group, load_rules(), example=((), KW),
                      gather_output=True, strict=False, captured=copy.deepcopy(captured()))
    try:
        ck.load_full_state_dict(s, path)
    except CheckpointError as e:
        try:
            s(**KW)
            callable_after = True
        except CheckpointError:
            callable_after = False
        return str(e), callable_after
    with torch.no_grad():
        logits = s(**KW).logits
    return {k: t.detach().clone() for k, t in s.state_dict().items()}, logits


def test_split_checkpoint_loads_like_one_file(saved):
    one, split = saved
    assert len(list(split.glob("model-*.safetensors"))) >= 3
    expected = model()(**KW).logits
    runs = {p: SimulatedRanks(2).run(load, p)
            for p in (one / "model.safetensors", split, split / "model.safetensors.index.json")}
    for rank in range(2):
        a, logits = runs[one / "model.safetensors"][rank]
        for p in (split, split / "model.safetensors.index.json"):
            b, _ = runs[p][rank]
            assert list(a) == list(b)
            for k in a:
                assert torch.equal(a[k], b[k]), (p, rank, k)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    return dst, index


def _rewrite(file, change):
    tensors = safetensors.torch.load_file(file)
    change(tensors)
    safetensors.torch.save_file(tensors, file, metadata={"format": "pt"})


def test_bad_checkpoints_raise_naming_key_and_file(saved, tmp_path):
    _, split = saved
    qkv = "transformer.h.1.attn.c_attn.weight"
    cases = {}

    d, index = _copy(split, tmp_path / "missing")
    file = d / index["weight_map"][qkv]
    _rewrite(file, lambda t: t.pop(qkv))
    cases["missing"] = (d, [qkv, file.name])

    d, index = _copy(split, tmp_path / "unexpected")
    file = d / index["weight_map"][qkv]
    _rewrite(file, lambda t: t.__setitem__("extra.weight", torch.zeros(2)))
    index["weight_map"]["extra.weight"] = file.name
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    cases["unexpected"] = (d, ["extra.weight", file.name])

    d, index = _copy(split, tmp_path / "shape")
    file = d / index["weight_map"][qkv]
    _rewrite(file, lambda t: t.__setitem__(qkv, torch.zeros(64, 191)))
    cases["shape"] = (d, [qkv, file.name, "[64, 191]"])

    d, index = _copy(split, tmp_path / "dtype")
    file = d / index["weight_map"][qkv]
    _rewrite(file, lambda t: t.__setitem__(qkv, torch.zeros(64, 192, dtype=torch.int32)))
    cases["dtype"] = (d, [qkv, file.name, "cast"])

    d, index = _copy(split, tmp_path / "truncated")
    file = d / index["weight_map"][qkv]
    file.write_bytes(file.read_bytes()[:-100])
    cases["truncated"] = (d, [file.name])

    d, index = _copy(split, tmp_path / "no_file")
    file = d / index["weight_map"][qkv]
    file.unlink()
    cases["no_file"] = (d, [file.name, "e.g. for transformer."])  # a key it held

    for case, (path, words) in cases.items():
        for message, callable_after in SimulatedRanks(2).run(load, path):
            for w in words:
                assert w in message, (case, w, message)
            assert not callable_after, case  # nothing half-loaded runs


@pytest.mark.real
@pytest.mark.timeout(240)
@pytest.mark.skipif(sys.platform != "linux", reason="reads peak RSS from /proc (Linux only)")
def test_split_checkpoint_costs_a_rank_its_shard(real_ranks, tmp_path):
    """RssAnon while loading four files through their index: a shard plus one tensor."""
    m = build("gpt-tiny", **CONFIG)
    state = {k: v for k, v in m.state_dict().items() if k != "lm_head.weight"}  # tied: once
    names = list(state)
    weight_map = {}
    for i in range(4):
        part = {k: state[k].contiguous() for k in names[i::4]}
        file = f"model-{i + 1:05d}-of-00004.safetensors"
        safetensors.torch.save_file(part, tmp_path / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    full = sum(p.numel() * p.element_size() for p in m.parameters())
    largest = max(p.numel() * p.element_size() for p in m.parameters())
    del m, state
    for grown, held in real_ranks(2).run(load_peak, str(index)):
        assert held < 0.6 * full
        assert grown >= 0.5 * held
        assert grown <= held + largest + 16 * 2**20, (grown, held, largest, full)
        assert grown < 0.8 * full


def test_parameters_on_meta_keeps_computed_buffers():
    """Parameters on meta, buffers as the constructor computed them (bundled Llama's
    unsaved RoPE tables); another thread meanwhile builds real parameters; nn.Module
    as it was afterwards, also after an error."""
    register = torch.nn.Module.register_parameter
    other = []
    with ck.parameters_on_meta():
        m = build("llama-tiny")
        thread = threading.Thread(target=lambda: other.append(torch.nn.Linear(2, 2)))
        thread.start()
        thread.join()
    assert not other[0].weight.is_meta
    reference = build("llama-tiny")
    assert all(p.is_meta for p in m.parameters())
    buffers = dict(reference.named_buffers())
    assert set(buffers) >= {"rope_cos", "rope_sin"}
    for name, b in m.named_buffers():
        assert not b.is_meta and torch.equal(b, buffers[name]), name
    with pytest.raises(ValueError), ck.parameters_on_meta():
        raise ValueError
    assert torch.nn.Module.register_parameter is register
    assert not torch.nn.Linear(2, 2).weight.is_meta


def test_parameters_on_meta_in_threads_building_at_once():
    """Threads entering and leaving the block while others build models (simulated ranks
    loading a checkpoint): no thread sees another's hook come or go, those inside get
    meta parameters, those outside real ones."""
    start = threading.Barrier(4)
    got, errors = {}, []

    def build_many(i: int):
        try:
            start.wait()
            for _ in range(20):
                with ck.parameters_on_meta() if i % 2 else contextlib.nullcontext():
                    m = build("gpt-tiny", n_layer=2)
                got.setdefault(i, set()).update(p.is_meta for p in m.parameters())
        except Exception as e:  # noqa: BLE001 - reported below, with the thread
            errors.append((i, e))

    threads = [threading.Thread(target=build_many, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert got == {0: {False}, 1: {True}, 2: {False}, 3: {True}}


def pretrained(ctx, path):
    """This rank's logits, greedy tokens and local shapes from ``load_pretrained(path)``."""
    ids = torch.tensor([[5, 6, 7, 8]])
    sharded = ck.load_pretrained(path, group=ctx.group, example_inputs={"input_ids": ids})
    with torch.no_grad():
        logits = sharded(input_ids=ids).logits
    shapes = {k: tuple(t.shape) for k, t in sharded.state_dict().items()}
    return logits, sharded.generate(ids, max_new_tokens=3, do_sample=False), shapes


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_load_pretrained_folder_matches_hf(kind, saved, tmp_path):
    """HF config + several weight files -> a sharded model whose logits and greedy tokens
    are HF's on every rank. Llama's rotary ``inv_freq`` is not saved: it must come from
    the config, not stay on meta."""
    if kind == "gpt2":
        hf, folder = model(), saved[1]
        split = "transformer.h.0.mlp.c_fc.weight"  # Conv1D: (in, out), columns split
        local = {split: (64, 128)}
    else:
        hf, folder = hf_cases.build("llama"), tmp_path / "llama"
        hf.save_pretrained(folder, max_shard_size="20KB")
        local = {"model.layers.0.self_attn.q_proj.weight": (32, 64),
                 "model.layers.1.mlp.down_proj.weight": (64, 48)}
    assert len(list(folder.glob("model-*.safetensors"))) >= 3
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected_logits = hf(input_ids=ids).logits
    expected = hf.generate(ids, max_new_tokens=3, do_sample=False)
    for rank, (logits, tokens, shapes) in enumerate(SimulatedRanks(2).run(pretrained, folder)):
        torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(tokens, expected), (rank, tokens, expected)
        for name, shape in local.items():
            assert shapes[name] == shape, (rank, name, shapes[name])  # sharded, not replicated


@pytest.mark.parametrize("tp, replicas", [(2, (1, 2, 2)), (4, (1, 4, 4)), (4, (1, 2, 2))])
def test_blocks_with_their_own_replica_counts_load_and_chunk(tmp_path, tp, replicas):
    """A fused multi-query QKV (``S(0|8+4+4|x1+r+r)``): each rank reads its rows from a
    full safetensors file through its DCP chunks, and the chunks sit where its rows are in
    the full tensor, the rows counted by hand: query rows ``2r, 2r + 1`` at tp 4
    (``4r..4r+3`` at tp 2), K/V rows split among ``tp / r`` groups."""
    from shardplan.checkpoint.chunks import segments
    from shardplan.layouts import Shard
    from test_checkpoint import read_rank

    full = torch.arange(16 * 3, dtype=torch.float32).view(16, 3)
    safetensors.torch.save_file({"w": full}, tmp_path / "m.safetensors")
    lay = Shard(0, (8, 4, 4), None, replicas)
    for rank in range(tp):
        q = 8 // tp
        kv = 4 * replicas[1] // tp
        g = rank // replicas[1]
        rows = [*range(rank * q, rank * q + q), *range(8 + g * kv, 8 + g * kv + kv),
                *range(12 + g * kv, 12 + g * kv + kv)]
        assert torch.equal(read_rank(tmp_path, lay, (16, 3), rank, tp), full[rows]), rank
        local = full[rows]
        for at, start, n in segments(lay, 16, rank, tp):
            assert torch.equal(local[at:at + n], full[start:start + n]), rank
        assert sum(n for _, _, n in segments(lay, 16, rank, tp)) == len(rows)


# -- Hugging Face folders in and out, on real gloo ---------------------------------------

def hf_rank(ctx, folders: dict, out: str):
    """Per kind: ``load_pretrained`` of a several-file folder at tp 2 (its logits, the
    elements it read per tensor, its local shapes), then ``save_hf`` into ``out/kind``."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    reads: dict[str, int] = {}
    real = HuggingFaceStorageReader._process_read_request

    def spy(self, f, req, planner):
        name = req.storage_index.fqn
        reads[name] = reads.get(name, 0) + int(torch.Size(req.lengths).numel())
        return real(self, f, req, planner)

    HuggingFaceStorageReader._process_read_request = spy
    ids = torch.tensor([[5, 6, 7, 8]])
    got = {}
    try:
        for kind, folder in folders.items():
            reads.clear()
            sharded = ck.load_pretrained(folder, group=ctx.group, example_inputs={"input_ids": ids})
            with torch.no_grad():
                logits = sharded(input_ids=ids).logits
            shapes = {k: tuple(t.shape) for k, t in sharded.state_dict().items()}
            ck.save_hf(sharded, f"{out}/{kind}", shard_bytes=40_000)
            ck.save(sharded, f"{out}/{kind}-ck")
            got[kind] = logits, dict(reads), shapes
    finally:
        HuggingFaceStorageReader._process_read_request = real
    return got


@pytest.mark.real
@pytest.mark.timeout(240)
def test_hf_folders_load_by_slices_and_export_on_real_gloo(real_ranks, tmp_path):
    """GPT-2 and Llama saved by save_pretrained in 3+ files: at tp 2 each rank reads only
    its share of each sharded tensor and computes HF's logits; save_hf writes a folder
    (several files and their index) that from_pretrained loads to the same weights, and
    so does ``shardplan export-hf`` from a checkpoint."""
    import transformers
    models = {"gpt2": model(), "llama": hf_cases.build("llama")}
    folders = {}
    for kind, m in models.items():
        folders[kind] = str(tmp_path / kind)
        m.save_pretrained(folders[kind], max_shard_size="20KB")
        assert len(list((tmp_path / kind).glob("model-*.safetensors"))) >= 3
    results = real_ranks(2).run(hf_rank, folders, str(tmp_path / "out"))
    ids = torch.tensor([[5, 6, 7, 8]])
    for kind, m in models.items():
        with torch.no_grad():
            want = m(input_ids=ids).logits
        sizes = {k: v.numel() for k, v in m.state_dict().items()}
        split = [k for k, shape in results[0][kind][2].items()  # sharded, as stored
                 if k in results[0][kind][1] and torch.Size(shape).numel() < sizes[k]]
        assert len(split) >= 4, split  # it was sharded
        for rank, got in enumerate(results):
            logits, reads, _ = got[kind]
            torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
            for k in split:
                local = torch.Size(got[kind][2][k]).numel()
                assert reads[k] <= local < sizes[k], (kind, rank, k, reads[k], sizes[k])
        for k in split:  # between them, the ranks read each tensor once
            assert sum(r[kind][1][k] for r in results) == sizes[k], (kind, k)
        out = tmp_path / "out" / kind
        assert (out / "model.safetensors.index.json").is_file()
        assert len(list(out.glob("*.safetensors"))) >= 3
        back = type(m).from_pretrained(out).eval()
        assert isinstance(back, transformers.PreTrainedModel)
        mine, theirs = back.state_dict(), m.state_dict()
        assert mine.keys() == theirs.keys()
        for k in theirs:
            assert torch.equal(mine[k], theirs[k]), (kind, k)
        with torch.no_grad():
            assert torch.equal(back(input_ids=ids).logits, want)
    # the command line: a checkpoint -> an HF folder, the config copied from the original
    from shardplan import cli
    out = tmp_path / "cli-llama"
    assert cli.main(["export-hf", str(tmp_path / "out" / "llama-ck"), str(out),
                     "--config", folders["llama"]]) == 0
    back = type(models["llama"]).from_pretrained(out).eval()
    for k, v in models["llama"].state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
