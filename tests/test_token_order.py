"""Sequence-parallel regions run in the token order the all-gather leaves
(``planner.token_order``): an MLP computes each token by itself, so its gather
and its reduce-scatter skip putting the tokens back in sequence order; the
embedding's reduce-scatter reads the lookup of the token ids put in that order.
Every case is compared with the unsharded model (outputs and every gradient,
every rank) and checks that the MLP was sharded; the order is kept only where
every op between the gather and the scatter is token-wise.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardplan
from shardplan.layouts import Shard
from shardplan.ranks import SimulatedRanks
from shardplan.runtime.graph_ops import gathered_order

B, T, H, V = 2, 8, 32, 64


class MLPBlock(nn.Module):
    """Embedding, one pre-norm MLP block with a residual, norm and head; ``mlp`` picks
    what runs between the MLP's gather and its reduce-scatter."""

    def __init__(self, mlp: str):
        super().__init__()
        self.mlp = mlp
        self.emb, self.ln, self.ln_f = nn.Embedding(V, H), nn.LayerNorm(H), nn.LayerNorm(H)
        self.fc, self.gate = nn.Linear(H, 4 * H), nn.Linear(H, 4 * H)
        self.out, self.head = nn.Linear(4 * H, H), nn.Linear(H, V, bias=False)
        self.shift = nn.Parameter(torch.randn(4 * H) / 10)

    def forward(self, idx):
        x = self.emb(idx)
        y = self.ln(x)
        if self.mlp == "swiglu":  # two linears of one gather, a feature-only operand
            z = F.silu(self.gate(y)) * self.fc(y) + self.shift
        else:
            z = F.gelu(self.fc(y))
        if self.mlp == "token_mean":  # mixes the tokens
            z = z - z.mean(1, keepdim=True)
        elif self.mlp == "dropout":  # a random op: its mask would follow the order
            z = F.dropout(z, 0.0, True)
        elif self.mlp == "per_token":  # a per-token tensor from outside the region
            z = z * (idx % 2).unsqueeze(-1).to(z.dtype)
        x = x + self.out(z)
        return self.head(self.ln_f(x))


def _rank(ctx, model, idx):
    sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=(idx,),
                                    sequence_parallel=True)
    gm = sharded.graph_module
    stacked = [n for n, m in gm.named_modules() if getattr(m, "stacked", False)]
    permuted = [n.args[0].op for n in gm.graph.nodes if n.target is gathered_order]
    return stacked, permuted, sharded.layouts["fc.weight"]


@pytest.mark.parametrize("mlp,kept", [
    ("gelu", True), ("swiglu", True), ("token_mean", False), ("dropout", False),
    ("per_token", False)])
def test_mlp_keeps_the_gathered_order_only_when_token_wise(mlp, kept):
    torch.manual_seed(0)
    model = MLPBlock(mlp)
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    for stacked, permuted, layout in SimulatedRanks(2).run(_rank, model, idx):
        assert isinstance(layout, Shard) and layout.dim == 0  # the MLP is column parallel
        # the embedding's scatter always (its lookup reads the ids in the gathered order),
        # the MLP's gathering linears and scatter where it is token-wise
        want = ["tp_seq_linear", "tp_seq_scatter"] if kept else []
        assert sorted(n.rsplit("_", 1)[0] for n in stacked) == sorted(["tp_seq_scatter", *want])
        assert permuted == ["placeholder"]  # the ids, not a wider MLP tensor
    report = shardplan.verify(model, 2, example_inputs=(idx,), sequence_parallel=True,
                              train=True, loss_fn=lambda o: o.square().mean())
    assert report.ok, report
