"""Steps for tests/test_libraries.py: models of other libraries than transformers
(benchmarks/library_models.py), one forward and backward per rank."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import shardplan
from benchmarks.library_models import MODELS
from shardplan.layouts import Shard
from shardplan.planner.rules import load_rules
from shardplan.sharded import ShardedModule

def loss_of(out: torch.Tensor) -> torch.Tensor:
    """These models compute no loss: the mean square of the output (as ``verify``'s)."""
    return out.pow(2).mean()


def reference(model: nn.Module, inputs: tuple):
    ref = copy.deepcopy(model)
    out = ref(*inputs)
    loss = loss_of(out)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    return out.detach(), loss.detach(), grads


def step(ctx, model: nn.Module, inputs: tuple, captured=None):
    """One forward/backward on this rank; ``captured`` (made once for all ranks) skips the
    per-rank export. Returns (output, loss, grads, layouts, parameters held)."""
    if captured is None:
        sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                        example_inputs=inputs)
    else:
        sharded = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(), example=(inputs, {}),
                                gather_output=True, strict=False, captured=copy.deepcopy(captured))
    out = sharded(*inputs)
    loss = loss_of(out)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in sharded.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    held = sum(p.numel() for p in sharded.parameters())
    return out.detach(), loss.detach(), grads, sharded.layouts, held


def real_step(ctx, name: str):
    """``step`` on a real rank, the model built there by name."""
    case = MODELS[name]
    return step(ctx, case.build(), case.inputs())


def layer_linears(model: nn.Module) -> list[str]:
    """The weights of every ``nn.Linear`` inside an element of an ``nn.ModuleList`` (the
    layers' attention and MLP; not a ViT's patch embedding, a ``Sequential``)."""
    layers = tuple(f"{name}.{i}." for name, mod in model.named_modules()
                   if isinstance(mod, nn.ModuleList) for i in range(len(mod)))
    return [f"{name}.weight" for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and f"{name}.".startswith(layers)]


def assert_sharded(model: nn.Module, results, whole_ok: tuple[str, ...] = ()) -> None:
    """Every attention and MLP weight split but those whose name ends in one of
    ``whole_ok`` (K/V projections a model's head layout keeps whole), and every rank
    holding fewer parameters than the whole model."""
    full = sum(p.numel() for p in model.parameters())
    weights = [w for w in layer_linears(model) if not w.endswith(whole_ok)]
    assert weights, f"{type(model).__name__}: no linear layers found"
    for rank, r in enumerate(results):
        whole = [w for w in weights if not isinstance(r[3][w], Shard)]
        assert not whole, f"rank {rank}: {whole} not split"
        assert r[4] < full, f"rank {rank} holds {r[4]} parameters of {full}"
