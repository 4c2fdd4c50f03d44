"""Per-rank functions for tests/test_fsdp.py and tests/test_dcp.py (picklable for RealRanks).

Every run is on 4 gloo processes as a (dp=2, tp=2) mesh: rank = dp_rank * 2 + tp_rank.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardplan
from shardplan.train.optim import clip_grad_norm_

STEPS, LR, CLIP = 3, 1e-2, 0.5


def mesh(dp: int = 2, tp: int = 2):
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def batches(vocab: int, rows: int = 4, seq: int = 8):
    """One global batch per step: (inputs, targets)."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, vocab, (rows, seq), generator=g),
             torch.randint(0, vocab, (rows, seq), generator=g)) for _ in range(STEPS)]


def loss_of(model, x, y):
    """The bundled models return (logits, loss); Hugging Face ones an output with .loss."""
    if hasattr(model, "config") and hasattr(model.config, "model_type") or \
            getattr(model, "_hf", False):
        return model(input_ids=x, labels=y).loss
    return model(x, y)[1]


def reference(model, data, clip=CLIP):
    """The unsharded model trained by one process on the global batches: the losses."""
    m = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = _loss(m, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def _loss(model, x, y):
    out = model(input_ids=x, labels=y) if _is_hf(model) else model(x, y)
    return out.loss if _is_hf(model) else out[1]


def _is_hf(model) -> bool:
    return type(model).__module__.startswith("transformers")


def fsdp_train_rank(ctx, model, data, options=True):
    """TP x FSDP2 on this rank's rows of each global batch: (losses, whether every
    parameter is a DTensor, this rank's optimizer state elements)."""
    torch.manual_seed(0)
    m = mesh()
    x0, y0 = data[0]
    rows = x0.shape[0] // 2
    mine = slice(m.get_local_rank("dp") * rows, (m.get_local_rank("dp") + 1) * rows)
    example = {"input_ids": x0[mine], "labels": y0[mine]} if _is_hf(model) else (x0[mine], y0[mine])
    sharded = shardplan.parallelize(copy.deepcopy(model).train(), mesh=m, fsdp=options,
                                    example_inputs=example)
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = _loss(sharded, x[mine], y[mine])
        loss.backward()
        clip_grad_norm_(sharded, CLIP)
        opt.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=m.get_group("dp"))
        losses.append(total.item() / 2)
    dtensors = all(isinstance(p, DTensor) for p in sharded.parameters())
    state = sum(t.to_local().numel() if isinstance(t, DTensor) else t.numel()
                for s in opt.state.values() for k, t in s.items() if k != "step")
    return losses, dtensors, state


def train_and_save_rank(ctx, model, data, path, fsdp=True):
    """Train 3 steps at (dp=2, tp=2), save a DCP checkpoint with the optimizer: the losses."""
    import shardplan.checkpoint as ck
    m = mesh()
    sharded, opt, mine = _setup(model, data, m, fsdp)
    losses = _steps(sharded, opt, data, mine, m)
    ck.save_dcp(sharded, path, optimizer=opt)
    return losses


def _setup(model, data, m, fsdp):
    torch.manual_seed(0)
    x0, y0 = data[0]
    dp = m.size(0)
    rows = x0.shape[0] // dp
    r = m.get_local_rank("dp")
    mine = slice(r * rows, (r + 1) * rows)
    example = {"input_ids": x0[mine], "labels": y0[mine]} if _is_hf(model) else (x0[mine], y0[mine])
    sharded = shardplan.parallelize(copy.deepcopy(model).train(), mesh=m, fsdp=fsdp,
                                    example_inputs=example)
    return sharded, torch.optim.AdamW(sharded.parameters(), lr=LR), mine


def _steps(sharded, opt, data, mine, m):
    from shardplan.train.optim import average_gradients
    fsdp = bool(sharded.fsdp_blocks)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = _loss(sharded, x[mine], y[mine])
        loss.backward()
        if not fsdp:
            average_gradients(sharded.parameters(), m.get_group("dp"))
        clip_grad_norm_(sharded, CLIP)
        opt.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=m.get_group("dp"))
        losses.append(total.item() / m.size(0))
    return losses


def load_and_train_rank(ctx, model, data, path, dp, tp, fsdp):
    """Load the checkpoint at (dp, tp), train the same 3 steps again: the losses and the
    gathered full state dict (rank 0)."""
    import shardplan.checkpoint as ck
    m = mesh(dp, tp)
    sharded, opt, mine = _setup(model, data, m, fsdp)
    ck.load_dcp(sharded, path, optimizer=opt)
    return _steps(sharded, opt, data, mine, m)
