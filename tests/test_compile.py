"""``parallelize(..., compile=...)``: one graph per compiled unit, equal to eager.

Every case runs on real gloo ranks (functional collectives need a process
group) and compares, on every rank, the compiled sharded model with the eager
sharded model and with the unsharded one: loss, gathered gradients and the
ledger, with and without per-block recompute. Models are one layer of hidden
32, captured once per rank and sharded four ways (eager/compiled x
whole/per-block), then called in eval mode without grad, so a case costs three
compiles. Dropout inside tensor-parallel regions must draw eager's masks,
compiled (with and without recompute). Most cases use the ``aot_eager``
backend (dynamo's full-graph capture and AOT autograd without C++ codegen);
one proves inductor. Compile with FSDP2 is in test_fsdp.py (4 ranks).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.utils import _pytree as pytree

import shardplan
from shardplan.errors import ConfigurationError
from shardplan.layouts import Shard
from shardplan.models import build
from shardplan.planner.capture import capture
from shardplan.planner.recompute import Recomputed
from shardplan.planner.rules import load_rules
from shardplan.ranks import RealRanks, SimulatedRanks
from shardplan.runtime.ledger import CommLedger
from shardplan.sharded import ShardedModule

pytestmark = [pytest.mark.real]

CASES = ("gpt", "llama", "hf-gpt2", "hf-llama")
BLOCK = {"gpt": "transformer.h.0", "llama": "layers.0", "hf-gpt2": "transformer.h.0",
         "hf-llama": "model.layers.0"}  # each model's one block
LENGTHS = (12, 16, 6)  # after the example's 8: the first recompiles dynamic, the rest reuse it


def make(case: str):
    """(model, keyword inputs, loss from the output): one layer, hidden 32."""
    if case.startswith("hf-"):
        import hf_cases
        return hf_cases.build(case[3:], layers=1, hidden=32), hf_cases.inputs(), lambda out: out.loss
    torch.manual_seed(0)
    if case == "gpt":
        model = build("gpt-tiny", n_layer=1)
    else:
        model = build("llama-tiny", n_layers=1, dim=32, ffn_hidden=64)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    kw = {"idx" if case == "gpt" else "tokens": torch.randint(0, vocab, (2, 8), generator=g),
          "targets": torch.randint(0, vocab, (2, 8), generator=g)}
    return model, kw, lambda out: out[1]


def lengthened(kw: dict, t: int) -> dict:
    """The inputs with every (batch, sequence) tensor cut or tiled to length ``t``."""
    return {k: v.repeat(1, 2)[:, :t].contiguous() for k, v in kw.items()}


def run_once(sharded, kw, loss_of):
    with CommLedger() as ledger:
        loss = loss_of(sharded(**kw))
        loss.backward()
    grads = {n: p.grad.clone() for n, p in sharded.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    return loss.detach(), grads, sorted(ledger.summary().items())


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs dynamo hands it, then runs
    them through ``backend``."""

    def __init__(self, backend: str):
        from torch._dynamo import lookup_backend
        self.backend, self.graphs = lookup_backend(backend), 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.backend(gm, example_inputs)


def case_results(ctx, case, lengths=()):
    """On this rank: one step of the model sharded eager and compiled, whole and per
    block; the graphs each compiled model handed its backend; graph breaks; and, for
    ``lengths``, the whole compiled model's graph count after each further call."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model, kw, loss_of = make(case)
    captured = capture(model, (), kw)
    out, whole = {}, {}
    for recompute in (True, False):
        for compiled in (False, True):
            counter = CountingBackend("aot_eager") if compiled else None
            sharded = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(),
                                    example=((), kw), gather_output=True, strict=False,
                                    recompute=recompute, compile=counter or False,
                                    captured=copy.deepcopy(captured))
            out[recompute, compiled] = run_once(sharded, kw, loss_of)
            if compiled:
                out[recompute, "graphs"] = counter.graphs, max(1, len(sharded.recomputed))
                out[recompute, "units"] = units_of(sharded)
            whole[compiled] = sharded  # the last round: recompute=False
    grown = []
    for t in lengths:  # `sharded` and `counter` are the last: compiled whole
        run_once(sharded, lengthened(kw, t), loss_of)
        grown.append(counter.graphs)
    out["lengths"] = grown
    for compiled, sharded in whole.items():
        out["eval", compiled] = run_eval(sharded, kw)
    if case == "gpt":  # and sequence parallel, whole
        for compiled in (False, True):
            counter = CountingBackend("aot_eager") if compiled else None
            sp = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(), example=((), kw),
                               gather_output=True, strict=False, sequence_parallel=True,
                               compile=counter or False, captured=copy.deepcopy(captured))
            out[False, "sp", compiled] = run_once(sp, kw, loss_of)
        out["sp", "graphs"] = counter.graphs
        out["sp", "stacked"] = [n for n, m in sp.graph_module.named_modules()
                                if getattr(m, "stacked", False)]
    out["breaks"] = sum(counters["graph_break"].values())
    out["layouts"] = sharded.layouts
    return out


def units_of(sharded) -> list[str]:
    """What ``compile_graph`` compiled for the first way of calling: "whole" for the
    sharded graph itself, else the FQN of each block whose piece was compiled."""
    units = next(iter(sharded.compiled_units.values()))
    blocks = {id(m.block): m.name for m in sharded.graph_module.modules()
              if isinstance(m, Recomputed)}
    return ["whole" if u is sharded.graph_module else blocks[id(u)] for u in units]


def run_eval(model, kw) -> list[torch.Tensor]:
    """Every tensor of ``model``'s output in eval mode without grad (a new way of
    calling: the sharded model captures, and compiles, its eval graph)."""
    model.eval()
    with torch.no_grad():
        out = model(**kw)
    model.train()
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def unsharded(case):
    model, kw, loss_of = make(case)
    loss = loss_of(model(**kw))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)
                           if p.grad is not None}, run_eval(model, kw)


def assert_equal(ranks, reference, eager_key, compiled_key):
    """Compiled == eager (loss, ledger, every shard) and both == unsharded on every rank."""
    ref_loss, ref_grads, _ = reference
    recompute = compiled_key[0]
    for r in ranks:
        eager, compiled = r[eager_key], r[compiled_key]
        torch.testing.assert_close(compiled[0], eager[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(compiled[0], ref_loss, atol=2e-5, rtol=1e-4)
        if not recompute:
            assert compiled[2] == eager[2]  # the ledger records the same collectives
        else:  # eager checkpoint stops recomputing early (skips a block's last g); a graph cannot
            assert [x for x in compiled[2] if x[0][1] == "backward"] == \
                [x for x in eager[2] if x[0][1] == "backward"]
        for name in ref_grads:
            torch.testing.assert_close(compiled[1][name], eager[1][name], atol=1e-6, rtol=1e-5,
                                       msg=name)
    for name, g in ref_grads.items():
        lay = ranks[0]["layouts"][name]
        for key in (eager_key, compiled_key):
            parts = [r[key][1][name] for r in ranks]
            got = lay.unshard(parts, g.shape[lay.dim]) if isinstance(lay, Shard) else parts[0]
            torch.testing.assert_close(got, g, atol=2e-5, rtol=1e-4, msg=name)


@pytest.fixture(scope="module")
def results(real_ranks):
    """``results(case)``: every rank's ``case_results``, run once per case for all tests."""
    cache = {}

    def get(case):
        if case not in cache:
            lengths = LENGTHS if case == "gpt" else ()
            cache[case] = real_ranks(2).run(case_results, case, lengths)
        return cache[case]
    return get


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recompute", [False, True], ids=["whole", "per-block"])
@pytest.mark.parametrize("case", CASES)
def test_compiled_equals_eager_equals_unsharded(results, case, recompute):
    assert_equal(results(case), unsharded(case), (recompute, False), (recompute, True))


@pytest.mark.timeout(300)
def test_sequence_parallel_compiles_whole(results):
    """The sequence-parallel graph compiles into one graph with no break, its stacked
    collectives and token permutations (``planner.token_order``) included, and equals
    eager and the unsharded model on every rank."""
    ranks = results("gpt")
    assert_equal(ranks, unsharded("gpt"), (False, "sp", False), (False, "sp", True))
    for r in ranks:
        assert r["sp", "graphs"] == 1 and r["breaks"] == 0
        # the MLP gathers and scatters in the gathered order; attention's and the
        # embedding's scatters read their inputs permuted into it
        assert sorted(n.rsplit("_", 1)[0] for n in r["sp", "stacked"]) == \
            ["tp_seq_linear"] + ["tp_seq_scatter"] * 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_eval_compiled_equals_eager_equals_unsharded(results, case):
    """``model.eval()`` under ``no_grad``: every output tensor (logits, loss) of the
    compiled sharded model equals the eager one's and the unsharded model's, on every
    rank."""
    reference = unsharded(case)[2]
    for r in results(case):
        assert len(r["eval", True]) == len(reference) > 0
        for compiled, eager, want in zip(r["eval", True], r["eval", False], reference):
            torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(compiled, want, atol=2e-5, rtol=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_one_graph_per_compiled_unit_no_breaks(results, case):
    """Whole-model compile without recompute, one unit per block with it: the units
    ``compile_graph`` compiled, and one graph each with no break."""
    for r in results(case):
        assert r["breaks"] == 0
        assert r[False, "units"] == ["whole"]
        whole, units = r[False, "graphs"]
        assert (whole, units) == (1, 1)  # the whole sharded model is one graph
        blocks, units = r[True, "graphs"]
        assert r[True, "units"] == [BLOCK[case]] and blocks == units == 1  # one per block


@pytest.mark.timeout(300)
def test_new_lengths_recompile_at_most_once(results):
    for r in results("gpt"):
        first = r[False, "graphs"][0]
        assert r["lengths"][0] <= first + 1  # one recompile, dynamic in batch and sequence
        assert r["lengths"][-1] == r["lengths"][0]  # further lengths reuse it


def dropout_model(name: str):
    """(model in train mode, inputs, loss from the output) with dropout inside tensor-
    parallel regions: the bundled GPT (attention probabilities, one block) and an MLP
    (split activations) with dropout on replicated values too."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        from rng_cases import DropoutMLP
        return DropoutMLP().train(), (torch.randn(2, 3, 16, generator=g),), lambda out: out.sum()
    model = build("gpt-tiny", n_layer=1, dropout=0.2).train()
    ids = torch.randint(0, 96, (2, 2, 8), generator=g)
    return model, tuple(ids), lambda out: out[1]


def dropout_step(ctx, name: str, backend: str, recompute, cache_dir: str | None = None) -> dict:
    """One forward/backward of ``dropout_model(name)`` from the same seeds, eager and
    compiled: {compiled: (loss, grads)}, whether every region dropout takes the
    stream's state as data, and how many graphs compiled with no break. Inductor
    compiles its kernels into ``cache_dir``, shared by the ranks."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from shardplan.runtime.graph_ops import ModelParallelRNG
    from shardplan.runtime.random import manual_seed, set_rng_tracker
    torch._dynamo.reset()
    counters.clear()
    model, args, loss_of = dropout_model(name)
    out = {}
    for compiled in (False, backend):
        sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                        example_inputs=args, recompute=recompute,
                                        compile=compiled)
        manual_seed(1234, ctx.rank)
        try:
            loss, code = _step_and_code(sharded, args, loss_of,
                                        cache_dir if compiled == "inductor" else None)
        finally:
            set_rng_tracker(None)
        out[bool(compiled)] = loss.detach(), {n: p.grad.clone() for n, p in
                                              sharded.named_parameters()}
        if compiled:
            out["overlapped"] = any(map(overlaps_a_gemm, code))
            out["onednn"] = any("torch.ops.shardplan.onednn_mm.default(" in c for c in code)
    draws = [m for m in sharded.graph_module.modules() if isinstance(m, ModelParallelRNG)]
    out["traced draws"] = len(draws) > 0 and all(m.traceable for m in draws)
    out["breaks"] = sum(counters["graph_break"].values())
    out["layouts"] = sharded.layouts
    return out


def _step_and_code(sharded, args, loss_of, cache_dir: str | None):
    """(loss after forward and backward, the wrapper code inductor generated, for a
    ``cache_dir``: inductor's graph caches off, so that every rank generates its code;
    the C++ kernels compiled into ``cache_dir``, where the ranks share them: inductor
    compiles each kernel once, under a file lock, and the other rank loads it)."""
    import os
    from unittest import mock
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    def step():
        loss = loss_of(sharded(*args))
        loss.backward()
        return loss
    if cache_dir is None:
        return step(), []
    with (mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": cache_dir}),
          inductor_config.patch(fx_graph_cache=False),
          functorch_config.patch(enable_autograd_cache=False)):
        return run_and_get_code(step)


def overlaps_a_gemm(code: str) -> bool:
    """Whether inductor's wrapper ``code`` runs a library GEMM between starting an
    all-reduce and waiting for it (runtime/overlap.py's reordering)."""
    pending = set()
    for line in code.splitlines():
        call = re.match(r"\s*torch\.ops\._c10d_functional\.(all_reduce_|wait_tensor)"
                        r"\.default\((.*?)[,)]", line)
        if call:
            (pending.add if call[1] == "all_reduce_" else pending.discard)(call[2])
        elif pending and re.match(r"\s*extern_kernels\.(addmm|mm)\(", line):
            return True
    return False


def assert_same_draws(ranks):
    """On every rank: compiled == eager (loss, every gradient), every region dropout
    takes the model-parallel stream's state as data, no graph break; the model was
    sharded and its loss is one value on every rank."""
    for r in ranks:
        assert r["traced draws"] and r["breaks"] == 0
        torch.testing.assert_close(r[True][0], r[False][0], atol=1e-6, rtol=1e-6)
        for name, g in r[False][1].items():
            torch.testing.assert_close(r[True][1][name], g, atol=1e-6, rtol=1e-5, msg=name)
    assert any(isinstance(lay, Shard) for lay in ranks[0]["layouts"].values())  # it was sharded
    assert torch.equal(ranks[0][True][0], ranks[1][True][0])  # one loss: replicated output


@pytest.mark.timeout(400)
def test_region_dropout_compiled_draws_the_eager_masks(real_ranks):
    """Dropout inside tensor-parallel regions (split activations, attention
    probabilities) compiles into one graph and draws the masks eager draws from the
    model-parallel stream, with and without recomputation (whose replay must redraw
    them: recomputed with other masks, the gradients would differ from eager's)."""
    pool = real_ranks(2)
    for name, recompute in (("mlp", False), ("gpt", False), ("gpt", True)):
        assert_same_draws(pool.run(dropout_step, name, "aot_eager", recompute))


@pytest.mark.timeout(600)
def test_inductor(tmp_path):
    """Inductor: train-mode dropout (both streams) draws eager's masks (eval mode compiled
    is compared with the unsharded model under aot_eager above, on all four models), and
    the gradients stay eager's with the collectives overlapped (runtime/overlap.py) and
    the forward and input-gradient GEMMs on oneDNN (runtime/onednn.py). Its
    own pool: inductor's C++ compile on a loaded 2-core machine can outlast the shared
    pool's task timeout (it compiles into an empty cache, to read the code: 270 s was
    too short at load 20; the two ranks share that cache, so each kernel compiles once)."""
    with RealRanks(2, timeout=540) as pool:
        ranks = pool.run(dropout_step, "gpt", "inductor", False, str(tmp_path / "inductor"))
    assert_same_draws(ranks)
    # backward: a weight gradient's GEMM runs while its input gradient is all-reduced
    assert all(r["overlapped"] for r in ranks)
    # forward and input-gradient GEMMs ran on oneDNN (runtime/onednn.py)
    assert all(r["onednn"] for r in ranks)


def refuse_simulated(ctx):
    model, kw, _ = make("gpt")
    with pytest.raises(ConfigurationError, match="needs a torch.distributed process group"):
        shardplan.parallelize(model, group=ctx.group, example_inputs=kw, compile=True)
    return True


@pytest.mark.timeout(60)
def test_simulated_ranks_refuse_compile():
    assert SimulatedRanks(2).run(refuse_simulated) == [True, True]


@pytest.mark.timeout(300)
def test_train_compile_option(real_ranks):
    """``python -m shardplan.train --compile [BACKEND]`` (and the demo's): a compiled run (fp32, and fp16
    with the loss scaler) takes the steps the eager one takes."""
    import argparse
    import dataclasses
    from shardplan.train.trainer import parse_args
    from train_cases import train_rank
    from shardplan.train import demo
    assert parse_args(["--compile"]).compile == "inductor"
    ap = argparse.ArgumentParser()
    demo.add_arguments(ap)
    demo_cfg = demo.config_from_args(ap.parse_args(["--compile", "aot_eager"]))
    assert demo.train_config(demo_cfg, "corpus.txt").compile == "aot_eager"
    argv = ["--model", "gpt-tiny", "--tp", "2", "--steps", "2", "--batch-size", "2",
            "--seq-len", "16", "--log-every", "0", "--compile", "aot_eager"]
    compiled = dataclasses.asdict(parse_args(argv))
    assert compiled["compile"] == "aot_eager"
    for cfg in (compiled, dict(compiled, fp16=True, steps=1)):
        eager = real_ranks(2).run(train_rank, dict(cfg, compile=None))
        runs = real_ranks(2).run(train_rank, cfg)
        assert runs[0] == runs[1] and len(runs[0]) == cfg["steps"]
        torch.testing.assert_close(runs[0], eager[0], atol=1e-5, rtol=1e-5)
