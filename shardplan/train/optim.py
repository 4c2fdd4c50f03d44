"""The optimizer recipe of Megatron-LM's GPT runs, and gradient clipping that is correct under TP.

    opt = build_optimizer(sharded, lr=3e-4)          # AdamW, betas (0.9, 0.95), wd 0.01
    for step in range(total):
        for g in opt.param_groups:
            g["lr"] = lr_schedule(step, lr=3e-4, warmup=100, total=total, min_lr=3e-5)
        loss.backward()
        norm = clip_grad_norm_(sharded, 1.0, dp_group=dp)   # averages over dp, then clips
        opt.step()

**Clipping under tensor parallelism.** The global gradient norm is the norm
of the *unsharded* model's gradient. A rank holds a slice of every sharded
parameter's gradient and the whole of every replicated one, and a replicated
gradient is the same on every TP rank. So each rank sums the squares of what
it *owns* — its slices of sharded gradients, and the replicated gradients on
TP rank 0 only (Megatron's "not a tensor-parallel duplicate") — and one
all-reduce of that scalar over the TP group gives the square of the global
norm, bit-identical on every rank; every rank then applies the same scale.
A slice held by several ranks (``Shard(replicas=r)``: K/V heads fewer than
tp) counts once, on the first rank of its replica group.

**Data parallelism.** Gradients are averaged over the data-parallel group
(``average_gradients``: one flat all-reduce per dtype and device, divided by
the group size) before the norm is taken; afterwards every replica holds the
same gradients, so the norm needs no reduction over data-parallel ranks.
Under FSDP2 (``parallelize(..., fsdp=True)``) the gradients are ``DTensor``
shards over the dp_shard mesh dimension, already averaged by FSDP2's
reduce-scatter (and, with HSDP, its all-reduce over the replicas); the
shards are disjoint, so their squares are summed over the mesh dimensions
the ``DTensor`` is sharded along (one more scalar all-reduce; HSDP's
replicas hold the same shard and are not summed), and each rank scales its
own shard.

**fp16.** ``TPGradScaler`` is ``torch.amp.GradScaler`` with an overflow check
that every rank agrees on (torch's AMP recipe, clipping the unscaled grads)::

    scaler = TPGradScaler("cuda")                     # agrees over the world
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    clip_grad_norm_(sharded, 1.0, dp_group=dp)
    scaler.step(opt)                                  # skipped on every rank, or on none
    scaler.update()
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..errors import ConfigurationError
from ..layouts import MeshDim, Shard, spec_of
from ..runtime.comm import TorchGroup
from ..torch_compat import FusedInfCheck, found_inf_per_device, scale_device

__all__ = ["build_optimizer", "param_groups", "lr_schedule", "cosine_scheduler",
           "clip_grad_norm_", "clip_pipeline_grad_norm_", "average_gradients", "grad_norm",
           "TPGradScaler"]


# --------------------------------------------------------------------------
# AdamW with Megatron's defaults
# --------------------------------------------------------------------------

def _decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay applies to matrices (linear weights, embeddings), not to biases,
    norm weights or any other 1-D (or 0-D) parameter."""
    return p.dim() >= 2 and not name.endswith(".bias") and name != "bias"


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW parameter groups: ``decay`` (>= 2-D weights) and ``no_decay`` (the rest).

    Only parameters that require grad; tied parameters once. Groups that
    would be empty are left out. Each group carries its ``param_names`` (FQNs).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # deduplicates tied parameters
        if p.requires_grad:
            (decay if _decays(name, p) else no_decay).append((name, p))
    groups = []
    for kind, items, wd in (("decay", decay, weight_decay), ("no_decay", no_decay, 0.0)):
        if items:
            groups.append({"params": [p for _, p in items], "weight_decay": wd,
                           "param_names": [n for n, _ in items], "group": kind})
    return groups


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.01,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    **kwargs) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters (a ``ShardedModule``: this rank's shards).

    The paper's recipe: betas (0.9, 0.95), eps 1e-8, weight decay 0.01 on
    weight matrices and embeddings only — biases, norm weights and other
    1-D parameters are not decayed (a sharded bias is still 1-D, so the split
    is the same on every rank). Extra keyword arguments go to ``AdamW``.
    """
    if lr < 0 or weight_decay < 0:
        raise ConfigurationError(f"lr={lr} and weight_decay={weight_decay} must be >= 0")
    groups = param_groups(model, weight_decay)
    if not groups:
        raise ConfigurationError(f"{type(model).__name__} has no parameter that requires grad",
                                 fix="build the optimizer from the model you train")
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             **kwargs)


# --------------------------------------------------------------------------
# learning-rate schedule
# --------------------------------------------------------------------------

def lr_schedule(step: int, *, lr: float, warmup: int, total: int, min_lr: float) -> float:
    """The learning rate of optimizer step ``step`` (0-based).

    Linear warm-up over the first ``warmup`` steps (``lr * (step + 1) / warmup``,
    reaching ``lr`` at step ``warmup - 1``), then a single half-cycle cosine
    from ``lr`` down to ``min_lr``, reached at step ``total`` and kept after it::

        progress = (step - warmup) / (total - warmup)
        lr(step) = min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2
    """
    if warmup < 0 or total < 0 or step < 0:
        raise ConfigurationError(f"step={step}, warmup={warmup}, total={total} must be >= 0")
    if min_lr > lr:
        raise ConfigurationError(f"min_lr={min_lr} is above lr={lr}",
                                 fix="the cosine decays from lr down to min_lr")
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def cosine_scheduler(optimizer: torch.optim.Optimizer, *, warmup: int, total: int,
                     min_lr: float) -> torch.optim.lr_scheduler.LambdaLR:
    """``lr_schedule`` as a ``LambdaLR``: each group's initial lr is its peak.

    Call ``scheduler.step()`` after each ``optimizer.step()``; optimizer step i
    then runs at ``lr_schedule(i, lr=peak, ...)`` (``min_lr`` is absolute).
    """
    peaks = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]

    def factor(peak):
        if peak == 0:
            return lambda step: 0.0
        return lambda step: lr_schedule(step, lr=peak, warmup=warmup, total=total,
                                        min_lr=min(min_lr, peak)) / peak

    return torch.optim.lr_scheduler.LambdaLR(optimizer, [factor(p) for p in peaks])


# --------------------------------------------------------------------------
# data-parallel gradient averaging
# --------------------------------------------------------------------------

def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def average_gradients(params: Iterable[torch.Tensor], dp_group) -> None:
    """Average gradients over the data-parallel group, in place.

    ``dp_group``: a ``torch.distributed`` process group, or a shardplan
    ``Group``. One flat all-reduce per (dtype, device) bucket, then ``/ size``.
    Every rank of the group must hold gradients for the same parameters.
    """
    grads = _grads(params)
    size = _size(dp_group)
    if size == 1 or not grads:
        return
    buckets: dict = {}
    for g in grads:
        if g.is_sparse:
            raise ConfigurationError("sparse gradients cannot be averaged here",
                                     fix="use dense embeddings (sparse=False)")
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for bucket in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        flat = _all_reduce(flat, dp_group, "sum", "data-parallel gradients", "backward")
        flat.div_(size)
        for g, avg in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(avg.view_as(g))


def _size(group) -> int:
    from ..runtime.comm import Group
    if isinstance(group, Group):
        return group.size
    return dist.get_world_size(group)


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _all_reduce(t: torch.Tensor, group, op: str, site: str, direction: str = "none"):
    from ..runtime.comm import Group
    if isinstance(group, Group):
        return group.all_reduce(t, op, direction=direction, site=site)
    dist.all_reduce(t, op=_OPS[op], group=group)
    return t


# --------------------------------------------------------------------------
# global-norm clipping under TP
# --------------------------------------------------------------------------

def _owned(model: nn.Module, copies: frozenset[int] = frozenset()
           ) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    """(every local gradient, the ones this rank counts in the norm, the groups to sum
    over: the TP group if any, and the groups FSDP2's ``DTensor`` gradients are
    sharded over, if they are). ``copies``: ids of parameters another module counts
    (a pipeline's tied copies), scaled but not counted.

    Each parameter's placement comes from its spec (``layouts.spec_of``); a
    parameter without one (a plain module's) is replicated.
    """
    group = getattr(model, "group", None)
    rank = group.rank if group is not None else 0
    every, owned, fsdp_groups = [], [], None
    for p in model.parameters():  # tied parameters once
        if p.grad is None:
            continue
        grad = p.grad
        if isinstance(grad, DTensor):
            fsdp_groups = fsdp_groups if fsdp_groups is not None else _shard_groups(grad)
            grad = grad.to_local()
        every.append(grad)
        if id(p) in copies:
            continue
        spec = spec_of(p)
        lay = spec.layout[MeshDim.TP] if spec is not None else None
        if isinstance(lay, Shard):
            if lay.blocked_replicas:  # each block's slice once, by the first of its ranks
                at = 0
                for n, r in zip(lay.local_blocks(group.size if group else 1), lay.replicas):
                    if rank % r == 0:
                        owned.append(grad.narrow(lay.dim, at, n))
                    at += n
            elif rank % lay.replicas == 0:  # the first rank of the ranks sharing this slice
                owned.append(grad)
        elif rank == 0:  # replicated: the same on every TP rank, counted once
            owned.append(grad)
    groups = [g for g in (group, *(fsdp_groups or ())) if g is not None and g.size > 1]
    return every, owned, groups


def _shard_groups(t: DTensor) -> list[TorchGroup]:
    """The groups along the mesh dimensions ``t`` is sharded over (FSDP2's dp_shard, not
    HSDP's replicas: they hold the same shard)."""
    return [TorchGroup(t.device_mesh.get_group(i)) for i, p in enumerate(t.placements)
            if p.is_shard()]


def grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The global gradient norm of the unsharded model, from this rank's gradients.

    Collective over ``model.group`` (a ``ShardedModule``; a plain module is its
    own whole). Returns a float32 scalar, bit-identical on every TP rank.
    """
    _, owned, groups = _owned(model)
    return _global_norm(owned, groups, float(norm_type), _device(model))


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _global_norm(owned: list[torch.Tensor], groups: list, norm_type: float,
                 device: torch.device) -> torch.Tensor:
    if norm_type == math.inf:
        local = torch.stack([g.detach().abs().max().float() for g in owned]).max() \
            if owned else torch.zeros((), device=device)
        for group in groups:
            local = group.all_reduce(local.reshape(1), "max", site="grad norm").reshape(())
        return local
    if norm_type != 2.0:
        raise ConfigurationError(f"norm_type={norm_type} is not supported",
                                 fix="use 2.0 (the global L2 norm) or math.inf")
    if owned:
        local = torch.stack([torch.linalg.vector_norm(g.detach(), 2, dtype=torch.float32)
                             for g in owned]).square().sum()
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
    for group in groups:
        local = group.all_reduce(local.reshape(1), "sum", site="grad norm").reshape(())
    return local.sqrt()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float = 1.0, *, dp_group=None,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a parallelized model by the global norm; return that norm.

    The norm is the unsharded model's (see the module docstring): sharded
    gradients' squares are summed over the TP group, replicated ones counted
    once. Every rank gets the same norm and applies the same scale,
    ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``
    does. ``dp_group`` (a process group or shardplan ``Group``): average the
    gradients over these data-parallel replicas first. ``max_norm=None`` or
    ``<= 0`` only measures (after averaging). A non-finite norm is returned
    as it is; the gradients are then scaled by a non-finite factor too, as
    torch does — check it before ``optimizer.step()``.
    """
    if dp_group is not None:
        average_gradients(model.parameters(), dp_group)
    every, owned, groups = _owned(model)
    total = _global_norm(owned, groups, float(norm_type), _device(model))
    _scale(every, total, max_norm)
    return total


def _scale(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float | None) -> None:
    """Scale ``grads`` by ``min(1, max_norm / (total + 1e-6))``, as torch's clipping does;
    ``max_norm`` None or <= 0: not at all."""
    if max_norm is None or max_norm <= 0 or not grads:
        return
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))


@torch.no_grad()
def clip_pipeline_grad_norm_(pipe, max_norm: float | None = 1.0, *,
                             norm_type: float = 2.0) -> torch.Tensor:
    """``clip_grad_norm_`` of a pipeline (``parallel.pipeline.Pipeline``): the norm of
    the unsharded model's gradient from every stage. Each rank counts what it owns of
    its stages (its tp shards, replicated gradients on tp rank 0), a parameter held by
    several stages (a tied embedding and head) on the first of them only; the squares
    are summed over the tp group, then over the pp group. Every rank gets the same
    norm and applies the same scale. Collective over the world."""
    every, owned, groups = [], [], []
    copies = frozenset(pipe.copies())
    for module in pipe.modules.values():
        mine, counted, along = _owned(module, copies)
        every += mine
        owned += counted
        groups += [g for g in along if all(g is not h for h in groups)]
    total = _global_norm(owned, [*groups, pipe.pp_group], float(norm_type),
                         next(pipe.parameters()).device)
    _scale(every, total, max_norm)
    return total


# --------------------------------------------------------------------------
# fp16 loss scaling that agrees across ranks
# --------------------------------------------------------------------------

class TPGradScaler(FusedInfCheck, torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/nan check is agreed over ``group``.

    Torch checks only this rank's gradients. Under tensor parallelism they are
    shards: an overflow in one rank's slice is invisible to the others, so that
    rank would skip the step and back off its scale while its peers step —
    replicated parameters drift apart, shards come from different steps, and
    the scales differ from then on. Here ``unscale_`` (which ``step`` calls)
    all-reduces the found-inf flag with MAX over ``group`` after torch's own
    check, so every rank skips, backs off and grows alike. ``group``: a
    ``torch.distributed`` process group or a shardplan ``Group``; ``None``,
    the default group (the whole world: TP ranks must agree, and agreeing
    over data-parallel replicas too costs nothing more). The flag lives on
    the scaler's device (``"cuda"`` for NCCL, ``"cpu"`` for gloo); the
    scaling, growth and back-off are torch's. (torch's ``ShardedGradScaler``
    agrees in ``unscale_`` only, not for an optimizer that unscales itself,
    and over a torch process group only.)
    """

    def __init__(self, device: str = "cuda", *, group=None, **kwargs):
        super().__init__(device, **kwargs)
        if self.is_enabled() and group is None and not dist.is_initialized():
            raise ConfigurationError("TPGradScaler agrees over the default process group, "
                                     "which is not initialized",
                                     fix="call torch.distributed.init_process_group() first, "
                                         "or pass group=")
        self.group = group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if self.is_enabled():
            self.agree_inf(optimizer)

    def agree_inf(self, optimizer) -> dict:
        """Every rank's found-inf flags for ``optimizer`` set to their maximum over
        ``group``; also after the check ``step`` runs instead of ``unscale_`` for an
        optimizer that unscales itself (fused AdamW: ``FusedInfCheck``)."""
        found = found_inf_per_device(self, optimizer)
        flag = torch.zeros(1, dtype=torch.float32, device=scale_device(self))
        for f in found.values():
            flag += f.to(flag.device)
        flag = _all_reduce(flag, self.group, "max", "loss-scaler overflow check")
        for f in found.values():
            f.copy_(flag.reshape(()))
        if not found:  # no gradients here: still step, or skip, with the others
            found[flag.device] = flag.reshape(())
        return found

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether any rank found an inf/nan in this iteration's gradients
        (after ``unscale_``, before ``update``): then ``step`` skips everywhere."""
        if not self.is_enabled():
            return False
        found = found_inf_per_device(self, optimizer)
        if not found:
            raise ConfigurationError("found_inf() outside an iteration's unscale_() .. update()",
                                     fix="call scaler.unscale_(optimizer) first")
        return bool(sum(f.item() for f in found.values()))
