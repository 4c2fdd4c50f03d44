"""TP x FSDP2 (``parallelize(mesh=, fsdp=True)``) and torch DCP checkpoints.

Training runs are on 4 gloo processes as a (dp_shard=2, tp=2) mesh, and HSDP as
(dp_replicate=2, dp_shard=2, tp=1), and must match one process training the
unsharded model on the global batch; checkpoints saved there load at other
layouts (tp=4, tp=1, without FSDP2) and into the plain model.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate as DTensorReplicate, Shard as DTensorShard
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_cases as cases
import hf_cases
import train_cases
import shardplan
from shardplan import ConfigurationError
from shardplan.layouts import Shard
from shardplan.models import build

RTOL = 1e-5


def close(actual, expected, what):
    for i, (a, b) in enumerate(zip(actual, expected, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"{what} at step {i + 1}: {a} vs {b}"


MODELS = {"gpt": lambda: hf_cases.nonzero_biases(build("gpt-tiny")), "llama": lambda: build("llama-tiny"),
          "hf-gpt2": lambda: hf_cases.build("gpt2"), "hf-llama": lambda: hf_cases.build("llama")}


@pytest.mark.real
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(MODELS))
def test_fsdp_trains_like_one_process(real_ranks, name):
    torch.manual_seed(0)
    model = MODELS[name]()
    vocab = max(m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding))
    data = cases.batches(vocab)
    want_norms = []
    expected, _ = cases.reference(model, data, want_norms)
    assert min(want_norms) > 1.5 * cases.CLIP, want_norms  # clipping scales every step
    runs = real_ranks(4).run(cases.train_rank, model, data)
    unsharded = 2 * sum(p.numel() for p in model.parameters())  # AdamW: two moments
    blocks = _blocks(model)
    for rank, (losses, dtensors, state, units, elements, layouts, norms) in enumerate(runs):
        close(losses, expected, f"rank {rank}")
        close([before for before, _ in norms], want_norms, f"rank {rank}'s gradient norm")
        close([after for _, after in norms], [cases.CLIP] * len(norms),
              f"rank {rank}'s clipped gradient norm")
        assert dtensors, f"rank {rank}: not every parameter is a DTensor"
        assert state <= 0.3 * unsharded, f"rank {rank} holds {state} of {unsharded} state"
        assert units == ["", *blocks], f"rank {rank}: the FSDP2 units are {units}"
        want, slack = _rank_elements(model, layouts, dp=2, tp=2)
        got = sum(elements.values())
        assert abs(got - want) <= slack, f"rank {rank} holds {got} elements, not {want}"


def _blocks(model) -> list[str]:
    """The FQN of every block: each entry of the model's layer list."""
    return [f"{name}.{i}" for name, m in model.named_modules()
            if isinstance(m, torch.nn.ModuleList) for i in range(len(m))]


def _rank_elements(model, layouts, dp: int, tp: int) -> tuple[float, int]:
    """The parameter elements one rank should hold: each parameter's full elements over
    dp (and over tp where TP splits it); and the most the padding may add or take (the
    TP-padded vocabulary rows, FSDP2's uneven last chunk): two rows per parameter."""
    want, slack = 0.0, 0
    for name, p in model.named_parameters():
        ways = dp * tp if isinstance(layouts[name], Shard) else dp
        want += p.numel() / ways
        slack += 2 * (p.numel() // p.shape[0])
    return want, slack


@pytest.mark.real
@pytest.mark.timeout(180)
@pytest.mark.parametrize("replicate,shard,tp", [(2, 2, 1), (1, 2, 2)],
                         ids=["replicate2-shard2-tp1", "shard2-tp2"])
def test_hsdp_trains_like_one_process(real_ranks, replicate, shard, tp):
    """A few AdamW steps on (dp_replicate x dp_shard) x tp: the losses and every
    parameter afterwards equal one process's on the global batch, on every rank; and it
    was sharded: each block an FSDP2 unit, the parameters DTensors over the data-parallel
    mesh (HSDP: replicated along dp_replicate, sharded along dp_shard), each rank holding
    about 1/(dp_shard * tp) of the bytes, replicas along dp_replicate the same shards."""
    torch.manual_seed(0)
    model = build("gpt-tiny")
    data = cases.batches(96)
    expected, state = cases.reference(model, data)
    runs = real_ranks(4).run(cases.hsdp_rank, model, data, replicate, shard, tp)
    names = {n for n, _ in model.named_parameters()}
    mesh = ("dp_replicate", "dp_shard") if replicate > 1 else ("dp_shard",)
    placements = (DTensorReplicate(), DTensorShard(0)) if replicate > 1 else (DTensorShard(0),)
    ideal = sum(p.numel() * p.element_size() for p in model.parameters()) / (shard * tp)
    for rank, (losses, params, local, units, placed) in enumerate(runs):
        close(losses, expected, f"rank {rank}")
        assert set(params) == names, rank
        for name, t in params.items():
            torch.testing.assert_close(t, state[name], rtol=0, atol=1e-4, msg=f"{rank} {name}")
        assert units == ["", "transformer.h.0", "transformer.h.1"], rank
        assert set(placed.values()) == {(mesh, placements)}, rank
        held = sum(t.numel() * t.element_size() for t in local.values())
        assert abs(held - ideal) <= 0.1 * ideal, (rank, held, ideal)
    per_replica = 4 // replicate  # ranks of one replica: rank = replica * per_replica + ...
    for rank in range(per_replica, 4):
        twin = runs[rank - per_replica][2]
        for name, t in runs[rank][2].items():
            assert torch.equal(t, twin[name]), f"rank {rank} {name} is not its replica's"
    first, next_shard = runs[0][2], runs[tp][2]  # dp_shard ranks 0 and 1 of replica 0
    assert any(not torch.equal(first[n], next_shard[n]) for n in first), "shards are equal"


@pytest.fixture(scope="module")
def saved(real_ranks, tmp_path_factory):
    """gpt-tiny trained 3 steps at (dp=2, tp=2) with FSDP2, saved with its optimizer, then
    trained 3 more steps: the losses of all 6 steps."""
    torch.manual_seed(0)
    model = build("gpt-tiny")
    data = cases.batches(96)
    path = tmp_path_factory.mktemp("dcp") / "ck"
    losses = real_ranks(4).run(cases.save_rank, model, data, str(path))
    return model, data, path, losses


def _torch_file(path, tmp_path, name):
    dcp_to_torch_save(path, tmp_path / name)
    return torch.load(tmp_path / name, weights_only=False)


@pytest.mark.real
@pytest.mark.timeout(120)
def test_dcp_loads_into_the_plain_model(saved, tmp_path):
    model, data, path, losses = saved
    expected_losses, expected = cases.reference(model, data)
    for rank, got in enumerate(losses):
        close(got[:3], expected_losses, f"rank {rank}")
    state = _torch_file(path, tmp_path, "ck.pt")
    plain = build("gpt-tiny")
    plain.load_state_dict(state["model"], strict=True)
    for name, t in plain.state_dict().items():
        torch.testing.assert_close(t, expected[name], rtol=0, atol=1e-4, msg=name)
    assert set(state["optim"]["state"]) <= set(state["model"])


@pytest.mark.real
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp,tp,fsdp", [(1, 4, False), (4, 1, False), (2, 2, True)])
def test_dcp_reshards_and_resumes(real_ranks, saved, tmp_path, dp, tp, fsdp):
    """Loading at another layout holds the same tensors (saved again, they are equal to
    the last bit) and training continues the loss curve; at the saving layout, exactly
    as the uninterrupted run did."""
    model, data, path, uninterrupted = saved
    again = tmp_path / "again"
    runs = real_ranks(4).run(cases.reload_rank, model, data, str(path), dp, tp, fsdp,
                             str(again), data)
    first, second = _torch_file(path, tmp_path, "a.pt"), _torch_file(again, tmp_path, "b.pt")
    torch.testing.assert_close(second["model"], first["model"], rtol=0, atol=0)
    torch.testing.assert_close(second["optim"]["state"], first["optim"]["state"], rtol=0, atol=0)
    assert second["optim"]["param_groups"] == first["optim"]["param_groups"]
    expected, _ = cases.reference(model, data + data)
    for rank, losses in enumerate(runs):
        close(losses, expected[3:], f"rank {rank}")
        if (dp, tp, fsdp) == (2, 2, True):
            assert losses == uninterrupted[rank][3:], f"rank {rank}"


@pytest.mark.real
@pytest.mark.timeout(120)
def test_a_save_that_dies_leaves_the_previous_checkpoint(real_ranks, saved, tmp_path):
    """The first save holds the fresh model: loaded after the failed save, it trains as
    the fresh model did."""
    model, data, _, fresh = saved
    runs = real_ranks(4).run(cases.crashed_save_rank, model, data, str(tmp_path / "ck"))
    for rank, (error, losses) in enumerate(runs):
        assert error and "CheckpointError" in error and "injected" in error, f"rank {rank}"
        assert losses == fresh[rank][:3], f"rank {rank}"
    assert (tmp_path / "ck" / ".metadata").is_file()


# -- bad input, on torch's in-process fake process group -----------------------------------

@contextlib.contextmanager
def fake_world(size: int):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mesh(shape, names):
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


@pytest.mark.parametrize("make,fsdp,match", [
    (lambda: _mesh((2, 2), ("dp", "pp")), True, "needs a 'tp' dimension"),
    (lambda: _mesh((4,), ("tp",)), True, "fsdp needs a device mesh with a 'dp_shard'"),
    (lambda: None, True, "fsdp needs a device mesh"),
    (lambda: DeviceMesh("cpu", torch.tensor([[0, 1]]), mesh_dim_names=("dp", "tp")), True,
     "the world has 4"),
    (lambda: _mesh((2, 2), ("dp", "tp")), {"bucket": 1}, "fully_shard options"),
])
def test_bad_fsdp_input(make, fsdp, match):
    with fake_world(4):
        with pytest.raises(ConfigurationError, match=match) as e:
            shardplan.parallelize(build("gpt-tiny"), mesh=make(), fsdp=fsdp, check_model=False)
    assert e.value.fix


# -- python -m shardplan.train --fsdp ------------------------------------------------------

@pytest.mark.real
@pytest.mark.timeout(120)
def test_trainer_fsdp_equals_unsharded_and_resumes_exactly(real_ranks, tmp_path):
    cfg = dict(train_cases.BASE, steps=6, fsdp=True)
    first = dict(cfg, save=str(tmp_path / "ck"), save_every=3)
    second = dict(cfg, resume=str(tmp_path / "ck" / "step-00000003"))
    runs = real_ranks(4).run(train_cases.resume_rank, first, second)
    full, resumed = runs[0]
    want, _ = train_cases.reference_losses(cfg, dp=2)
    close(full, want, "loss")
    assert resumed == full[3:], (resumed, full[3:])
    assert all(r == runs[0] for r in runs)
    assert (tmp_path / "ck" / "step-00000006" / ".metadata").is_file()


@pytest.mark.real
@pytest.mark.timeout(180)
def test_trainer_hsdp_equals_unsharded(real_ranks):
    """``--dp-replicate 2 --dp-shard 2 --tp 1``: HSDP in the trainer (its replica check
    compares the shards along dp_replicate every 3 steps), the losses of one process on
    the global batch of 4 data-parallel ranks."""
    cfg = dict(train_cases.BASE, steps=4, tp=1, dp=None, dp_replicate=2, dp_shard=2,
               check_replicas_every=3)
    runs = real_ranks(4).run(train_cases.train_rank, cfg)
    want, _ = train_cases.reference_losses(cfg, dp=4)
    close(runs[0], want, "loss")
    assert all(r == runs[0] for r in runs)


@pytest.mark.real
@pytest.mark.timeout(600)
def test_compiled_per_block_equals_eager(real_ranks):
    """``compile=`` with ``fsdp=``: each FSDP2 block's piece of the graph is compiled
    (one graph each, no break), here with recompute (each block also checkpointed), and
    two training steps give the eager run's losses and parameter shards on every rank;
    both equal one process training the unsharded model. (Without recompute the pieces
    are the same blocks; one 4-rank run is what this test can afford.)"""
    torch.manual_seed(0)
    model = build("gpt-tiny")
    data = cases.batches(96)[:2]
    expected, _ = cases.reference(model, data)
    blocks = ["transformer.h.0", "transformer.h.1"]
    runs = real_ranks(4).run(cases.compile_rank, model, data, True)
    for rank, (eager, compiled, eager_shards, shards, units, graphs, breaks) in enumerate(runs):
        close(compiled, expected, f"rank {rank}")
        close(compiled, eager, f"rank {rank} vs eager")
        assert (units, graphs, breaks) == (blocks, 2, 0), rank
        for name, p in eager_shards.items():
            torch.testing.assert_close(shards[name], p, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.real
@pytest.mark.timeout(120)
def test_fsdp_options_recompute_and_another_call_signature(real_ranks, saved):
    model, data, _, fsdp_losses = saved
    for rank, (losses, shape) in enumerate(real_ranks(4).run(cases.options_rank, model, data)):
        assert losses == fsdp_losses[rank][:3], f"rank {rank}"
        assert shape == (2, 8, 96)


@pytest.mark.real
@pytest.mark.timeout(180)
def test_dcp_padded_vocabulary_and_shared_kv_heads(real_ranks, tmp_path):
    """HF Llama: a vocabulary of 101 is padded at tp=2 and tp=4, and its 2 K/V heads are
    shared by pairs of ranks at tp=4. Saved at (dp=2, tp=2), loaded at tp=4 and saved
    again: the same tensors; and the file loads strictly into the plain model."""
    model = hf_cases.build("llama")
    data = cases.batches(hf_cases.VOCAB)
    path, again = tmp_path / "ck", tmp_path / "again"
    real_ranks(4).run(cases.save_rank, model, data, str(path))
    runs = real_ranks(4).run(cases.reload_rank, model, data, str(path), 1, 4, False,
                             str(again), data[:1])
    expected, _ = cases.reference(model, data + data)
    for rank, losses in enumerate(runs):
        close(losses, expected[3:4], f"rank {rank}")
    first, second = _torch_file(path, tmp_path, "a.pt"), _torch_file(again, tmp_path, "b.pt")
    torch.testing.assert_close(second["model"], first["model"], rtol=0, atol=0)
    plain = hf_cases.build("llama")
    plain.load_state_dict(first["model"], strict=True)
