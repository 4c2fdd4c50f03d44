"""Sequence parallelism: the activations between the regions held on 1/tp of the sequence.

Every case compares with the unsharded model on every rank (outputs, loss,
every gradient) and checks that the sequence really was sharded: the block
outputs are ``S(seq)``, the ledger holds reduce-scatters and all-gathers
where the plain plan all-reduces (counted here from layers, b, s, h), and
each rank keeps fewer bytes for backward than the plain plan.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardplan.errors import ConfigurationError
from shardplan.models import build
from shardplan.planner.capture import capture
from shardplan.ranks import SimulatedRanks

from checks import assert_grads
from hf_cases import nonzero_biases
from sp_cases import (SequenceFirst, autocast_step, dropout_steps, hf_real_steps, real_step,
                      step)

B, T = 2, 8


def _bundled(name):
    torch.manual_seed(0)
    model = nonzero_biases(build(name)).eval()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    tgt = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    return model, (idx, tgt)


def _reference(model, args, kwargs, loss_of):
    ref = copy.deepcopy(model)
    out = ref(*args, **kwargs)
    loss_of(out).backward()
    logits = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
    return logits.detach(), {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)
                             if p.grad is not None}, loss_of(out).detach()


def _assert_equal(results, model, args, kwargs=None, loss_of=None, tol=None):
    kwargs = kwargs or {}
    tol = tol or dict(atol=3e-5, rtol=1e-4)
    loss_of = loss_of or (lambda o: o[1] if isinstance(o, tuple) else o.loss)
    logits, grads, loss = _reference(model, args, kwargs, loss_of)
    for r in results:
        torch.testing.assert_close(r[0], logits, **tol)
        torch.testing.assert_close(r[1], loss, **tol)
    # every copy: each rank's replica, each member of a K/V replica group
    assert_grads(results[0][3], [r[2] for r in results], grads, **tol)


def _run(model, args, kwargs, tp, sp=True, loss_of=None):
    return SimulatedRanks(tp).run(step, model, args, kwargs, capture(model, args, kwargs), sp,
                                  loss_of)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_bundled_equals_unsharded(name, tp):
    model, args = _bundled(name)
    results = _run(model, args, {}, tp)
    _assert_equal(results, model, args)
    cfg = model.config
    layers = getattr(cfg, "n_layer", None) or cfg.n_layers
    _assert_plan_shows_sequence(results[0][5], layers)
    _assert_mlps_in_gathered_order([r[8] for r in results], layers)


def _assert_mlps_in_gathered_order(per_rank, layers):
    """On every rank each block's MLP (and only it: attention needs the sequence order)
    runs on the tokens as the gather left them, its gathering linears and its scatter;
    every other scatter (attention's, the embedding's) reads its narrower inputs (the
    attention output, the token ids) in that order."""
    for names in per_rank:
        assert sum(n.startswith("tp_seq_linear") for n in names) == layers, names
        assert sum(n.startswith("tp_seq_scatter") for n in names) == 2 * layers + 1, names


def _assert_plan_shows_sequence(plan, layers):
    """The plan (as JSON) puts every block's norms on S(seq), between a reduce-scatter
    and an all-gather with their bytes, and its reports show them."""
    from shardplan.planner.plan import Plan
    plan = Plan.from_json(plan.to_json())
    assert plan.sequence_parallel
    norms = {d.module for d in plan.decisions if d.sequence and d.node.startswith(
        ("layer_norm", "rms_norm", "mul"))}
    for i in range(layers):
        assert any(f".{i}." in m for m in norms), (i, sorted(norms))
    for purpose, kinds in (("seq_scatter", ("reduce_scatter", "all_gather")),
                           ("seq_gather", ("all_gather", "reduce_scatter"))):
        for kind, direction in zip(kinds, ("forward", "backward")):
            assert plan.count(purpose=purpose, kind=kind, direction=direction) >= 2 * layers
    assert not plan.count(purpose="g")
    text, html = plan.report(), plan.to_html()
    assert "sequence parallel:" in text and "S(seq)" in text and "reduce_scatter" in text
    assert 'cpill seq_scatter' in html and 'cpill seq_gather' in html and "S(seq) S(1)" in html


def test_gpt_ledger_counts():
    """Per layer 2 reduce-scatters and 2 all-gathers of b*s*h forward (and the same
    backward, plus an all-gather re-gathering each column linear's input), one more of
    each for the embedding and the LM head; the gradient sums of the per-token tensors
    in one flat all-reduce per step: each block's ln_1, ln_2 weight and bias and two row
    biases (6h), ln_f's weight and bias (2h) and the position embedding's output (T*h).
    So 10L + 9 calls a step, the loss's three all-reduces included. With recomputation
    the graph runs block by block: one flat all-reduce per block."""
    model, args = _bundled("gpt-tiny")
    cfg, tp = model.config, 2
    L, h = cfg.n_layer, cfg.n_embd
    results = _run(model, args, {}, tp)
    for records in (r[4] for r in results):
        fwd = sorted((r.kind, r.elements) for r in records if r.direction == "forward")
        bwd = sorted((r.kind, r.elements) for r in records if r.direction == "backward")
        full = B * T * h
        assert fwd.count(("reduce_scatter", full)) == 2 * L + 1
        assert fwd.count(("all_gather", full)) == 2 * L + 1
        assert not [k for k, n in fwd if k == "all_reduce" and n == full]
        assert bwd.count(("all_gather", full)) == 2 * (2 * L + 1)  # and the linears' inputs
        assert bwd.count(("reduce_scatter", full)) == 2 * L + 1
        sums = sorted(n for k, n in bwd if k == "all_reduce")
        assert sums == [6 * h * L + 2 * h + T * h]
        assert len(records) == 10 * L + 9 + 1  # and the logits' gather (gather_output)
    plan = results[0][5]
    assert plan.count(purpose="seq_scatter", direction="forward") == 2 * L + 1
    assert not plan.count(purpose="seq_grad")  # wpe's output is in the bucket
    buckets = [c for c in plan.collectives if c.purpose == "seq_grad_bucket"]
    assert [c.elements for c in buckets] == [6 * h * L + 2 * h + T * h]
    assert plan.count(purpose="seq_regather", kind="all_gather", direction="backward") == 2 * L + 1
    assert len(plan.collectives) - plan.count(purpose="gather_output") == 10 * L + 9
    recomputed = SimulatedRanks(tp).run(step, model, args, {}, capture(model, args, {}), True,
                                        None, True)
    for records in (r[4] for r in recomputed):
        sums = sorted(r.elements for r in records
                      if r.kind == "all_reduce" and r.direction == "backward")
        assert sums == sorted([6 * h] * L + [2 * h + T * h])
    buckets = [c for c in recomputed[0][5].collectives if c.purpose == "seq_grad_bucket"]
    assert sorted(c.elements for c in buckets) == sorted([6 * h] * L + [2 * h + T * h])


def test_saved_activations_hold_only_tokens():
    """No [B, T, h] activation is kept for backward: the ops between regions keep
    [B, T/tp, h], and the linears reading an all-gather keep the shard (gathered
    again in backward) where the plain plan keeps the whole norm output."""
    model, args = _bundled("gpt-tiny")
    h, L, tp = model.config.n_embd, model.config.n_layer, 2
    sp_runs, plain_runs = _run(model, args, {}, tp, True), _run(model, args, {}, tp, False)
    for sp_rank, plain_rank in zip(sp_runs, plain_runs):  # every rank
        (sp_bytes, sp_shapes), (plain_bytes, plain_shapes) = sp_rank[7], plain_rank[7]
        assert (B, T, h) in plain_shapes
        assert (B, T, h) not in sp_shapes, sorted(sp_shapes)
        assert (B, T // tp, h) in sp_shapes
        # per layer the plain plan keeps (at least) both norms' inputs and outputs whole
        assert plain_bytes - sp_bytes >= L * 4 * B * T * h * 4 * (1 - 1 / tp), (sp_bytes,
                                                                                 plain_bytes)


@pytest.mark.parametrize("recompute,dtype", [(True, torch.float32), (False, torch.bfloat16)])
def test_recompute_and_bf16(recompute, dtype):
    model, args = _bundled("llama-tiny")
    model = model.to(dtype)
    cap = capture(model, args, {})
    results = SimulatedRanks(2).run(step, model, args, {}, cap, True, None, recompute)
    tol = dict(atol=3e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    _assert_equal(results, model, args, tol=tol)
    assert results[0][5].count(purpose="seq_regather") > 0


def test_bf16_autocast():
    """The linears keeping the shard run under autocast (bf16 forward, fp32 weights)."""
    model, args = _bundled("gpt-tiny")
    cap = capture(model, args, {})
    sp = SimulatedRanks(2).run(autocast_step, model, args, cap, True)
    plain = SimulatedRanks(2).run(autocast_step, model, args, cap, False)
    for rank_sp, rank_plain in zip(sp, plain):  # every rank
        assert rank_sp[1] == {torch.float32}
        assert rank_sp[0] == pytest.approx(rank_plain[0], rel=1e-2)


def test_sequence_first_model():
    """[T, B, H] activations: the tokens are split on dim 0, as in Megatron."""
    torch.manual_seed(0)
    model = SequenceFirst().eval()
    idx = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    loss_of = lambda o: o.square().mean()  # noqa: E731
    results = _run(model, (idx,), {}, 2, loss_of=loss_of)
    _assert_equal(results, model, (idx,), loss_of=loss_of)
    plan = results[0][5]
    assert {d.layout for d in plan.decisions if d.sequence} == {"S(0)"}
    # the embedding stays replicated here (its output is sliced onto the tokens), so the
    # first block's q, k, v read it through f; every other linear re-gathers its input
    assert plan.count(purpose="seq_scatter", direction="forward") == 2 * 2
    # (once for the linears reading one gather): block 1's fc, block 2's q-k-v and fc, head
    assert plan.count(purpose="seq_regather") == 4


def test_sequence_not_divisible_by_tp():
    model, _ = _bundled("gpt-tiny")
    idx = torch.randint(0, 50, (2, 7))
    with pytest.raises(ConfigurationError, match=r"sequence length 7 does not divide by tp=2"):
        _run(model, (idx, idx), {}, 2)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_hf_equals_unsharded(kind, tp):
    pytest.importorskip("transformers")
    from hf_cases import build as hf_build, inputs
    model = hf_build(kind, heads=8, kv_heads=4)
    kw = inputs(B, T)
    results = _run(model, (), kw, tp)
    _assert_equal(results, model, (), kw)
    plan = results[0][5]
    assert plan.count(purpose="seq_scatter") > 0
    if kind == "gpt2":
        _assert_conv1d_on_tokens(results, model.config)
    if kind == "llama" and tp == 2:
        _assert_llama_ledger(results, model.config)


def _assert_conv1d_on_tokens(results, cfg):
    """HF Conv1D flattens batch x sequence around its addmm; the norm outputs are still
    all-gathered into the c_attn and c_fc regions (no f), and the c_proj sums are
    reduce-scattered after the view that gives the sequence back its dim: no all-reduce
    and slice fallback, on any rank."""
    L, h = cfg.n_layer, cfg.n_embd
    plan = results[0][5]
    assert not [w for w in plan.warnings if "falls back" in w], plan.warnings
    assert plan.count(purpose="g") == 0 and plan.count(purpose="f") == 1  # the LM head's
    assert plan.count(purpose="seq_scatter", direction="forward") == 2 * L + 1
    assert plan.count(purpose="seq_gather", direction="forward") == 2 * L
    for records in (r[4] for r in results):
        fwd = [(r.kind, r.elements) for r in records if r.direction == "forward"]
        assert fwd.count(("reduce_scatter", B * T * h)) == 2 * L + 1
        assert not [n for k, n in fwd if k == "all_reduce" and n == B * T * h]


def test_plan_bucket_counts_every_stamped_block():
    """``plan()`` captures five identical blocks as three and stamps them: its one bucket
    per step sums every block's 6h per-token parameters, ln_f's 2h and the position
    embedding's T*h."""
    import shardplan
    torch.manual_seed(0)
    L = 5
    model = build("gpt-tiny", n_layer=L)
    h = model.config.n_embd
    idx = torch.zeros(B, T, dtype=torch.long)
    p = shardplan.plan(model, 2, example_inputs=(idx, idx), sequence_parallel=True)
    assert [c.elements for c in p.collectives
            if c.purpose == "seq_grad_bucket"] == [6 * h * L + 2 * h + T * h]


def _assert_llama_ledger(results, cfg):
    """Counted from the config: per layer the o_proj and down_proj outputs are
    reduce-scattered and the two norms' outputs all-gathered (q, k, v share one; gate
    and up one), plus the embedding's scatter and the final norm's gather; backward
    mirrors them and re-gathers the input of q, k, v (once for the three) and of gate
    and up (once for the two). HF slices the final hidden states (``logits_to_keep=0``
    keeps every position, a slice that runs on the shard), so the LM head opens on the
    final norm's gather like any column linear: a reduce-scatter backward and a
    re-gather. The norms' weights have their gradients summed in one flat all-reduce per
    step: every block's two and the final one."""
    L, h = cfg.num_hidden_layers, cfg.hidden_size
    full = B * T * h
    for records in (r[4] for r in results):
        fwd = [(r.kind, r.elements) for r in records if r.direction == "forward"]
        bwd = [(r.kind, r.elements) for r in records if r.direction == "backward"]
        assert fwd.count(("reduce_scatter", full)) == 2 * L + 1
        assert fwd.count(("all_gather", full)) == 2 * L + 1
        assert bwd.count(("reduce_scatter", full)) == 2 * L + 1
        assert bwd.count(("all_gather", full)) == (2 * L + 1) + (2 * L + 1)
        assert [n for k, n in bwd if k == "all_reduce"] == [2 * h * L + h]
        assert not [k for k, n in fwd if k == "all_reduce" and n == full]


@pytest.mark.real
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_real_gloo(real_ranks, name):
    """Two gloo processes: outputs, loss and gradients equal the unsharded model's on
    every rank; each rank sums its per-token gradients in one flat all-reduce (GPT: the
    position embedding's output with the norms' and row biases' parameters)."""
    model, args = _bundled(name)
    results = real_ranks(2).run(real_step, name, args)
    _assert_equal(results, model, args)
    cfg = model.config
    _assert_mlps_in_gathered_order([r[5] for r in results],
                                   getattr(cfg, "n_layer", None) or cfg.n_layers)
    if name == "gpt-tiny":
        L, h = cfg.n_layer, cfg.n_embd
        want = [6 * h * L + 2 * h + T * h]
    else:  # attention and MLP norms' weights, and the final norm's
        L, h = cfg.n_layers, cfg.dim
        want = [2 * h * L + h]
    for r in results:
        assert [n for k, d, n in r[4] if k == "all_reduce" and d == "backward"] == want


@pytest.mark.real
@pytest.mark.timeout(300)
def test_real_gloo_hf(real_ranks):
    """HF GPT-2 (Conv1D), Llama (GQA) and BERT (post-norm), one layer each, on two gloo
    processes, one launch: outputs, loss and every gradient equal the unsharded model's on every rank;
    the blocks run on S(seq) and every rank's ledger reduce-scatters each block's
    sublayer outputs (2 per layer, and the embedding's) where plain all-reduces."""
    pytest.importorskip("transformers")
    from hf_cases import build as hf_build, inputs
    kinds = ("gpt2", "llama", "bert")
    got = real_ranks(2).run(hf_real_steps, kinds, B, T)
    for kind in kinds:
        model, kw = hf_build(kind, heads=8, kv_heads=4, layers=1), inputs(B, T)
        results = [r[kind] for r in got]
        _assert_equal(results, model, (), kw)
        plan = results[0][5]
        L, h = model.config.num_hidden_layers, model.config.hidden_size
        assert plan.sequence_parallel and not [w for w in plan.warnings if "falls back" in w]
        on_tokens = {d.module for d in plan.decisions if d.sequence}
        for i in range(L):
            assert any(f".{i}." in m for m in on_tokens), (kind, i)
        for records in (r[4] for r in results):
            fwd = [(r.kind, r.elements) for r in records if r.direction == "forward"]
            assert fwd.count(("reduce_scatter", B * T * h)) == 2 * L + 1, kind
            assert not [n for k, n in fwd if k == "all_reduce" and n == B * T * h], kind
        if kind == "gpt2":
            _assert_conv1d_on_tokens(results, model.config)


@pytest.mark.real
@pytest.mark.timeout(240)
def test_real_dropout_on_tokens(real_ranks):
    """Dropout between the regions draws from each rank's model-parallel stream: the
    masks differ across ranks, repeat with the same seed, and recomputation redraws
    them, giving bit-identical gradients."""
    (plain0, rec0), (plain1, rec1) = real_ranks(2).run(dropout_steps)
    for plain, rec in ((plain0, rec0), (plain1, rec1)):
        assert len(plain[2]) == 2 * 2 + 1  # the embedding's and two per layer
        for a, b in zip(plain[2], rec[2]):
            assert torch.equal(a, b)
        assert any(m.any() for m in plain[2])
        assert plain[0] == rec[0]
        for name, g in plain[1].items():
            assert torch.equal(g, rec[1][name]), name
    assert not any(torch.equal(a, b) for a, b in zip(plain0[2], plain1[2]))


def test_command_line_switches(capsys):
    """``shardplan plan/verify --sequence-parallel``, the trainer's and the demo's flags."""
    import argparse
    from shardplan.cli import main
    from shardplan.train import demo
    from shardplan.train.trainer import parse_args
    assert main(["plan", "gpt-tiny", "--tp", "2", "--sequence-parallel"]) == 0
    out = capsys.readouterr().out
    assert "sequence parallel:" in out and "seq_scatter" in out
    assert main(["verify", "gpt-tiny", "--tp", "2", "--sequence-parallel"]) == 0
    assert parse_args(["--sequence-parallel"]).sequence_parallel
    ap = argparse.ArgumentParser()
    demo.add_arguments(ap)
    cfg = demo.config_from_args(ap.parse_args(["--sequence-parallel"]))
    assert cfg.sequence_parallel and demo.train_config(cfg, "x.txt").sequence_parallel


@pytest.mark.real
@pytest.mark.timeout(240)
def test_real_training_matches_plain_tp(real_ranks):
    """``python -m shardplan.train --sequence-parallel`` trains as the plain plan does."""
    from train_cases import BASE, rel_close, train_rank
    cfg = dict(BASE, dp=1, steps=3)
    plain = real_ranks(2).run(train_rank, cfg)
    sp = real_ranks(2).run(train_rank, dict(cfg, sequence_parallel=True))
    for a, b in zip(sp, plain):
        rel_close(a, b, 1e-4, "sequence-parallel losses")
