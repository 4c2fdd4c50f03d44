"""Per-rank functions for tests/test_pipeline.py (picklable for RealRanks): pp=2 on 2
gloo processes, the global batch through the pipeline on every rank."""

from __future__ import annotations

import copy

import torch

from shardplan.parallel.pipeline import lm_loss, pipeline_parallel
from shardplan.parallel_dims import ParallelDims

STEPS, LR, ROWS, SEQ = 3, 1e-2, 4, 8


def batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch (inputs, targets) per step."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, vocab, (ROWS, SEQ), generator=g),
             torch.randint(0, vocab, (ROWS, SEQ), generator=g)) for _ in range(STEPS)]


def logits_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of a Hugging Face model's output's logits, or of the logits the
    last stage returns (the tracer's one-element output, unwrapped by the stage)."""
    return lm_loss(output if isinstance(output, torch.Tensor) else output.logits, targets)


def reference(model, data, loss_fn=None) -> tuple[list[float], dict]:
    """One process, the unsharded model, AdamW on the global batches: (losses, state dict).
    The loss is the model's own (``model(x, y)[1]``), or ``loss_fn(model(x), y)``."""
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = m(x, y)[1] if loss_fn is None else loss_fn(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, m.state_dict()


def train_rank(ctx, model, data, schedule: str, microbatches: int):
    """AdamW steps through the pipeline: (losses broadcast to this rank, the loss
    ``step`` returns here without broadcasting, this rank's parameters by FQN, the
    stages it holds, whether ``model`` was left as it was, the planner's estimate of
    the parameter elements of this rank's stages)."""
    dims = ParallelDims(pp=ctx.world_size).with_mesh("cpu")
    pipe = pipeline_parallel(model, data[0][0], dims=dims, microbatches=microbatches,
                             schedule=schedule)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses, local = [], None
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        if i == 0:
            local = pipe.step(x, y)
            opt.zero_grad()
        losses.append(pipe.step(x, y, broadcast_loss=True).item())
        opt.step()
    untouched = all("_orig_forward" not in vars(m) for m in model.modules())
    return (losses, None if local is None else local.item(),
            {n: p.detach() for n, p in pipe.named_parameters()}, sorted(pipe.modules), untouched,
            estimated_elements(pipe, ctx.rank))


def train_tp_rank(ctx, model, data, schedule: str, microbatches: int, tp: int,
                  tied: tuple[str, ...], loss_fn=lm_loss):
    """AdamW steps through a pipeline of ``world / tp`` stages, each sharded over ``tp``
    ranks: (losses broadcast to this rank, this rank's parameters by FQN, their layouts
    over the tp group, the stages it holds, this rank's shard of each ``tied`` FQN its
    stages hold, after every step, the planner's estimate of the parameter elements of
    this rank's stages)."""
    dims = ParallelDims(pp=ctx.world_size // tp, tp=tp).with_mesh("cpu")
    pipe = pipeline_parallel(model, data[0][0], dims=dims, microbatches=microbatches,
                             schedule=schedule, loss_fn=loss_fn)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses, tied_steps = [], []
    for x, y in data:
        opt.zero_grad()
        losses.append(pipe.step(x, y, broadcast_loss=True).item())
        opt.step()
        tied_steps.append({n: t.detach().clone() for m in pipe.modules.values()
                           for n, t in m.rank_tensors.items() if n in tied})
    layouts = {n: str(lay) for m in pipe.modules.values() for n, lay in m.layouts.items()}
    return (losses, {n: p.detach() for n, p in pipe.named_parameters()}, layouts,
            sorted(pipe.modules), tied_steps, estimated_elements(pipe, ctx.rank // tp))


def estimated_elements(pipe, pp_rank: int) -> int:
    """The parameter elements per rank the planner estimated for ``pp_rank``'s stages."""
    return sum(s.params for s in pipe.estimate.stages if s.pp_rank == pp_rank)
