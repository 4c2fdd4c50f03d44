"""Pipeline stages by cost (``shardplan.planner.stages``, ``plan(..., pp=)``), without ranks.

A small language model with blocks of chosen widths makes the FLOPs a hand
computation: a block Linear(d, h) -> ReLU -> Linear(h, d) on r rows costs
4*r*d*h forward, the head 2*r*d*classes, the embedding nothing; a stage costs
three times its forward (backward twice). The cut is checked against the cut
computed by hand from those numbers, the memory limit against hand-counted
AdamW state (16 bytes a float32 parameter), the bubble and the microbatches in
flight against the papers' formulas, and each stage's parameters against the
stage modules torch's pipeline tracer builds from the same cut.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import shardplan
from shardplan import ConfigurationError
from shardplan.models import build
from shardplan.parallel.pipeline import _tie_within, _trace, pipeline_parallel
from shardplan.parallel_dims import ParallelDims
from shardplan.planner.stages import bubble, in_flight

D, ROWS, SEQ, M = 16, 4, 4, 2
R = ROWS // M * SEQ  # rows of one microbatch


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class WidthsLM(nn.Module):
    """Embedding(vocab, D), one Block per width, head Linear(D, classes)."""

    def __init__(self, widths: list[int], vocab: int, classes: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(Block(D, h) for h in widths)
        self.head = nn.Linear(D, classes)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))


def _plan(model, vocab, **kw):
    return shardplan.plan(model, 1, example_inputs=(_ids(vocab),), microbatches=M, **kw)


def _block_params(h: int) -> int:
    return 2 * D * h + h + D


def test_the_cut_balances_flops_with_the_head_on_the_last_stage():
    """Blocks [1, 1, 1, 1, 1, 4] units of 4*R*D*16 FLOPs, the head 2 (classes 64), the
    embedding 0: cutting after block 4 gives stages of 5 and 4 + 2 = 6 units, after
    block 3 of 4 and 7, so five blocks go to the embedding's stage and one to the
    head's. (Parameters alone, the old cost, put the cut after block 3.)"""
    widths, vocab, classes = [16] * 5 + [64], 32, 64
    est = _plan(WidthsLM(widths, vocab, classes), vocab, pp=2).pipeline
    assert [s.blocks for s in est.stages] == [[0, 5], [5, 6]]
    forward = [4 * R * D * h for h in widths]
    head = 2 * R * D * classes
    assert est.stages[0].flops == 3 * sum(forward[:5])
    assert est.stages[1].flops == 3 * (forward[5] + head)
    assert est.stages[0].embedding and not est.stages[0].head
    assert est.stages[1].head and not est.stages[1].embedding
    assert est.stages[0].params == vocab * D + 5 * _block_params(16)
    assert est.stages[1].params == _block_params(64) + D * classes + classes
    assert est.stages[1].time_share == pytest.approx(6 / 11)


def _state0(blocks: int, vocab: int) -> int:
    """AdamW bytes of stage 0 holding the embedding and ``blocks`` blocks of width 16:
    weight, gradient and two moments, float32."""
    return 16 * (vocab * D + blocks * _block_params(16))


def test_a_memory_limit_moves_blocks_off_the_embedding_stage():
    """Six equal blocks and a head of half a block: by FLOPs alone the cut is 3 + 3
    (3 and 3.5 units); a limit just under the embedding's stage with three blocks
    (the embedding is large: vocabulary 1024) leaves it two."""
    vocab = 1024
    model = WidthsLM([16] * 6, vocab, 16)
    free = _plan(model, vocab, pp=2).pipeline
    assert free.starts == [0, 3] and free.fits is None
    limit = _state0(3, vocab) - 1
    p = _plan(model, vocab, pp=2, gpu_memory=limit)
    est = p.pipeline
    assert est.starts == [0, 2] and est.fits and not p.warnings, p.warnings
    first = est.stages[0]
    assert first.param_bytes + first.grad_bytes + first.optimizer_bytes == _state0(2, vocab)
    assert all(s.fits and s.peak <= limit for s in est.stages)
    stages = p.report().split("\npipeline:")[1]
    assert stages.count("  FITS") == 2 and "DOES NOT FIT" not in stages, stages


def test_no_cut_within_the_limit_names_the_stage_and_the_excess():
    vocab = 1024
    model = WidthsLM([16] * 6, vocab, 16)
    limit = _state0(1, vocab) - 1  # not even one block beside the embedding
    p = _plan(model, vocab, pp=2, gpu_memory=limit)
    est = p.pipeline
    assert est.fits is False and est.starts == [0, 1]
    over = est.stages[0].peak - limit
    assert "stage 0 (blocks 0-0)" in est.overflow and f"{over / 1024:.2f} KiB over" in \
        est.overflow, est.overflow
    assert est.overflow in p.warnings
    assert "DOES NOT FIT" in p.report().split("\npipeline:")[1].splitlines()[2]
    with pytest.raises(ConfigurationError) as e:  # the cut is made before any process group
        pipeline_parallel(model, _ids(vocab), dims=ParallelDims(pp=2), microbatches=M,
                          memory_limit=limit)
    assert "stage 0 (blocks 0-0)" in str(e.value) and "where: pipeline_parallel" in str(e.value)


@pytest.mark.parametrize("pp,v,m,schedule,expected", [
    (4, 1, 8, "1f1b", 3 / 8), (4, 1, 8, "gpipe", 3 / 8), (2, 1, 2, "1f1b", 1 / 2),
    (4, 2, 8, "interleaved", 3 / 16), (2, 3, 4, "interleaved", 1 / 12), (4, 2, 8, "zbv", 0.0)])
def test_bubble_formulas(pp, v, m, schedule, expected):
    """(p-1)/m for GPipe and 1F1B, (p-1)/(v*m) interleaved, 0 for ZB-V."""
    assert bubble(pp, v, m, schedule) == pytest.approx(expected)


def test_microbatches_in_flight_by_schedule():
    """GPipe keeps all m, 1F1B p - s on stage s; interleaved (p 2, v 2, m 4): rank 0's
    2(p-1) + (v-1)p + 1 = 5 first forwards go to its stages 0, 0, 2, 2, 0 (3 and 2),
    rank 1's 3 to 1, 1, 3 (2 and 1): p + (p-1)/v = 2.5 stages' worth on rank 0."""
    assert [in_flight(s, 4, 1, 8, "gpipe") for s in range(4)] == [8] * 4
    assert [in_flight(s, 4, 1, 8, "1f1b") for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(s, 4, 1, 2, "1f1b") for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight(s, 2, 2, 4, "interleaved") for s in range(4)] == [3, 2, 2, 1]
    assert [in_flight(s, 2, 2, 4, "zbv") for s in range(4)] == [2] * 4


def test_stage_activations_follow_the_schedule():
    vocab = 64
    model = WidthsLM([16] * 4, vocab, 16)
    gpipe = _plan(model, vocab, pp=2, schedule="gpipe").pipeline
    one = _plan(model, vocab, pp=2, schedule="1f1b").pipeline
    for g, o in zip(gpipe.stages, one.stages):
        assert g.activations_per_microbatch == o.activations_per_microbatch > 0
        assert g.activations == M * g.activations_per_microbatch
    assert [s.in_flight for s in one.stages] == [2, 1]
    assert one.stages[1].activations == one.stages[1].activations_per_microbatch


@pytest.mark.parametrize("name,pp,schedule,v", [("gpt", 2, "1f1b", None),
                                                ("gpt", 2, "interleaved", 2),
                                                ("llama", 3, "gpipe", None)])
def test_stage_parameters_are_the_traced_stages(name, pp, schedule, v):
    """Each stage's estimated elements are those of the stage module torch's tracer
    builds for the same cut, its copies of one tied weight made one again as the
    pipeline does (GPT's tied embedding and head: on both end stages)."""
    torch.manual_seed(0)
    model = build("gpt-tiny", n_layer=6) if name == "gpt" else build("llama-tiny", n_layers=6)
    ids = torch.randint(0, 64, (4, 8))
    est = shardplan.plan(model, 1, example_inputs=(ids,), pp=pp, schedule=schedule,
                         microbatches=4, virtual_stages=v).pipeline
    layers = est.layers
    pipe = _trace(copy.deepcopy(model), (ids,), 4, layers, est.starts)
    for s in est.stages:
        module = pipe.get_stage_module(s.index)
        _tie_within(module, model)
        held = sum(p.numel() for p in module.parameters())
        assert s.params == held, (s.index, s.params, held)
        assert s.param_bytes == 4 * held


@pytest.mark.parametrize("kw,words", [
    (dict(pp=0), ["pp=0"]),
    (dict(pp=2, schedule="zigzag"), ["zigzag", "gpipe", "1f1b", "interleaved", "zbv"]),
    (dict(pp=2, microbatches=3), ["microbatches=3", "4 rows"]),
    (dict(pp=4, microbatches=1), ["'1f1b' needs at least pp=4 microbatches"]),
    (dict(pp=2, schedule="1f1b", virtual_stages=2), ["virtual_stages=2", "interleaved"]),
    (dict(pp=4, microbatches=4, schedule="interleaved"), ["8 stages", "4 blocks"]),
    (dict(pp=2, layers="embed"), ["layers='embed'"]),
])
def test_plan_refuses_bad_pipeline_arguments(kw, words):
    model = WidthsLM([16] * 4, 64, 16).to("meta")
    with pytest.raises(ConfigurationError) as e:
        shardplan.plan(model, 1, example_inputs=(torch.zeros(4, 4, dtype=torch.long),), **kw)
    assert all(w in str(e.value) for w in words) and "where: plan" in str(e.value), str(e.value)


def test_cli_plan_shows_the_stages(capsys):
    from shardplan import cli
    assert cli.main(["plan", "llama-tiny", "--tp", "1", "--batch", "4", "--seq", "8", "--pp", "2",
                     "--schedule", "gpipe", "--microbatches", "4",
                     "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out.split("\npipeline:")[1]
    assert out.startswith(" pp=2, schedule gpipe, 4 microbatches") and \
        "bubble (p-1)/m = 25.0%" in out, out
    assert "layers.0 + embedding" in out and "layers.1 + head" in out
    assert out.count("  FITS") == 2 and "memory limit per rank 74.51 GiB" in out, out


def test_html_report_shows_the_stages():
    vocab = 1024
    p = _plan(WidthsLM([16] * 6, vocab, 16), vocab, pp=2, gpu_memory=_state0(3, vocab) - 1)
    page = p.to_html()
    section = page.split('<section id="pipeline"')[1].split("</section>")[0]
    assert section.count('class="stage-row"') == 2 and section.count(">FITS<") == 2
    assert "blocks.0-1 + embedding" in section and "blocks.2-5 + head" in section
    assert "bubble (p-1)/m = 50.0%" in section
    assert '<section id="pipeline"' not in _plan(WidthsLM([16] * 2, vocab, 16), vocab).to_html()
