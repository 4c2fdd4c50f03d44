"""``runtime.overlap``: the inductor pass that starts each collective before the
compute that does not need it and waits only where the result is read.

The pass is checked on hand-built post-grad graphs (no process group needed);
tests/test_compile.py's ``test_inductor`` checks it inside inductor on real
ranks: the gradients stay eager's and a GEMM runs inside an all-reduce."""

from __future__ import annotations

import torch
import torch.fx as fx

from shardplan.runtime.overlap import OverlapCollectives

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def call(g: fx.Graph, name: str, target, *args) -> fx.Node:
    return g.create_node("call_function", target, args, name=name)


def backward_of_a_column_linear():
    """Autograd's order: input gradient, weight gradient, bias gradient, then the
    copy-to-region mapping's all-reduce of the input gradient (functional, as in
    inductor's post-grad graph), its wait, the norm's backward reading it, and a side
    effect that nothing may cross."""
    g = fx.Graph()
    grad, weight, x = g.placeholder("grad"), g.placeholder("weight"), g.placeholder("x")
    gi = call(g, "gi", aten.mm.default, grad, weight)
    gt = call(g, "gt", aten.permute.default, grad, [1, 0])
    gw = call(g, "gw", aten.mm.default, gt, x)
    gb = call(g, "gb", aten.sum.dim_IntList, grad, [0])
    ar = call(g, "ar", c10d.all_reduce.default, gi, "sum", "0")
    wait = call(g, "wait", c10d.wait_tensor.default, ar)
    later = call(g, "later", aten.mul.Tensor, x, 2.0)
    norm = call(g, "norm", aten.add.Tensor, wait, later)
    state = g.placeholder("state")
    call(g, "copy", aten.copy_.default, state, x)
    after = call(g, "after", aten.mul.Tensor, norm, 3.0)
    g.output((gw, gb, after))
    return g


def order(graph: fx.Graph) -> list[str]:
    return [n.name for n in graph.nodes if n.op == "call_function"]


def test_weight_gradient_runs_inside_the_all_reduce():
    g = backward_of_a_column_linear()
    OverlapCollectives()(g)
    g.lint()  # still topologically sorted
    assert order(g) == ["gi", "ar", "gt", "gw", "gb", "later", "wait", "norm", "copy", "after"]


def test_the_reordered_graph_computes_the_same_values():
    """Without a process group: the all-reduce and wait replaced by identities, the
    reordered graph returns what the traced order returns."""
    g = backward_of_a_column_linear()
    OverlapCollectives()(g)
    for n in g.nodes:
        if n.target in (c10d.all_reduce.default, c10d.wait_tensor.default):
            n.target, n.args = aten.alias.default, n.args[:1]
    ref = backward_of_a_column_linear()
    for n in ref.nodes:
        if n.target in (c10d.all_reduce.default, c10d.wait_tensor.default):
            n.target, n.args = aten.alias.default, n.args[:1]
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(4, 3, generator=gen), torch.randn(3, 5, generator=gen),
              torch.randn(4, 5, generator=gen), torch.zeros(4, 5)]
    got = fx.GraphModule({}, g)(*[t.clone() for t in inputs])
    want = fx.GraphModule({}, ref)(*[t.clone() for t in inputs])
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_nothing_crosses_a_side_effect_or_another_collective():
    """The window a collective draws from ends at the previous barrier: a node before
    an impure op (or an earlier collective) stays before it."""
    g = fx.Graph()
    a, state = g.placeholder("a"), g.placeholder("state")
    early = call(g, "early", aten.mul.Tensor, a, 2.0)
    call(g, "copy", aten.copy_.default, state, a)
    ar1 = call(g, "ar1", c10d.all_reduce_.default, a, "sum", "0")
    w1 = call(g, "w1", c10d.wait_tensor.default, ar1)
    mid = call(g, "mid", aten.mul.Tensor, a, 3.0)
    ar2 = call(g, "ar2", c10d.all_reduce_.default, w1, "sum", "0")
    w2 = call(g, "w2", c10d.wait_tensor.default, ar2)
    g.output((early, mid, w2))
    OverlapCollectives()(g)
    g.lint()
    assert order(g) == ["early", "copy", "ar1", "w1", "ar2", "mid", "w2"]


def test_an_in_place_collective_keeps_its_inputs_readers_before_it():
    """``all_reduce_`` overwrites its input: a node reading the unreduced input must
    not move behind it (it would read the sum); one that does not read it moves."""
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    reads = call(g, "reads", aten.mul.Tensor, a, 2.0)
    other = call(g, "other", aten.mul.Tensor, b, 2.0)
    ar = call(g, "ar", c10d.all_reduce_.default, a, "sum", "0")
    w = call(g, "w", c10d.wait_tensor.default, ar)
    g.output((reads, other, w))
    OverlapCollectives()(g)
    g.lint()
    assert order(g) == ["reads", "ar", "other", "w"]
