"""decompose: a fused norm over a split dim, written out as means the rules can distribute.

``aten.layer_norm`` and ``aten.rms_norm`` are one op each, so a split
normalized dim stops the region at them. Written out (mean, centre, mean of
squares, rsqrt, weight, bias) they are made of a linear reduction, which
runs distributed (``kinds/reduce.py``), and elementwise ops. ``annotate``
rewrites only the norms whose region stopped there, in the captured graph,
before planning again; the result equals the fused op (computed in float32
for half inputs, as the fused kernels do).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .graph import args_of, op_name

aten = torch.ops.aten
_KEEP = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node")


def decomposable(node: fx.Node) -> bool:
    """Can ``node`` be written out here (a norm over its last dim)?"""
    name = op_name(node) if node.op == "call_function" else ""
    return name in _NORMS and len(args_of(node)["normalized_shape"]) == 1


def decompose(gm: fx.GraphModule, nodes) -> None:
    """Replace each norm of ``nodes`` in ``gm`` by its written-out form."""
    for node in nodes:
        _Writer(gm.graph, node).replace(_NORMS[op_name(node)])
    gm.graph.lint()
    gm.recompile()


class _Writer:
    """Inserts ops before ``node``, each with its fake value and ``node``'s provenance."""

    def __init__(self, graph: fx.Graph, node: fx.Node):
        self.graph, self.node = graph, node
        self.fake = node.meta["val"].fake_mode

    def __call__(self, op, *args, **kwargs):
        vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        with self.graph.inserting_before(self.node):
            new = self.graph.call_function(op, tuple(args), kwargs)
        with self.fake:
            new.meta["val"] = op(*vals, **kwargs)
        new.meta.update({k: self.node.meta[k] for k in _KEEP if k in self.node.meta})
        return new

    def replace(self, write) -> None:
        args = args_of(self.node)
        x = args["input"]
        dtype = x.meta["val"].dtype
        if dtype in (torch.float16, torch.bfloat16):
            x = self(aten._to_copy.default, x, dtype=torch.float32)
        y = write(self, x, args)
        if dtype in (torch.float16, torch.bfloat16):
            y = self(aten._to_copy.default, y, dtype=dtype)
        self.node.replace_all_uses_with(y)
        self.graph.erase_node(self.node)


def _affine(w: _Writer, y, args):
    if args.get("weight") is not None:
        y = w(aten.mul.Tensor, y, args["weight"])
    if args.get("bias") is not None:
        y = w(aten.add.Tensor, y, args["bias"])
    return y


def _layer_norm(w: _Writer, x, args):
    mean = w(aten.mean.dim, x, [-1], True)
    xc = w(aten.sub.Tensor, x, mean)
    var = w(aten.mean.dim, w(aten.mul.Tensor, xc, xc), [-1], True)
    y = w(aten.mul.Tensor, xc, w(aten.rsqrt.default, w(aten.add.Scalar, var, args["eps"])))
    return _affine(w, y, args)


def _rms_norm(w: _Writer, x, args):
    eps = args.get("eps")
    if eps is None:
        eps = torch.finfo(args["input"].meta["val"].dtype).eps
    ms = w(aten.mean.dim, w(aten.mul.Tensor, x, x), [-1], True)
    y = w(aten.mul.Tensor, x, w(aten.rsqrt.default, w(aten.add.Scalar, ms, eps)))
    return _affine(w, y, args)


_NORMS = {"aten.layer_norm.default": _layer_norm, "aten.rms_norm.default": _rms_norm}
