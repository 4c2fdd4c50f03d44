"""Compiled graphs run a linear layer's forward and input-gradient GEMMs on oneDNN.

Torch's fp32 ``mm`` on the CPU calls MKL, and inductor lowers ``aten.mm`` and
``addmm`` to the same MKL calls (its oneDNN linear lowering takes only frozen,
constant weights: inference). On the AMD EPYC this project measures on, one
thread of oneDNN's matmul was 15-25% faster than MKL's for the shapes of a
linear layer's forward (``x @ W.t()``) and input gradient (``grad @ W``), even
counting the copy of ``W`` the latter needs, and no faster for the weight
gradient (``grad.t() @ x``: both operands transposed, two copies).
``OneDnnGemms`` is an inductor post-grad pass that rewrites every static-shape
fp32 CPU ``mm(a, b)`` and ``addmm(bias, a, b)`` whose ``a`` is contiguous into
``shardplan::onednn_mm``, which calls torch's oneDNN linear
(``torch.ops.mkldnn._linear_pointwise``) on ``a`` and ``b.t()``; weight
gradients stay on MKL. The values are the GEMM's up to rounding (another
summation order), and every rank rewrites the same graph the same way.
``torch.backends.mkldnn.flags(enabled=False)`` while compiling keeps MKL.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..torch_compat import CustomGraphPass, get_hash_for_files, mkldnn_linear

aten = torch.ops.aten


@torch.library.custom_op("shardplan::onednn_mm", mutates_args=())
def onednn_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` on oneDNN: its linear with the weight ``b.t()`` row-major (free
    when ``b`` is a transposed weight, one copy of ``b`` otherwise)."""
    return mkldnn_linear(a.contiguous(), b.t().contiguous(), bias, "none", [], "")


@onednn_mm.register_fake
def _(a, b, bias=None):
    return a.new_empty((a.shape[0], b.shape[1]))


def _static_fp32_cpu(node) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return (isinstance(val, torch.Tensor) and val.dtype == torch.float32
            and val.device.type == "cpu"
            and all(isinstance(s, int) for s in (*val.shape, *val.stride()))
            and val.numel() > 0)


def _operands(node: fx.Node):
    """``(a, b, bias)`` of a GEMM to move, or None: ``mm(a, b)``; ``addmm`` with a 1-D
    bias and ``alpha = beta = 1``; ``a`` contiguous, everything static fp32 on the CPU."""
    if node.target is aten.mm.default:
        (a, b), bias = node.args, None
    elif (node.target is aten.addmm.default and len(node.args) == 3
            and all(node.kwargs.get(k, 1) == 1 for k in ("alpha", "beta"))):
        bias, a, b = node.args
        if not (_static_fp32_cpu(bias) and bias.meta["val"].dim() == 1):
            return None
    else:
        return None
    if _static_fp32_cpu(a) and _static_fp32_cpu(b) and a.meta["val"].is_contiguous():
        return a, b, bias
    return None


def onednn_gemms(graph: fx.Graph) -> int:
    """Rewrite the GEMMs ``_operands`` accepts into ``shardplan::onednn_mm``; how many."""
    moved = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or (ops := _operands(node)) is None:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.shardplan.onednn_mm.default, ops)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        moved += 1
    return moved


def available() -> bool:
    """torch has oneDNN and it is not switched off (``torch.backends.mkldnn``)."""
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


class OneDnnGemms(CustomGraphPass):
    """Inductor's post-grad pass form of ``onednn_gemms``, where ``available()`` while
    inductor compiles."""

    def __call__(self, graph: fx.Graph) -> None:
        if available():
            onednn_gemms(graph)

    def uuid(self) -> bytes:
        """Inductor's cache key: this file, and whether the pass rewrites."""
        return get_hash_for_files((__file__,)) + bytes([available()])
