"""``runtime.onednn``: the inductor pass that moves a linear layer's forward and
input-gradient GEMMs to oneDNN and keeps the weight gradient on MKL.

Checked on aten graphs traced by ``make_fx`` (no compile, no process group), run
before and after the pass on the same inputs; tests/test_compile.py's
``test_inductor`` runs it inside inductor on real ranks (gradients equal eager's)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardplan.runtime.onednn import OneDnnGemms, onednn_gemms

aten = torch.ops.aten
ONEDNN = torch.ops.shardplan.onednn_mm.default

def linear_fwd_bwd(x, w, b, grad):
    """A linear layer's forward and its three gradients, as autograd computes them."""
    y = aten.addmm.default(b, x, aten.t.default(w))
    grad_x = aten.mm.default(grad, w)
    grad_w = aten.mm.default(aten.t.default(grad), x)
    grad_b = aten.sum.dim_IntList(grad, [0])
    return y, grad_x, grad_w, grad_b


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes
            if n.target in (aten.mm.default, aten.addmm.default, ONEDNN)]


def test_forward_and_input_gradient_move_weight_gradient_stays():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(24, 16, generator=g), torch.randn(8, 16, generator=g)
    b, grad = torch.randn(8, generator=g), torch.randn(24, 8, generator=g)
    gm = make_fx(linear_fwd_bwd, tracing_mode="fake")(x, w, b, grad)
    want = gm(x, w, b, grad)
    assert targets(gm) == [aten.addmm.default, aten.mm.default, aten.mm.default]
    assert onednn_gemms(gm.graph) == 2
    gm.recompile()
    gm.graph.lint()
    # the weight gradient's first operand is transposed: it stays on MKL
    assert targets(gm) == [ONEDNN, ONEDNN, aten.mm.default]
    for got, ref in zip(gm(x, w, b, grad), want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_other_gemms_stay():
    """fp64, ``addmm`` with beta != 1 and a 2-D bias are left to aten."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 4, generator=g), torch.randn(4, 3, generator=g)

    def gemms(x, w, x64, w64, c):
        return (aten.mm.default(x64, w64), aten.addmm.default(c[0], x, w, beta=0.5),
                aten.addmm.default(c, x, w))
    args = (x, w, x.double(), w.double(), torch.randn(6, 3, generator=g))
    gm = make_fx(gemms, tracing_mode="fake")(*args)
    assert onednn_gemms(gm.graph) == 0
    assert ONEDNN not in targets(gm)


def test_the_op_is_the_gemm():
    """``onednn_mm`` against ``torch.mm`` (+ bias) for each operand layout a linear
    layer hands it (weight transposed or not)."""
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(32, 16, generator=g), torch.randn(16, 8, generator=g)
    bias = torch.randn(8, generator=g)
    for b in (w, w.t().contiguous().t()):
        torch.testing.assert_close(ONEDNN(a, b), a @ b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ONEDNN(a, b, bias), a @ b + bias, atol=1e-5, rtol=1e-5)


def test_switched_off_keeps_mkl():
    """``torch.backends.mkldnn`` switched off while inductor compiles: the pass
    leaves the graph alone, and says so in its cache key."""
    x, w = torch.randn(4, 3), torch.randn(2, 3)
    gm = make_fx(lambda x, w: aten.mm.default(x, aten.t.default(w)), tracing_mode="fake")(x, w)
    on = OneDnnGemms().uuid()
    torch.backends.mkldnn.enabled = False
    try:
        OneDnnGemms()(gm.graph)
        assert OneDnnGemms().uuid() != on
    finally:
        torch.backends.mkldnn.enabled = True
    assert targets(gm) == [aten.mm.default]
    OneDnnGemms()(gm.graph)
    assert targets(gm) == [ONEDNN]
