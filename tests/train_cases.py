"""Per-rank functions and references for tests/test_train.py (picklable for RealRanks)."""

from __future__ import annotations

import copy
import functools

import torch

import shardplan
from shardplan.models import build
from shardplan.train.optim import TPGradScaler, build_optimizer, clip_grad_norm_, lr_schedule
from shardplan.planner.rules import load_rules
from shardplan.runtime.random import set_rng_tracker
from shardplan.sharded import ShardedModule
from shardplan.errors import NonFiniteError
from shardplan.train.trainer import (TokenData, Trainer, TrainConfig, build_model, train,
                                     training_step)


# One small run: dp 2 x tp 2, 2 sequences of 16 bytes per replica and step, dropout 0.
BASE = dict(model="gpt-tiny", tp=2, dp=2, batch_size=2, seq_len=16, lr=3e-3, warmup=3,
            min_lr=3e-4, clip=1.0, weight_decay=0.01, seed=5, dropout=0.0, log_every=0,
            check_replicas_every=5)


def rel_close(actual, expected, rtol, what):
    for i, (a, b) in enumerate(zip(actual, expected, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{what} at step {i + 1}: {a} vs {b}"


def isolated(fn):
    """Run ``fn`` with the worker's CPU RNG restored and no tracker left (pools are shared)."""
    @functools.wraps(fn)  # pickles by name, as the module-level function it replaces
    def wrapper(ctx, *args):
        try:
            with torch.random.fork_rng(devices=[]):
                return fn(ctx, *args)
        finally:
            set_rng_tracker(None)
    return wrapper


# -- clipping on simulated ranks ---------------------------------------------------------

def clip_rank(ctx, model, captured, x, y, scale, max_norms, norm_type):
    """Per max norm: the norm and this rank's clipped local gradients, of ``scale * loss``.

    The sharded module is built from one capture made by the caller (export is
    the slow part, and simulated ranks would take turns at it).
    """
    sharded = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(), example=((x, y), {}),
                            gather_output=True, strict=False, captured=copy.deepcopy(captured))
    _, loss = sharded(x, y)
    (scale * loss).backward()
    params = dict(sharded.named_parameters())
    raw = {n: p.grad.detach().clone() for n, p in params.items()}
    out = []
    for max_norm in max_norms:
        for n, p in params.items():
            p.grad.copy_(raw[n])
        norm = clip_grad_norm_(sharded, max_norm, norm_type=norm_type)
        out.append((norm, {n: p.grad.detach().clone() for n, p in params.items()}))
    return out, dict(sharded.layouts)


def clip_dp_rank(ctx, model, x, y, scale, max_norm):
    """A plain (unsharded) replica on this rank's half of the batch; averaged and clipped."""
    m = copy.deepcopy(model)
    rows = x.shape[0] // ctx.world_size
    mine = slice(ctx.rank * rows, (ctx.rank + 1) * rows)
    _, loss = m(x[mine], y[mine])
    (scale * loss).backward()
    norm = clip_grad_norm_(m, max_norm, dp_group=ctx.group)
    return norm, {n: p.grad.detach().clone() for n, p in m.named_parameters()}


def torch_clip(model, x, y, scale, max_norm, norm_type=2.0):
    """The unsharded reference: torch.nn.utils.clip_grad_norm_."""
    m = copy.deepcopy(model)
    _, loss = m(x, y)
    (scale * loss).backward()
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm, norm_type=norm_type)
    return norm, m


# -- training on real ranks ---------------------------------------------------------------

@isolated
def train_rank(ctx, cfg: dict):
    """``train(TrainConfig(**cfg))`` on this rank, with where the rank sits in the mesh."""
    return train(TrainConfig(**cfg))


@isolated
def trainer_rank(ctx, cfg: dict, corrupt: bool):
    """Train, then report the mesh position, the history and fingerprints of every parameter;
    with ``corrupt``, nudge a replicated parameter on global rank 1 and run the check again."""
    trainer = Trainer(TrainConfig(**cfg))
    trainer.run()
    prints = {n: (p.detach().double().sum().item(), p.detach().double().square().sum().item())
              for n, p in trainer.sharded.named_parameters()}
    out = {"tp_rank": trainer.tp_rank, "dp_rank": trainer.dp_rank, "history": trainer.history,
           "fingerprints": prints,
           "replicated": sorted(n for n, lay in trainer.sharded.layouts.items()
                                if isinstance(lay, shardplan.Replicate))}
    if corrupt:
        name = next(n for n, p in trainer.sharded.named_parameters()
                    if isinstance(trainer.sharded.layouts[n], shardplan.Replicate))
        if ctx.rank == 1:
            with torch.no_grad():
                trainer.sharded.get_parameter(name).add_(1e-3)
        try:
            trainer.check_replicas()
            out["caught"] = None
        except shardplan.CommunicationError as e:
            out["caught"] = str(e)
    return out


@isolated
def resume_rank(ctx, first: dict, second: dict):
    """Run ``first`` (which saves), then a fresh trainer from ``second`` (which resumes)."""
    return train(TrainConfig(**first)), train(TrainConfig(**second))


@isolated
def fp16_resume_rank(ctx, first: dict, second: dict, growth_interval: int):
    """``first`` (fp16; it saves) with a scaler that grows every ``growth_interval`` steps,
    so it overflows and backs off; then a fresh trainer from ``second`` (it resumes).
    Both histories and both scalers' final states."""
    full = Trainer(TrainConfig(**first))
    full.scaler = TPGradScaler("cpu", growth_interval=growth_interval)
    full.run()
    resumed = Trainer(TrainConfig(**second))
    resumed.run()
    return (full.history, resumed.history, full.scaler.state_dict(),
            resumed.scaler.state_dict())


# -- non-finite values (--on-nonfinite) ---------------------------------------------------

def _nan_loss(module, args, out):
    """A forward hook: the loss NaN, its gradient unchanged (a constant is added)."""
    logits, loss = out[0], out[1]
    return logits, loss + float("nan")


def nonfinite_dp_rank(ctx, model, x, y, agreeing: bool):
    """One ``training_step`` of a plain replica on this rank's half of the batch, rank 1's
    loss NaN (its gradients finite); ``agreeing``: the ranks agree over ``ctx.group``.
    (skipped, what was seen where, whether this rank's parameters changed)."""
    m = copy.deepcopy(model)
    rows = x.shape[0] // ctx.world_size
    mine = slice(ctx.rank * rows, (ctx.rank + 1) * rows)
    if ctx.rank == 1:
        m.register_forward_hook(_nan_loss)
    opt = build_optimizer(m, 1e-3)
    before = [p.detach().clone() for p in m.parameters()]
    done = training_step(m, opt, TPGradScaler("cpu", enabled=False), (x[mine], y[mine]),
                         config=TrainConfig(), lr=1e-3, dp_group=ctx.group,
                         group=ctx.group if agreeing else None)
    changed = any(not torch.equal(b, p) for b, p in zip(before, m.parameters()))
    return done.skipped, done.nonfinite, changed


def _fingerprints(trainer) -> dict:
    return {n: (p.detach().double().sum().item(), p.detach().double().square().sum().item())
            for n, p in trainer.sharded.named_parameters()}


@isolated
def nonfinite_rank(ctx, cfg: dict):
    """``--on-nonfinite skip``: 3 steps, a NaN in global rank 1's gradient of a replicated
    parameter at step 2 (the norm counts that gradient on TP rank 0 only, so no rank's norm
    shows it). Then ``stop``: rank 1's loss NaN at step 2. Per rank: whether each step
    changed the parameters, the history, the fingerprints, the step and error of the stop."""
    trainer = Trainer(TrainConfig(**cfg, on_nonfinite="skip"))
    name = next(n for n, lay in trainer.sharded.layouts.items()
                if isinstance(lay, shardplan.Replicate))

    def poison(p):
        if ctx.rank == 1 and trainer.step == 1:
            p.grad.view(-1)[0] = float("nan")

    trainer.sharded.get_parameter(name).register_post_accumulate_grad_hook(poison)
    changed = []
    for _ in range(3):
        before = [p.detach().clone() for p in trainer.sharded.parameters()]
        trainer.train_step()
        changed.append(any(not torch.equal(b, p)
                           for b, p in zip(before, trainer.sharded.parameters())))
    trainer.check_replicas()
    out = {"changed": changed, "history": trainer.history, "fingerprints": _fingerprints(trainer),
           "tp_rank": trainer.tp_rank}
    stopper = Trainer(TrainConfig(**cfg, on_nonfinite="stop"))
    if ctx.rank == 1:
        stopper.sharded.register_forward_hook(
            lambda m, args, o: _nan_loss(m, args, o) if stopper.step == 1 else None)
    try:
        for _ in range(3):
            stopper.train_step()
        out["stopped"] = None
    except NonFiniteError as e:
        out["stopped"] = (stopper.step, str(e))
    return out


# -- the loss scaler on real ranks --------------------------------------------------------

OVERFLOW_MODES = ("step", "unscale", "fused")  # how the scaler gets to its inf check


@isolated
def overflow_rank(ctx, agreeing: bool, mode: str):
    """Two fp16-style iterations on this rank's shard of a column-parallel weight (its rows
    of one seeded matrix) and a replicated parameter (its gradient the same on every rank):
    the first with an inf in rank 1's weight gradient only, the second clean.

    ``agreeing``: shardplan's ``TPGradScaler``, else plain ``torch.amp.GradScaler``.
    ``mode``: ``step`` calls ``scaler.step`` alone (which unscales), ``unscale`` calls
    ``scaler.unscale_`` first, ``fused`` uses fused AdamW (which unscales itself).
    Per iteration: which parameters changed, found_inf (``unscale`` mode), the scale and
    growth tracker after ``update()``, and the replicated parameter.
    """
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 3).chunk(ctx.world_size)[ctx.rank].clone())
    shared = torch.nn.Parameter(torch.randn(3))
    x = torch.randn(5, 3)
    opt = torch.optim.AdamW([weight, shared], lr=0.1, fused=mode == "fused")
    scaler = TPGradScaler("cpu") if agreeing else torch.amp.GradScaler("cpu")
    out = []
    for it in range(2):
        before = [weight.detach().clone(), shared.detach().clone()]
        opt.zero_grad(set_to_none=True)
        loss = (x @ weight.T).square().sum() + shared.square().sum()
        scaler.scale(loss).backward()
        if it == 0 and ctx.rank == 1:
            weight.grad[0, 0] = float("inf")
        found = None
        if mode == "unscale":
            scaler.unscale_(opt)
            found = scaler.found_inf(opt) if agreeing else None
        scaler.step(opt)
        scaler.update()
        out.append({"changed": [not torch.equal(b, p) for b, p in zip(before, [weight, shared])],
                    "found_inf": found, "scale": scaler.get_scale(),
                    "tracker": scaler.state_dict()["_growth_tracker"],
                    "shared": shared.detach().clone()})
    return out


def reference_losses(cfg: dict, dp: int) -> tuple[list[float], list[float]]:
    """One process, the unsharded model, the global batch (``batch_size * dp`` rows) per step,
    torch's own clipping: (losses, gradient norms)."""
    losses, norms, _ = reference_training(cfg, dp)
    return losses, norms


def reference_training(cfg: dict, dp: int) -> tuple[list[float], list[float], dict]:
    """``reference_losses`` and the trained model's state dict."""
    c = TrainConfig(**cfg)
    data = TokenData(c.data, seq_len=c.seq_len, batch_size=c.batch_size * dp, dp=1, seed=c.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(c.seed)
        model = build_model(c)
    model.train()
    opt = build_optimizer(model, c.lr, weight_decay=c.weight_decay)
    losses, norms = [], []
    for step in range(c.steps):
        lr = lr_schedule(step, lr=c.lr, warmup=c.warmup, total=c.steps, min_lr=c.floor_lr)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = data.global_batch(step)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms, {n: t.detach() for n, t in model.state_dict().items()}


@isolated
def pipeline_rank(ctx, cfg: dict):
    """Train with ``--pp`` (``cfg``) on this rank: the history, this rank's parameters by
    FQN and their layouts over its tp group ("R" on a plain stage), the stages it holds
    and its pp and tp rank."""
    trainer = Trainer(TrainConfig(**cfg))
    trainer.run()
    pipe = trainer.pipe
    layouts = {n: str(lay) for m in pipe.modules.values() if isinstance(m, ShardedModule)
               for n, lay in m.layouts.items()}
    params = {n: p.detach() for n, p in pipe.named_parameters()}
    return {"history": trainer.history, "params": params,
            "layouts": {n: layouts.get(n, "R") for n in params}, "stages": sorted(pipe.modules),
            "pp_rank": ctx.rank // trainer.tp, "tp_rank": trainer.tp_rank}


def tiny_llama():
    """A MODULE:FACTORY target: the bundled Llama (GQA: 4 query, 2 KV heads), byte vocabulary."""
    return build("llama-tiny", vocab_size=256)
