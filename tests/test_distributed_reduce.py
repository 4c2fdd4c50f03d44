"""Reductions over a split dim run distributed, and rotary over head-local dims runs
locally: each sharded model equals the unsharded one on every rank (outputs, loss,
gradients) and is really sharded (layouts, parameters per rank); the plan records the
distributed reductions (stat all-reduces of b*s numbers) and what each choice cost."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import shardplan
from shardplan.layouts import Shard
from shardplan.planner.capture import capture
from shardplan.ranks import SimulatedRanks

import split_dim_cases
from checks import assert_equivalent
from hf_cases import inputs, reference, step
from norm_cases import (FAMILIES, Attention, CenteredMLP, NormedMLP, SharedRotaryKey, SoftmaxMLP,
                        attention_weights, build_hf, real_step)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _check_pattern(model, tp, weights: dict[str, str]):
    """verify on simulated ranks, and the plan's layouts of ``weights`` (name -> layout)."""
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    report = shardplan.verify(model, tp, example_inputs=(x,))
    assert report.ok, str(report)
    plan = shardplan.plan(model, tp, example_inputs=(x,))
    assert {n: plan.param(n).layout for n in weights} == weights
    assert not plan.warnings, plan.warnings
    for n in weights:
        assert plan.param(n).local_shape != plan.param(n).global_shape, n
    return plan


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("rotary", ["interleaved", "complex"])
def test_rotary_over_head_local_dims_is_sharded(rotary, tp):
    """Partial interleaved rotary (slice the first dims of each head, stack/flatten, cat
    the rest) and complex rotary (unbind pairs, polar, view_as_complex) run per head."""
    plan = _check_pattern(Attention(rotary), tp, {"q.weight": "S(0)", "k.weight": "S(0)",
                                                  "v.weight": "S(0)", "o.weight": "S(1)"})
    # Megatron's one g (the input needs no gradient: no f), nothing more
    assert [c.purpose for c in plan.collectives] == ["g"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [2, 4])
def test_shared_rotary_key_enters_the_heads_before_its_expand(tp):
    """DeepSeek's rotary key, one for all heads, expanded to every head: its f sums the
    gradient of the b*s*rope numbers before the expand, not the b*heads*s*rope after it;
    every rank equals the unsharded model, q/k/v column and o row parallel."""
    x, (b, t, c, heads, rope) = split_dim_cases.example(), (2, 6, 32, 4, 4)
    model = SharedRotaryKey(c, heads, rope)
    results = SimulatedRanks(tp).run(split_dim_cases.step, model, x)
    assert_equivalent(results, split_dim_cases.reference(model, x))
    _sharded_on_every_rank(results, {"q.weight": Shard(0), "k.weight": Shard(0),
                                     "v.weight": Shard(0), "o.weight": Shard(1)})
    for records in (r[4] for r in results):  # the rotary key's f; o's g
        assert _ledger(records) == Counter({("all_reduce", "backward", b * t * rope): 1,
                                            ("all_reduce", "forward", b * t * c): 1})
    assert [(c.purpose, c.elements) for c in results[0][5].collectives] == [
        ("f", b * t * rope), ("g", b * t * c)]


@pytest.mark.parametrize("tp", [2, 4])
def test_norm_over_all_heads_is_distributed(tp):
    """OLMo2's q/k RMSNorm over the whole width: each rank sums the squares of its heads,
    one all-reduce of b*s numbers forward (and its f backward) per norm; the norm weight
    is split with the heads."""
    plan = _check_pattern(Attention(qk_norm=True), tp, {
        "q.weight": "S(0)", "k.weight": "S(0)", "v.weight": "S(0)", "o.weight": "S(1)",
        "q_norm.weight": "S(0)", "k_norm.weight": "S(0)"})
    stats = [c for c in plan.collectives if c.purpose == "stat"]
    assert [(c.kind, c.direction, c.elements) for c in stats] == [("all_reduce", "forward", 12)] * 2
    assert [(c.module, c.chosen) for c in plan.choices] == [("q_norm", "distributed"),
                                                            ("k_norm", "distributed")]
    for c in plan.choices:  # replicating the region would hold more and move more
        assert c.costs["replicated"]["params"] > c.costs["distributed"]["params"]
    assert "over a split dim" in plan.report()
    assert 'class="choice-row" data-chosen="distributed"' in plan.to_html()
    assert shardplan.Plan.from_json(plan.to_json()).choices == plan.choices
    # HF's and DTensor's styles cannot spell it: the model's own norm would see one part
    with pytest.raises(shardplan.LayoutError, match="q_norm.*reduction over the split dim"):
        plan.to_hf_tp_plan(model=Attention(qk_norm=True))


@pytest.mark.parametrize("tp", [2, 4])
def test_mean_and_sum_over_the_split_hidden_dim(tp):
    """A mean and a sum over the MLP's split hidden dim: distributed, the MLP stays
    column/row parallel."""
    plan = _check_pattern(CenteredMLP(), tp, {"up.weight": "S(0)", "down.weight": "S(1)"})
    assert plan.count(purpose="stat") == 2


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_fused_norm_over_the_split_hidden_dim(norm, tp):
    """aten.layer_norm / aten.rms_norm over a split dim are written out as means: one stat
    all-reduce forward for either (LayerNorm's mean and mean of squares in one message of
    2*b*s numbers, RMSNorm's mean of squares of b*s) and one f backward (LayerNorm's mean
    and inverse deviation stacked); its weight and bias split with the hidden dim."""
    weights = {"up.weight": "S(0)", "down.weight": "S(1)", "norm.weight": "S(0)"}
    if norm == "layer":
        weights["norm.bias"] = "S(0)"
    plan = _check_pattern(NormedMLP(norm), tp, weights)
    stats = 2 if norm == "layer" else 1  # numbers per token in the message
    assert [(c.purpose, c.direction, c.elements) for c in plan.collectives] == [
        ("stat", "forward", 12 * stats), ("f", "backward", 12 * stats), ("g", "forward", 12 * 32)]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "logsumexp"])
def test_softmax_over_the_split_hidden_dim(kind, tp):
    """A softmax, log-softmax or logsumexp over a split dim: the max of the detached input
    and the sum of exps are all-reduced (two stat all-reduces of b*s numbers forward), the
    sum's gradient once backward (its f)."""
    plan = _check_pattern(SoftmaxMLP(kind), tp, {"up.weight": "S(0)", "down.weight": "S(1)"})
    stats = [(c.kind, c.direction, c.elements) for c in plan.collectives if c.purpose == "stat"]
    assert stats == [("all_reduce", "forward", 12)] * 2
    assert plan.count(purpose="f", direction="backward", elements=12) == 1


def test_max_that_needs_its_gradient_is_distributed():
    """``x - x.amax(-1)`` over a split dim: written out as the max of the detached input
    (all-reduced by max), then the sum of the elements at it and their count (one
    stacked sum of 2*b*s numbers), so the region stays column/row parallel; the ties case is
    ``test_written_out_reductions_equal_on_every_rank``."""
    plan = _check_pattern(SoftmaxMLP("amax"), 2, {"up.weight": "S(0)", "down.weight": "S(1)"})
    assert [c.chosen for c in plan.choices] == ["distributed"]
    assert [(c.kind, c.elements) for c in plan.collectives if c.purpose == "stat"] == [
        ("all_reduce", 12), ("all_reduce", 24)]  # the max (by max), the stacked sums


class Score(torch.nn.Module):
    """A tiny projection averaged over its outputs: one score per token."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(4, 8)

    def forward(self, x):
        return torch.tanh(self.up(x)).mean(-1)


def test_choice_keeps_replicated_when_distributing_costs_more():
    """The cost decides: a mean whose distributed form would move more (one number per
    token of a large example) than the replicated region holds (a 4x8 weight) stays
    replicated, and the plan says so with both costs."""
    model = Score()
    x = torch.randn(16, 64, 4)
    plan = shardplan.plan(model, 2, example_inputs=(x,))
    assert plan.param("up.weight").layout == "R"
    (c,) = plan.choices
    assert c.chosen == "replicated"
    assert c.costs["replicated"]["moved"] + c.costs["replicated"]["params"] < \
        c.costs["distributed"]["moved"] + c.costs["distributed"]["params"]
    assert shardplan.verify(model, 2, example_inputs=(x,)).ok


@pytest.mark.parametrize("kind", FAMILIES)
def test_hf_family_shards_attention(kind):
    """GPT-J, Cohere, GLM, Helium (interleaved / partial rotary) and OLMo2 (q/k norm over
    all heads) at tp 2 and 4 (one capture): every rank's logits, loss and gradients equal
    HF's own, q/k/v are column and o row parallel on every rank, and the attention and
    MLP weights are held at 1/tp per rank; every rank's ledger is the plan's collectives."""
    model = build_hf(kind, heads=4)
    kw = inputs()
    captured, ref = capture(model, (), kw), reference(model, kw)
    for tp in (2, 4):
        results = SimulatedRanks(tp).run(step, model, kw, True, captured)
        assert_equivalent(results, ref)
        for layouts in (r[3] for r in results):
            for name, role in attention_weights(model).items():
                assert layouts[name] == Shard(0 if role == "column" else 1), (tp, name)
        plan = results[0][5]
        attn_mlp = [p for p in plan.params if ".0." in p.name and len(p.global_shape) == 2]
        assert all(p.bytes_per_rank * tp == p.global_shape[0] * p.global_shape[1] * 4
                   for p in attn_mlp), [(p.name, p.layout) for p in attn_mlp]
        # what ranks ran is what the plan says (the padded logits' gather aside: the plan
        # counts it unpadded)
        for records in (r[4] for r in results):
            assert Counter((r.kind, r.direction, r.elements) for r in records
                           if r.kind != "all_gather") == \
                Counter((c.kind, c.direction, c.elements) for c in plan.collectives
                        if c.purpose != "gather_output")
        if kind == "olmo2":
            assert plan.count(purpose="stat") == 2
            assert plan.param("model.layers.0.self_attn.q_norm.weight").layout == "S(0)"


@pytest.mark.real
@pytest.mark.timeout(300)
def test_real_gloo_interleaved_rotary_and_distributed_norm(real_ranks):
    """One launch of 2 gloo ranks: GPT-J (partial interleaved rotary) and OLMo2 (q/k norm
    over all heads) equal HF's own on every rank; the sparse coder's gathered top-k, the
    written-out max with tied maxima and F.normalize, and GroupNorm over whole groups
    equal the unsharded model on every rank, their GEMMs split and ledgers as simulated."""
    kw = inputs()
    ranks = real_ranks(2)
    for kind in ("gptj", "olmo2"):
        results = ranks.run(real_step, kind, kw)
        assert_equivalent(results, reference(build_hf(kind), kw))
        assert all(r[3]["model.layers.0.self_attn.q_proj.weight" if kind == "olmo2"
                        else "transformer.h.0.attn.q_proj.weight"] == Shard(0) for r in results)
    x, tokens = split_dim_cases.example(), 12
    for name, split, want in [
            ("sparse_coder", "enc.weight", {("all_gather", "forward", 8 * 256): 1,
                                            ("all_reduce", "backward", 8 * 256): 1,
                                            ("all_gather", "forward", 8 * 16): 1}),
            ("amax_ties", "up.weight", {("all_reduce", "forward", tokens): 1,
                                        ("all_reduce", "forward", 2 * tokens): 1,
                                        ("all_reduce", "backward", tokens): 1,
                                        ("all_reduce", "forward", tokens * 32): 1}),
            ("normalize", "up.weight", {("all_reduce", "forward", tokens): 1,
                                        ("all_reduce", "backward", tokens): 1,
                                        ("all_reduce", "forward", tokens * 32): 1}),
            ("group_norm", "norm.weight", {("all_reduce", "forward", tokens * 32): 1})]:
        model = split_dim_cases.build(name)
        xs = split_dim_cases.example(4, 16) if name == "sparse_coder" else x
        results = ranks.run(split_dim_cases.step, model, xs)
        assert_equivalent(results, split_dim_cases.reference(model, xs))
        assert all(r[3][split] == Shard(0) for r in results), name
        assert all(_ledger(r[4]) == Counter(want) for r in results), name


# --------------------------------------------------------------------------- split_dim_cases

def _ledger(records) -> Counter:
    return Counter((r.kind, r.direction, r.elements) for r in records)


def _sharded_on_every_rank(results, weights: dict):
    """Every rank holds ``weights`` (name -> Shard) split: its layout and its part's size."""
    for layouts, grads in ((r[3], r[2]) for r in results):
        for name, lay in weights.items():
            assert layouts[name] == lay, name
            assert grads[name].shape[lay.dim] * len(results) == \
                results[0][5].param(name).global_shape[lay.dim], name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [2, 4])
def test_gather_move_keeps_a_wide_projection_sharded(tp):
    """A sort (for a top-k) over a wide encoder's split features has no rule: the planner
    all-gathers the encoder's output at the sort (backward: this rank's slice of the
    gradient), keeping the encoder column parallel, as that moves fewer bytes than the
    encoder's replicated weights and gradients cost. Every rank equals the unsharded
    model; the ledger is the hand count; the choice records both costs by hand too."""
    x = split_dim_cases.example(4, 16)  # 8 tokens, 16 -> 256 -> 16
    t, n, d = 8, 256, 16
    model = split_dim_cases.build("sparse_coder")
    results = SimulatedRanks(tp).run(split_dim_cases.step, model, x)
    assert_equivalent(results, split_dim_cases.reference(model, x))
    _sharded_on_every_rank(results, {"enc.weight": Shard(0), "enc.bias": Shard(0)})
    # the sort's input gathered (t*n), its latents' gradient summed by the decoder's f
    # (t*n; the decoder opens on the replicated latents), its output gathered (t*d)
    want = Counter({("all_gather", "forward", t * n): 1, ("all_reduce", "backward", t * n): 1,
                    ("all_gather", "forward", t * d): 1})
    for records in (r[4] for r in results):
        assert _ledger(records) == want
    plan = results[0][5]
    assert [(c.purpose, c.kind, c.elements) for c in plan.collectives if c.purpose == "gather"] \
        == [("gather", "all_gather", t * n)]
    (c,) = plan.choices
    assert (c.nodes, c.chosen, list(c.costs)) == (["sort"], "gathered", ["replicated", "gathered"])
    enc, dec = n * d + n, d * n + d  # elements; 4 bytes each, twice with the gradient
    assert c.costs["gathered"] == {"moved": 4 * (2 * t * n + t * d), "params": 8 * (enc + dec) // tp}
    assert c.costs["replicated"] == {"moved": 4 * (t * n + t * d), "params": 8 * (enc + dec // tp)}
    assert "*gathered" in plan.report()
    assert 'class="choice-row" data-chosen="gathered"' in plan.to_html()
    assert shardplan.Plan.from_json(plan.to_json()).choices == plan.choices
    if tp == 2:  # neither export can spell it: the model's own sort would see one part
        with pytest.raises(shardplan.LayoutError, match="enc.*all-gathered for an op"):
            plan.to_hf_tp_plan(model=model)


def test_gather_move_loses_to_replication_on_many_tokens():
    """The same sparse coder with 2048 example tokens: gathering 2048 x 256 activations
    costs more than holding the encoder whole, so the region stays replicated (equal)."""
    model, x = split_dim_cases.build("sparse_coder"), split_dim_cases.example(256, 16, batch=8)
    plan = shardplan.plan(model, 2, example_inputs=(x,))
    (c,) = plan.choices
    assert c.chosen == "replicated" and plan.param("enc.weight").layout == "R"
    assert sum(c.costs["gathered"].values()) > sum(c.costs["replicated"].values())
    assert plan.count(purpose="gather") == 0
    assert shardplan.verify(model, 2, example_inputs=(x,)).ok


# the stat all-reduces (forward) and f's (backward) of each written-out reduction over the
# split hidden dim, counted by hand: (direction, numbers per token) -> how many
_STATS = {
    # the mean and mean of squares in one message; the variance's f
    "var": {("forward", 2): 1, ("backward", 1): 1},
    # the model's own mean and its f; std's stacked moments and its f
    "std": {("forward", 1): 1, ("forward", 2): 1, ("backward", 1): 2},
    "normalize": {("forward", 1): 1, ("backward", 1): 1},  # the sum of squares; its f
    # the stacked moments over (4, 16); the mean and inverse deviation's one f
    "layer_norm_2d": {("forward", 2): 1, ("backward", 2): 1},
    # the max (by max); the sum at the maxima and their count stacked; the max's f
    "amax": {("forward", 1): 1, ("forward", 2): 1, ("backward", 1): 1},
    "amax_ties": {("forward", 1): 1, ("forward", 2): 1, ("backward", 1): 1},
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", split_dim_cases.REDUCTIONS)
def test_written_out_reductions_equal_on_every_rank(kind):
    """var / std with a correction, F.normalize, a LayerNorm over two trailing dims and a
    max with a gradient, each over the split hidden dim of an up/down MLP, at tp 2: every
    rank equals the unsharded model (a max's gradient shared evenly among tied maxima,
    across ranks, as torch shares it), the MLP stays column/row parallel, and each
    rank's ledger is the hand count."""
    x, tp, tokens = split_dim_cases.example(), 2, 12
    model = split_dim_cases.build(kind)
    results = SimulatedRanks(tp).run(split_dim_cases.step, model, x)
    assert_equivalent(results, split_dim_cases.reference(model, x))
    _sharded_on_every_rank(results, {"up.weight": Shard(0), "down.weight": Shard(1)})
    want = Counter({("all_reduce", d, tokens * n): k for (d, n), k in _STATS[kind].items()})
    want[("all_reduce", "forward", tokens * 32)] += 1  # down's g
    for records in (r[4] for r in results):
        assert _ledger(records) == want
    assert [c.chosen for c in results[0][5].choices] == ["distributed"]
    if kind == "amax_ties":  # the maxima tie within and across the ranks' halves
        h = model.up(x).clamp(max=0.2)
        at_max = h == h.amax(-1, keepdim=True)
        assert (at_max[..., :32].any(-1) & at_max[..., 32:].any(-1)).all()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,groups,local", [(2, 4, True), (4, 4, True), (4, 2, False)])
def test_group_norm_over_whole_groups_is_local(tp, groups, local):
    """GroupNorm over the split hidden channels: each rank holding whole groups normalizes
    them alone (groups / tp groups, its part of the weight and bias; no communication but
    down's g); groups cut by the split (2 groups at tp 4) stop the region there, and
    every rank still equals the unsharded model."""
    x, tokens = split_dim_cases.example(), 12
    model = split_dim_cases.build("group_norm", groups=groups)
    results = SimulatedRanks(tp).run(split_dim_cases.step, model, x)
    assert_equivalent(results, split_dim_cases.reference(model, x))
    plan = results[0][5]
    if local:
        _sharded_on_every_rank(results, {"up.weight": Shard(0), "down.weight": Shard(1),
                                         "norm.weight": Shard(0), "norm.bias": Shard(0)})
        for records in (r[4] for r in results):
            assert _ledger(records) == Counter({("all_reduce", "forward", tokens * 32): 1})
    else:
        assert plan.param("norm.weight").layout == "R"
        assert [c.nodes for c in plan.choices] == [["group_norm"]]
