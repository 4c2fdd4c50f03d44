"""Rule kinds: what a kind can read is checked at load, and a new kind is one file.

Also the vocab-parallel lookup of the graph path honouring ``padding_idx``.
"""

from __future__ import annotations

import copy
import re
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

import shardplan
from shardplan.errors import RuleError
from shardplan.layouts import MeshDim, MeshSizes, Shard
from shardplan.models import build
from shardplan.planner.annotate import annotate
from shardplan.planner.capture import capture
from shardplan.planner.choices import cost_of as choices_cost
from shardplan.planner.graph import args_of, shape
from shardplan.planner.kinds import KINDS, Context, Kind, Outcome, register
from shardplan.planner.kinds.base import conflict
from shardplan.planner.rules import _bundled_dir, load_rules
from shardplan.ranks import SimulatedRanks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _rule_file(tmp_path, extra_ops: str):
    """The bundled megatron rules with ``extra_ops`` lines added to [ops]."""
    text = (_bundled_dir() / "megatron.toml").read_text()
    anchor = 'concat = ["aten.cat.default"]'
    assert anchor in text
    path = tmp_path / "rules.toml"
    path.write_text(text.replace(anchor, anchor + "\n" + extra_ops))
    return path


def test_an_op_its_kind_cannot_read_is_rejected_naming_the_kinds_that_can(tmp_path):
    path = _rule_file(tmp_path, 'permute = ["aten.transpose.int", "aten.movedim.int"]')
    text = re.sub(r'^permute = \[.*"aten\.t\.default".*\n', "", path.read_text(), flags=re.M)
    path.write_text(text)
    with pytest.raises(RuleError) as e:
        load_rules(path)
    msg = str(e.value)
    assert "aten.movedim.int is listed under permute, which cannot read its arguments" in msg
    can = [k for k, kind in KINDS.items() if kind.reads(torch.ops.aten.movedim.int)]
    assert can and "permute" not in can
    assert all(k in msg.split("fix:")[1] for k in can)


def test_an_unknown_kind_is_rejected(tmp_path):
    with pytest.raises(RuleError, match="unknown kind 'mirror'"):
        load_rules(_rule_file(tmp_path, 'mirror = ["aten.flip.default"]'))


class _Flip(Kind):
    """A throwaway kind, defined here only: flip keeps a shard unless it flips its dim."""

    name = "flip"
    ops = frozenset({"aten.flip.default"})

    def rule(self, node, lays, ctx):
        lay = lays[(0,)]
        rank = len(shape(node))
        if lay.dim in {d % rank for d in args_of(node)["dims"]}:
            return conflict(node, "flip of the sharded dim")
        return Outcome(lay, rule="flip (other dim)")


@pytest.fixture
def flip_kind():
    register(_Flip)
    yield
    del KINDS["flip"]


class _FlipMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.down(torch.flip(torch.relu(self.up(x)), dims=[1]))


def test_a_kind_registered_from_outside_the_package_shards_through_its_op(tmp_path, flip_kind):
    torch.manual_seed(0)
    model, x = _FlipMLP(), torch.randn(2, 4, 8)
    without = shardplan.plan(model, 2, example_inputs=(x,))
    # unknown op: the split activation is all-gathered for it (cheaper here than keeping
    # the region replicated), down then runs column parallel on the whole value
    assert without.param("up.weight").layout == "S(0)" and without.param("down.weight").layout == "S(0)"
    assert [c.chosen for c in without.choices] == ["gathered"]

    rules = load_rules(_rule_file(tmp_path, 'flip = ["aten.flip.default"]'))
    plan = shardplan.plan(model, 2, example_inputs=(x,), rules=rules)
    assert plan.param("up.weight").layout == "S(0)" and plan.param("down.weight").layout == "S(1)"
    assert plan.warnings == [] and plan.count(purpose="gather") == 0

    want = model(x)

    def rank(ctx):
        sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                        example_inputs=(x,), rules=rules)
        return sharded(x).detach()

    for got in SimulatedRanks(2).run(rank):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class _PaddedEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16, padding_idx=0)
        self.proj = nn.Linear(16, 16)
        with torch.no_grad():
            self.emb.weight[0] = 0.5  # a pad row that is not zero: the forward returns it

    def forward(self, ids):
        return torch.tanh(self.proj(self.emb(ids)))


def test_graph_vocab_lookup_gives_the_pad_row_no_gradient_on_every_rank():
    torch.manual_seed(0)
    model = _PaddedEmbedding()
    ids = torch.tensor([[0, 5, 40, 0], [33, 0, 7, 63]])
    weights = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    ref_out = ref(ids)
    (ref_out * weights).sum().backward()
    assert ref.emb.weight.grad[0].abs().sum() == 0  # nn.Embedding's own rule

    def rank(ctx):
        sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group,
                                        example_inputs=(ids,))
        out = sharded(ids)
        (out * weights).sum().backward()
        grads = {n: p.grad for n, p in sharded.named_parameters()}
        return out.detach(), grads, sharded.layouts["emb.weight"]

    results = SimulatedRanks(2).run(rank)
    for out, grads, layout in results:
        assert isinstance(layout, Shard) and layout.dim == 0  # the embedding was vocab-sharded
        torch.testing.assert_close(out, ref_out.detach(), atol=1e-5, rtol=1e-5)
    full = results[0][2].unshard([g["emb.weight"] for _, g, _ in results], 64)
    torch.testing.assert_close(full, ref.emb.weight.grad, atol=1e-5, rtol=1e-5)
    for rank_index, (_, grads, _) in enumerate(results):  # every rank's shard, whole
        want = ref.emb.weight.grad.chunk(2)[rank_index]
        torch.testing.assert_close(grads["emb.weight"], want, atol=1e-5, rtol=1e-5)


def _annotated(dims: MeshSizes):
    model = build("gpt-tiny", device="meta")
    idx = torch.zeros(2, 8, dtype=torch.long, device="meta")
    return annotate(capture(model, (idx, idx)).gm, dims, load_rules("megatron"))


def test_a_rule_reads_the_size_of_the_mesh_dim_it_is_applied_to():
    ctx = Context(MeshSizes.of(dp_shard=3, tp=2), load_rules("megatron"))
    assert (ctx.dim, ctx.size) == (MeshDim.TP, 2)
    assert replace(ctx, dim=MeshDim.DP_SHARD).size == 3
    # gpt-tiny's widths (32, 96 and 128 features, 4 heads) divide by 2 and 4 but not by 3:
    # had a rule read dp_shard's size, the plan would differ from tp=2 alone
    with_dp, tp2, tp4 = (_annotated(MeshSizes(d)) for d in (
        {MeshDim.DP_SHARD: 3, MeshDim.TP: 2}, {MeshDim.TP: 2}, {MeshDim.TP: 4}))
    assert with_dp.dims == {"dp_shard": 3, "tp": 2} and with_dp.size == 2
    sharded = {t: str(lay) for t, lay in with_dp.params.items() if isinstance(lay, Shard)}
    assert sharded and sharded == {t: str(lay) for t, lay in tp2.params.items()
                                   if isinstance(lay, Shard)}
    key = lambda ann: [(t.purpose, t.src.name, str(t.before), str(t.after))  # noqa: E731
                       for t in ann.transitions]
    assert key(with_dp) == key(tp2)
    # the bytes a rank holds follow tp's size
    assert choices_cost(with_dp).params == choices_cost(tp2).params > choices_cost(tp4).params


def test_the_walkers_traits_hold_of_the_kinds_they_once_listed_by_name():
    """Each trait holds of exactly the kinds the planner's walkers used to name for it,
    and of no op the rule set does not list, nor of a new kind that sets none."""
    was = {"shape_only": {"identity", "reshape", "expand", "permute"},  # split_params
           "per_element": {"identity", "elementwise"},  # column segments, broadcasts
           "keeps_element_order": {"identity", "reshape", "slice"},  # logits to a sink
           "metadata_only": {"inspect", "size"},
           "cuts_or_joins": {"split", "slice", "concat"}}
    for trait, kinds in was.items():
        assert {k for k, kind in KINDS.items() if getattr(kind, trait)} == kinds, trait
    gm = torch.fx.symbolic_trace(lambda x: torch.flip(x, [0]))
    flip = next(n for n in gm.graph.nodes if n.op == "call_function")
    unlisted = Context(MeshSizes.of(tp=2), load_rules("megatron")).kind_at(flip)
    assert unlisted.name == "" and not any(getattr(unlisted, t) for t in was)
    assert not any(getattr(_Flip(), t) for t in was)  # a new kind: none unless it sets it
