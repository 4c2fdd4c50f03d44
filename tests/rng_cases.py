"""A model with dropout inside and outside a sharded region, for real-rank RNG tests."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardplan
from shardplan.runtime.random import manual_seed, set_rng_tracker
from shardplan.verify import _replay

SEED = 1234


class DropoutMLP(nn.Module):
    def __init__(self, dim=16, p=0.5):
        super().__init__()
        self.fc, self.proj, self.p = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), p

    def forward(self, x):
        h = F.dropout(F.gelu(self.fc(x)), self.p, self.training)  # on split activations
        return x + F.dropout(self.proj(h), self.p, self.training)  # on replicated ones


def masks(ctx):
    """Each rank's local dropout outputs: inside the region and after it."""
    torch.manual_seed(0)
    model = DropoutMLP().train()
    x = torch.randn(2, 3, 16)
    manual_seed(SEED, ctx.rank)
    try:
        sharded = shardplan.parallelize(model, group=ctx.group, example_inputs=x)
        values = _replay(sharded.graph_module, (x,), {})
    finally:
        set_rng_tracker(None)
    inside = next(v for k, v in values.items() if k.startswith("tp_rng"))
    outside = values["dropout_1"]
    return inside == 0, outside == 0, sharded.code
