"""Rank functions for the recomputation tests (importable by real-rank workers)."""

from __future__ import annotations

import contextlib

import torch

import shardplan
from shardplan.models import build
from shardplan.planner.recompute import Recomputed
from shardplan.runtime.random import manual_seed, set_rng_tracker

SEED = 1234


def dropout_gpt(n_layer: int = 2, dropout: float = 0.2):
    torch.manual_seed(0)
    return build("gpt-tiny", n_layer=n_layer, dropout=dropout).train()


def batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 96, (2, 8), generator=g), torch.randint(0, 96, (2, 8), generator=g))


def step(ctx, recompute, restore_model_parallel: bool = True):
    """One forward/backward of a dropout GPT: (loss, grads by FQN, block forward calls,
    whether dropout ran on the model-parallel stream)."""
    x, y = batch()
    sharded = shardplan.parallelize(dropout_gpt(), group=ctx.group, example_inputs=(x, y),
                                    recompute=recompute)
    calls = []
    for mod in sharded.graph_module.modules():
        if isinstance(mod, Recomputed):
            mod.block.register_forward_pre_hook(lambda m, a, name=mod.name: calls.append(name))
            if not restore_model_parallel:  # the negative control: torch's checkpoint alone
                mod._rng_contexts = lambda: (contextlib.nullcontext(), contextlib.nullcontext())
    manual_seed(SEED, ctx.rank)
    try:
        loss = sharded(x, y)[1]
        loss.backward()
    finally:
        set_rng_tracker(None)
    grads = {n: p.grad.clone() for n, p in sharded.named_parameters()}
    return loss.item(), grads, calls, "tp_rng" in str(sharded.graph_module)
