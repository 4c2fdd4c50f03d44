"""``parallelize(..., compile=...)``: one graph per compiled unit, equal to eager.

Every case runs on real gloo ranks (functional collectives need a process
group) and compares, on every rank, the compiled sharded model with the eager
sharded model and with the unsharded one: outputs, loss, gathered gradients
and the ledger. Most cases use the ``aot_eager`` backend (dynamo's full-graph
capture and AOT autograd without C++ codegen); one proves inductor.
"""

from __future__ import annotations

import copy

import pytest
import torch

import shardplan
from shardplan.errors import ConfigurationError
from shardplan.layouts import Shard
from shardplan.models import build
from shardplan.ranks import SimulatedRanks
from shardplan.runtime.ledger import CommLedger

pytestmark = [pytest.mark.real]


def make(case: str):
    """(model, keyword inputs, loss from the output) for a case name."""
    if case.startswith("hf-"):
        import hf_cases
        model = hf_cases.build(case[3:])
        return model, hf_cases.inputs(), lambda out: out.loss
    torch.manual_seed(0)
    model = build(case)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    kw = {"idx" if case.startswith("gpt") else "tokens": torch.randint(0, vocab, (2, 8), generator=g),
          "targets": torch.randint(0, vocab, (2, 8), generator=g)}
    return model, kw, lambda out: out[1]


def run_once(sharded, kw, loss_of):
    with CommLedger() as ledger:
        out = sharded(**kw)
        loss = loss_of(out)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in sharded.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    return loss.detach(), grads, sorted(ledger.summary().items())


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs dynamo hands it."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        from torch._dynamo.backends.common import aot_autograd
        return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(gm, example_inputs)


def compiled_vs_eager(ctx, case, recompute, backend="aot_eager"):
    """Per rank: (eager, compiled) results of one step, and the graphs compiled."""
    import torch._dynamo
    torch._dynamo.reset()
    model, kw, loss_of = make(case)
    counter = CountingBackend()
    eager = shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=kw,
                                  recompute=recompute)
    compiled = shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=kw,
                                     recompute=recompute,
                                     compile=counter if backend == "count" else backend)
    return run_once(eager, kw, loss_of), run_once(compiled, kw, loss_of), eager.layouts, \
        counter.graphs


def unsharded(case):
    model, kw, loss_of = make(case)
    loss = loss_of(model(**kw))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)
                           if p.grad is not None}


def assert_all_equal(results, case, recompute=False):
    ref_loss, ref_grads = unsharded(case)
    for eager, compiled, layouts, _ in results:
        torch.testing.assert_close(compiled[0], eager[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(compiled[0], ref_loss, atol=2e-5, rtol=1e-4)
        if not recompute:
            assert compiled[2] == eager[2]  # the ledger records the same collectives
        else:  # eager checkpoint stops recomputing early (skips a block's last g); a graph cannot
            backward = [r for r in eager[2] if r[0][1] == "backward"]
            assert [r for r in compiled[2] if r[0][1] == "backward"] == backward
    for name, g in ref_grads.items():
        lay = results[0][2][name]
        for which in (0, 1):  # eager, compiled
            parts = [r[which][1][name] for r in results]
            got = lay.unshard(parts, g.shape[lay.dim]) if isinstance(lay, Shard) else parts[0]
            torch.testing.assert_close(got, g, atol=2e-5, rtol=1e-4, msg=name)
        for r in results:  # compiled equals eager on every rank, shard by shard
            torch.testing.assert_close(r[1][1][name], r[0][1][name], atol=1e-6, rtol=1e-5)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("recompute", [False, True], ids=["whole", "per-block"])
@pytest.mark.parametrize("case", ["gpt-tiny", "llama-tiny", "hf-gpt2", "hf-llama"])
def test_compiled_equals_eager_equals_unsharded(real_ranks, case, recompute):
    assert_all_equal(real_ranks(2).run(compiled_vs_eager, case, recompute), case, recompute)


def recompiles(ctx):
    """Graphs compiled for calls with three sequence lengths, and the explain of the first."""
    import torch._dynamo
    torch._dynamo.reset()
    model, kw, loss_of = make("gpt-tiny")
    counter = CountingBackend()
    sharded = shardplan.parallelize(model, group=ctx.group, example_inputs=kw, compile=counter)
    counts = []
    for t in (8, 12, 16, 6):
        ids = kw["idx"].repeat(1, 2)[:, :t].contiguous()
        loss_of(sharded(ids, ids)).backward()
        counts.append(counter.graphs)
    torch._dynamo.reset()
    eager = shardplan.parallelize(model, group=ctx.group, example_inputs=kw)
    explained = torch._dynamo.explain(eager.graph_module)(**kw)
    return counts, explained.graph_count, explained.graph_break_count


@pytest.mark.timeout(300)
def test_one_graph_no_breaks_and_one_recompile_for_new_lengths(real_ranks):
    for counts, graphs, breaks in real_ranks(2).run(recompiles):
        assert counts[0] == 1  # one graph for the whole sharded model
        assert counts[1] <= 2 and counts[-1] == counts[1]  # dynamic after one recompile
        assert (graphs, breaks) == (1, 0)


@pytest.mark.timeout(300)
def test_per_block_compiles_one_graph_per_block(real_ranks):
    for *_, graphs in real_ranks(2).run(compiled_vs_eager, "gpt-tiny", True, "count"):
        assert graphs == 2  # gpt-tiny has two layers


@pytest.mark.timeout(600)
def test_inductor(real_ranks):
    assert_all_equal(real_ranks(2).run(compiled_vs_eager, "gpt-tiny", False, "inductor"),
                     "gpt-tiny")


def refuse_simulated(ctx):
    model, kw, _ = make("gpt-tiny")
    with pytest.raises(ConfigurationError, match="needs a torch.distributed process group"):
        shardplan.parallelize(model, group=ctx.group, example_inputs=kw, compile=True)
    return True


@pytest.mark.timeout(60)
def test_simulated_ranks_refuse_compile():
    assert SimulatedRanks(2).run(refuse_simulated) == [True, True]


def refuse_region_dropout(ctx):
    torch.manual_seed(0)
    model = build("gpt-tiny", dropout=0.1).train()
    kw = {"idx": torch.zeros(2, 8, dtype=torch.long)}
    with pytest.raises(ConfigurationError, match="model-parallel RNG"):
        shardplan.parallelize(model, group=ctx.group, example_inputs=kw, compile="aot_eager")
    return True


@pytest.mark.timeout(120)
def test_region_dropout_refuses_compile(real_ranks):
    assert real_ranks(2).run(refuse_region_dropout) == [True, True]
