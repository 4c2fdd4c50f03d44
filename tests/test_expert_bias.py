"""An MoE layer whose experts add their own bias (GPT-OSS) pays one g of b*s*h, after the
top-k sum, as Megatron's MoE layer does: the bias is carried beside the partial sum
(``planner/reassociate.py``'s ``carry_apart``), equal to the unsharded model on every rank."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardplan.layouts import Shard
from shardplan.ranks import SimulatedRanks

import split_dim_cases
from checks import assert_equivalent

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
pytest.importorskip("transformers.integrations.moe")  # registers its grouped_mm op


class BiasedExperts(nn.Module):
    """GPT-OSS's experts as Hugging Face runs them (``grouped_mm``): each token copied to
    its top-k experts, sorted by expert, up (one 3-D weight cut by offsets), SiLU, down
    plus that expert's bias (in place), weighted by the routing weights, put back in
    token order and summed over the k."""

    def __init__(self, dim: int = 32, hidden: int = 16, experts: int = 4, k: int = 2):
        super().__init__()
        self.k, self.experts = k, experts
        self.router = nn.Linear(dim, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, dim, hidden) * 0.2)
        self.down = nn.Parameter(torch.randn(experts, hidden, dim) * 0.2)
        self.down_bias = nn.Parameter(torch.randn(experts, dim) * 0.1)

    def forward(self, x):
        grouped_mm = torch.ops.transformers.grouped_mm_fallback
        b, t, c = x.shape
        h = x.reshape(-1, c)
        weights, idx = self.router(h).topk(self.k, -1)
        ids, perm = torch.sort(idx.reshape(-1))
        offsets = torch.cumsum(torch.histc(ids.float(), bins=self.experts, min=0,
                                           max=self.experts - 1), 0, dtype=torch.int32)
        a = F.silu(grouped_mm(h[perm // self.k], self.up, offsets))
        out = grouped_mm(a, self.down, offsets)
        out.add_(self.down_bias[ids])
        out = out * weights.softmax(-1).reshape(-1)[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return out[inv].view(b * t, self.k, c).sum(1).view(b, t, c)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [2, 4])
def test_expert_bias_keeps_the_g_after_the_top_k_sum(tp):
    """The experts' up column and down row parallel; the one g after the top-k sum (b*s*h
    numbers, not b*s*k*h), the routing weights' gradient summed by their f (b*s*k);
    every rank equals the unsharded model."""
    torch.manual_seed(0)
    model, x = BiasedExperts(), split_dim_cases.example()
    tokens, k, c = 12, 2, 32
    results = SimulatedRanks(tp).run(split_dim_cases.step, model, x)
    assert_equivalent(results, split_dim_cases.reference(model, x))
    for layouts, grads in ((r[3], r[2]) for r in results):
        assert (layouts["up"], layouts["down"]) == (Shard(2), Shard(1))
        assert grads["up"].shape[2] * tp == 16 and grads["down"].shape[1] * tp == 16
    want = Counter({("all_reduce", "forward", tokens * c): 1,
                    ("all_reduce", "backward", tokens * k): 1})
    for records in (r[4] for r in results):
        assert Counter((r.kind, r.direction, r.elements) for r in records) == want
    assert sorted((c.purpose, c.elements) for c in results[0][5].collectives) == [
        ("f", tokens * k), ("g", tokens * c)]
