"""Capture's fallback: when ``torch.export`` refuses a forward, capture traces it with
``torch.fx.symbolic_trace`` (Python-level code is evaluated once, at trace time) and
exports the traced graph."""

from __future__ import annotations

import torch
import torch.nn as nn

import shardplan

import pytest

pytestmark = pytest.mark.timeout(120)


class ExportRefused(nn.Module):
    """A Megatron MLP whose forward export refuses (standing in for any Python code that
    export rejects) and that symbolic tracing reads: fx evaluates the check once, while
    tracing, when no export is under way, and the traced graph has no trace of it."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        if torch.compiler.is_exporting():
            raise RuntimeError("this forward refuses torch.export")
        return self.down(torch.relu(self.up(x)))


def test_symbolic_trace_fallback_captures_and_shards(monkeypatch):
    torch.manual_seed(0)
    model, x = ExportRefused(), torch.randn(2, 3, 8)
    with pytest.raises(RuntimeError, match="refuses torch.export"):  # export alone fails
        torch.export.export(model, (x,), strict=False)
    traced = []
    real_trace = torch.fx.symbolic_trace

    def spy(*args, **kwargs):
        gm = real_trace(*args, **kwargs)
        traced.append(gm)
        return gm

    monkeypatch.setattr(torch.fx, "symbolic_trace", spy)
    report = shardplan.verify(model, 2, example_inputs=x)  # every rank vs the model itself
    assert traced, "capture did not take the symbolic_trace path"
    assert report.ok, str(report)
    # and it was sharded as Megatron's MLP, not kept replicated
    plan = shardplan.plan(model, 2, example_inputs=x)
    assert plan.param("up.weight").layout.startswith("S(0")
    assert plan.param("down.weight").layout.startswith("S(1")
