"""Sequence-parallel steps run on every rank (module level: real gloo workers import them)."""

from __future__ import annotations

import copy

import torch

from shardplan.planner.rules import load_rules
from shardplan.runtime.ledger import CommLedger
from shardplan.sharded import ShardedModule


def saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward while ``fn()`` runs (each storage once)."""
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def step(ctx, model, args, kwargs, captured, sequence_parallel=True, loss_of=None):
    """One forward/backward of the sharded model on this rank: (output, loss, grads,
    layouts, ledger records, plan, annotation, saved-for-backward bytes)."""
    sharded = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(), example=(args, kwargs),
                            gather_output=True, strict=False, captured=copy.deepcopy(captured),
                            sequence_parallel=sequence_parallel)
    loss_of = loss_of or (lambda o: o[1] if isinstance(o, tuple) else o.loss)
    with CommLedger() as ledger:
        out, saved = saved_bytes(lambda: sharded(*args, **kwargs))
        loss = loss_of(out)
        loss.backward()
    logits = out[0] if isinstance(out, tuple) else out.logits
    grads = {n: p.grad.clone() for n, p in sharded.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    return (logits.detach(), loss.detach(), grads, sharded.layouts, ledger.records,
            sharded.plan, sharded.annotation, saved)


def real_step(ctx, name, args):
    """The bundled model ``name`` built on this rank, one sequence-parallel step."""
    from shardplan.models import build
    from shardplan.planner.capture import capture
    torch.manual_seed(0)
    model = build(name).eval()
    r = step(ctx, model, args, {}, capture(model, args, {}))
    return r[:4]
