"""Per-rank functions for tests/test_fsdp.py (picklable for RealRanks).

Runs are on 4 gloo processes; the mesh is ``ParallelDims``' (dp_replicate, dp_shard, tp)
with rank = dp_rank * tp + tp_rank. Each data-parallel rank trains on its rows of every
global batch.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import shardplan
from shardplan.checkpoint import load, save
from shardplan.layouts import MeshDim, Shard, spec_of
from shardplan.parallel_dims import ParallelDims
from shardplan.train.optim import average_gradients, clip_grad_norm_

STEPS, LR, CLIP = 3, 1e-2, 0.5


def batches(vocab: int, rows: int = 4, seq: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch (inputs, targets) per step."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, vocab, (rows, seq), generator=g),
             torch.randint(0, vocab, (rows, seq), generator=g)) for _ in range(STEPS)]


def loss_of(model, x, y) -> torch.Tensor:
    if type(model).__module__.startswith("transformers") or getattr(model, "_hf", False):
        return model(input_ids=x, labels=y).loss
    return model(x, y)[1]


def reference(model, data, norms: list | None = None) -> tuple[list[float], dict]:
    """One process, the unsharded model, the global batches: (losses, final state dict);
    each step's gradient norm before clipping appended to ``norms``."""
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_of(m, x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        if norms is not None:
            norms.append(norm.item())
        opt.step()
        losses.append(loss.item())
    return losses, m.state_dict()


def _dims(dp: int, tp: int, fsdp) -> ParallelDims:
    """dp data-parallel ranks (FSDP2's shards with ``fsdp``, else replicas) x tp."""
    sizes = ParallelDims.data_parallel(dp=dp, fsdp=bool(fsdp))
    return ParallelDims(tp=tp, **{k: v or 1 for k, v in sizes.items()})


def _setup(model, data, dims: ParallelDims, fsdp):
    dims = dims.with_mesh("cpu")
    x0, y0 = data[0]
    rows = x0.shape[0] // dims.dp
    r = dims.dp_rank
    mine = slice(r * rows, (r + 1) * rows)
    hf = type(model).__module__.startswith("transformers")
    example = {"input_ids": x0[mine], "labels": y0[mine]} if hf else (x0[mine], y0[mine])
    sharded = shardplan.parallelize(copy.deepcopy(model), mesh=dims.mesh, fsdp=fsdp,
                                    example_inputs=example)
    sharded._hf = hf
    return sharded, torch.optim.AdamW(sharded.parameters(), lr=LR), mine, dims


def _steps(sharded, opt, data, mine, dims: ParallelDims, norms: list | None = None) -> list[float]:
    """Train on ``data``; the global batch's loss per step (the mean over dp ranks); each
    step's global gradient norm before and after clipping appended to ``norms`` (the
    second measured again over every rank's shards)."""
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_of(sharded, x[mine], y[mine])
        loss.backward()
        if not sharded.fsdp_blocks and dims.dp_replicate > 1:
            average_gradients(sharded.parameters(), dims.group(MeshDim.DP_REPLICATE))
        norm = clip_grad_norm_(sharded, CLIP)
        if norms is not None:
            norms.append((norm.item(), clip_grad_norm_(sharded, None).item()))
        opt.step()
        total = loss.detach().clone()
        for group in dims.dp_groups:
            dist.all_reduce(total, group=group.pg)
        losses.append(total.item() / dims.dp)
    return losses


@torch.no_grad()
def _full_parameters(sharded) -> dict[str, torch.Tensor]:
    """Every parameter's full, unpadded tensor, on every rank: FSDP2's shards gathered
    (``full_tensor``), then the TP shards (each parameter's spec)."""
    out = {}
    for name, p in sharded.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        spec = spec_of(p)
        lay = spec.layout[MeshDim.TP]
        if isinstance(lay, Shard):
            parts = sharded.group.all_gather(t.unsqueeze(0), 0).unbind(0)
            t = lay.unshard(list(parts), spec.shape[lay.dim])
        out[name] = t.clone()
    return out


def train_rank(ctx, model, data, fsdp=True):
    """TP x FSDP2 at (dp=2, tp=2): (losses, whether every parameter is a DTensor,
    this rank's optimizer state elements, the FQN of every module that is an FSDP2
    unit, this rank's parameter elements by FQN, the TP layouts, each step's gradient
    norm before and after clipping)."""
    sharded, opt, mine, dims = _setup(model, data, _dims(2, 2, fsdp), fsdp)
    norms = []
    losses = _steps(sharded, opt, data, mine, dims, norms)
    dtensors = all(isinstance(p, DTensor) for p in sharded.parameters())
    state = sum(t.to_local().numel() if isinstance(t, DTensor) else t.numel()
                for s in opt.state.values() for k, t in s.items() if k != "step")
    units = [fqn for fqn, m in sharded.named_modules() if isinstance(m, FSDPModule)]
    elements = {n: (p.to_local() if isinstance(p, DTensor) else p).numel()
                for n, p in sharded.named_parameters()}
    return losses, dtensors, state, units, elements, sharded.layouts, norms


def hsdp_rank(ctx, model, data, dp_replicate: int, dp_shard: int, tp: int):
    """FSDP2 on (dp_replicate x dp_shard) x tp (HSDP when dp_replicate > 1): (losses,
    every parameter's full tensor after the steps, this rank's local shards, the FQNs of
    the FSDP2 units, each parameter's (DTensor mesh dims, placements))."""
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
    sharded, opt, mine, dims = _setup(model, data, dims, True)
    losses = _steps(sharded, opt, data, mine, dims)
    local = {n: p.to_local().detach().clone() for n, p in sharded.named_parameters()}
    units = [n for n, m in sharded.named_modules() if isinstance(m, FSDPModule)]
    placed = {n: (p.device_mesh.mesh_dim_names, tuple(p.placements))
              for n, p in sharded.named_parameters()}
    return losses, _full_parameters(sharded), local, units, placed


def save_rank(ctx, model, data, path):
    """Train at (dp=2, tp=2) with FSDP2, save with the optimizer, train on ``data`` again:
    the losses of all the steps."""
    sharded, opt, mine, dims = _setup(model, data, _dims(2, 2, True), True)
    losses = _steps(sharded, opt, data, mine, dims)
    save(sharded, path, optimizer=opt)
    return losses + _steps(sharded, opt, data, mine, dims)


def reload_rank(ctx, model, data, path, dp, tp, fsdp, again, steps):
    """Load ``path`` at (dp, tp), save it to ``again``, train on ``steps``: the losses."""
    sharded, opt, mine, dims = _setup(model, data, _dims(dp, tp, fsdp), fsdp)
    load(sharded, path, optimizer=opt)
    save(sharded, again, optimizer=opt)
    return _steps(sharded, opt, steps, mine, dims)


def crashed_save_rank(ctx, model, data, path):
    """Save the fresh model, train a step, save again with rank 1's writes failing:
    (the error, the losses of training after loading what is at ``path`` now)."""
    from torch.distributed.checkpoint import FileSystemWriter
    sharded, opt, mine, dims = _setup(model, data, _dims(2, 2, True), True)
    save(sharded, path, optimizer=opt)
    _steps(sharded, opt, data[:1], mine, dims)
    write = FileSystemWriter.write_data
    if ctx.rank == 1:
        def broken(self, plan, planner):
            raise OSError("disk full (injected)")
        FileSystemWriter.write_data = broken
    try:
        save(sharded, path, optimizer=opt)
        error = None
    except Exception as e:  # every rank must raise
        error = f"{type(e).__name__}: {e}"
    finally:
        FileSystemWriter.write_data = write
    fresh, fresh_opt, _, _ = _setup(model, data, _dims(2, 2, True), True)
    load(fresh, path, optimizer=fresh_opt)
    return error, _steps(fresh, fresh_opt, data, mine, dims)


def options_rank(ctx, model, data):
    """FSDP2 with ``reshard_after_forward=False`` and recomputed blocks, on a ("dp", "tp")
    mesh of before HSDP (its "dp" is FSDP2's dp_shard): the losses, then the shape of the
    logits of another call signature (eval, no targets)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    r = mesh.get_local_rank("dp")
    mine = slice(2 * r, 2 * r + 2)
    x0, y0 = data[0]
    sharded = shardplan.parallelize(copy.deepcopy(model), mesh=mesh, recompute=True,
                                    fsdp={"reshard_after_forward": False},
                                    example_inputs=(x0[mine], y0[mine]))
    losses = _steps(sharded, torch.optim.AdamW(sharded.parameters(), lr=LR), data, mine,
                    ParallelDims.from_mesh(mesh, fsdp=True))
    sharded.eval()
    with torch.no_grad():
        logits, _ = sharded(x0[mine])
    return losses, tuple(logits.shape)


def compile_rank(ctx, model, data, recompute: bool):
    """TP x FSDP2 at (dp=2, tp=2), eager and compiled (``aot_eager``): (eager losses,
    compiled losses, this rank's parameter shards after the steps eager and compiled,
    the FQNs of the blocks whose pieces were compiled, graphs compiled, graph breaks)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import DTensor
    from shardplan.parallel.fsdp import OwnedPiece
    from shardplan.planner.recompute import Recomputed
    torch._dynamo.reset()
    counters.clear()
    runs = []
    for compiled in (False, "aot_eager"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        r = mesh.get_local_rank("dp")
        mine = slice(2 * r, 2 * r + 2)
        x0, y0 = data[0]
        sharded = shardplan.parallelize(copy.deepcopy(model), mesh=mesh, fsdp=True,
                                        recompute=recompute, compile=compiled,
                                        example_inputs=(x0[mine], y0[mine]))
        losses = _steps(sharded, torch.optim.AdamW(sharded.parameters(), lr=LR), data,
                        mine, ParallelDims.from_mesh(mesh, fsdp=True))
        shards = {n: p.to_local().detach().clone() if isinstance(p, DTensor) else p
                  for n, p in sharded.named_parameters()}
        runs.append((losses, shards))
    blocks = {}  # each block's graph piece -> the block's FQN
    for m in sharded.graph_module.modules():
        if isinstance(m, OwnedPiece):
            inner = m.piece.block if isinstance(m.piece, Recomputed) else m.piece
            blocks[id(inner)] = m.block
    units = next(iter(sharded.compiled_units.values()))
    return (runs[0][0], runs[1][0], runs[0][1], runs[1][1],
            [blocks.get(id(u), "not a block") for u in units],
            counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
