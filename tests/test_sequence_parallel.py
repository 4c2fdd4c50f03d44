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
from shardplan.layouts import Shard
from shardplan.models import build
from shardplan.planner.capture import capture
from shardplan.ranks import SimulatedRanks

from sp_cases import real_step, step

B, T = 2, 8


def _bundled(name):
    torch.manual_seed(0)
    model = build(name).eval()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    tgt = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    return model, (idx, tgt)


def _reference(model, args, kwargs, loss_of):
    ref = copy.deepcopy(model)
    out = ref(*args, **kwargs)
    loss_of(out).backward()
    logits = out[0] if isinstance(out, tuple) else out.logits
    return logits.detach(), {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)
                             if p.grad is not None}, loss_of(out).detach()


def _assert_equal(results, model, args, kwargs=None, loss_of=None):
    kwargs = kwargs or {}
    loss_of = loss_of or (lambda o: o[1] if isinstance(o, tuple) else o.loss)
    logits, grads, loss = _reference(model, args, kwargs, loss_of)
    for r in results:
        torch.testing.assert_close(r[0], logits, atol=3e-5, rtol=1e-4)
        torch.testing.assert_close(r[1], loss, atol=3e-5, rtol=1e-4)
    layouts = results[0][3]
    for name, g in grads.items():
        lay = layouts[name]
        parts = [r[2][name] for r in results]
        got = lay.unshard(parts, g.shape[lay.dim]) if isinstance(lay, Shard) else parts[0]
        torch.testing.assert_close(got, g, atol=3e-5, rtol=1e-4, msg=name)
        if not isinstance(lay, Shard):
            for p in parts[1:]:
                torch.testing.assert_close(p, parts[0], msg=f"{name} differs between ranks")


def _run(model, args, kwargs, tp, sp=True):
    return SimulatedRanks(tp).run(step, model, args, kwargs, capture(model, args, kwargs), sp)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_bundled_equals_unsharded(name, tp):
    model, args = _bundled(name)
    results = _run(model, args, {}, tp)
    _assert_equal(results, model, args)
    ann = results[0][6]
    blocks = [n for n in ann.gm.graph.nodes if n.op == "call_function"
              and n.meta.get("nn_module_stack") and ann.on_tokens(n)]
    assert blocks, "nothing was held on the ranks' tokens"


def test_gpt_ledger_counts():
    """Per layer 2 reduce-scatters and 2 all-gathers of b*s*h forward (and the same
    backward), one more of each for the embedding and the LM head; the gradient sums
    of the per-token parameters: ln_1, ln_2 (weight, bias), the two row biases per
    layer, ln_f (weight, bias) and the position embedding."""
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
        assert bwd.count(("all_gather", full)) == 2 * L + 1
        assert bwd.count(("reduce_scatter", full)) == 2 * L + 1
        sums = sorted(n for k, n in bwd if k == "all_reduce")
        per_token = [h] * (6 * L + 2) + [T * h]  # norms and row biases, ln_f, wpe
        assert sums == sorted(per_token)
    plan = results[0][5]
    assert plan.count(purpose="seq_scatter", direction="forward") == 2 * L + 1
    assert plan.count(purpose="seq_grad") == 6 * L + 3


def test_saved_bytes_shrink():
    model, args = _bundled("gpt-tiny")
    sp = _run(model, args, {}, 2, True)
    plain = _run(model, args, {}, 2, False)
    assert sp[0][7] < plain[0][7], (sp[0][7], plain[0][7])


def test_sequence_not_divisible_by_tp():
    model, _ = _bundled("gpt-tiny")
    idx = torch.randint(0, 50, (2, 7))
    with pytest.raises(ConfigurationError, match=r"sequence length 7 does not divide by tp=2"):
        _run(model, (idx, idx), {}, 2)


@pytest.mark.parametrize("kind,tp", [("gpt2", 2), ("llama", 4), ("bert", 2)])
def test_hf_equals_unsharded(kind, tp):
    pytest.importorskip("transformers")
    from hf_cases import build as hf_build, inputs
    model = hf_build(kind, heads=8, kv_heads=4)
    kw = inputs(B, T)
    results = _run(model, (), kw, tp)
    _assert_equal(results, model, (), kw)
    assert results[0][5].count(purpose="seq_scatter") > 0


@pytest.mark.real
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_real_gloo(real_ranks, name):
    model, args = _bundled(name)
    _assert_equal(real_ranks(2).run(real_step, name, args), model, args)
