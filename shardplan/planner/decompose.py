"""decompose: a fused norm, softmax, variance or max over a split dim, written out in
reductions the rules can distribute.

``aten.layer_norm``, ``aten.rms_norm``, the softmaxes and logsumexp, ``var`` / ``std``,
``linalg_vector_norm`` (``F.normalize``'s) and a max whose gradient is needed are one op
each, so a split reduced dim stops the region at them. Written out they are made of
reductions that run distributed (``kinds/reduce.py``) and elementwise ops:
a norm of the mean and the mean of squares over its normalized (trailing) dims, both
from one mean of ``x`` and ``x * x`` stacked (one message for both statistics; the
variance their difference), its mean and inverse deviation entering the parts stacked
too (one f for both gradients), then weight and bias; a softmax or logsumexp of a max
and a sum (``exp(x - max) / sum``; the max of the detached input, a constant shift, so
it needs no gradient), a variance from the same stacked moments times
``n / (n - correction)``, a 2-norm of a sum of squares, and a max with a gradient as
``sum(x * (x == m)) / count`` with ``m`` the max of the detached input and ``count``
how many elements equal it (over every rank; the sum and the count one stacked sum):
torch gives each tied maximum an equal share of the gradient, and so does this. ``annotate``
rewrites only the ops whose region stopped there, in the captured graph, before planning
again; the result equals the fused op (computed in float32 for half inputs, as the fused
kernels do).
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.fx as fx

from .graph import args_of, op_name

aten = torch.ops.aten
_KEEP = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node")


def decomposable(node: fx.Node, needs_grad: bool = False) -> bool:
    """Can ``node`` be written out here (a softmax, a norm, a variance or a 2-norm over
    static dims; a max, where its input ``needs_grad``)?"""
    name = op_name(node) if node.op == "call_function" else ""
    if name == "aten.amax.default":
        return needs_grad
    if name in _VARIANCES:
        return _static(node, _dims(node, args_of(node).get("dim")))
    if name == "aten.linalg_vector_norm.default":
        args = args_of(node)
        return args.get("ord", 2) == 2 and args.get("dtype") is None and \
            _static(node, _dims(node, args.get("dim")))
    return name in _SOFTMAXES or name in _NORMS


def decompose(gm: fx.GraphModule, nodes) -> None:
    """Replace each op of ``nodes`` in ``gm`` by its written-out form."""
    for node in nodes:
        _Writer(gm.graph, node).replace(_WRITTEN[op_name(node)])
    gm.graph.lint()
    gm.recompile()


def _dims(node: fx.Node, dims) -> list[int]:
    """The reduced dims of ``node``'s input, non-negative (None: all)."""
    rank = cast(fx.Node, node.args[0]).meta["val"].dim()
    dims = range(rank) if dims is None else [dims] if isinstance(dims, int) else dims
    return sorted(d % rank for d in dims)


def _static(node: fx.Node, dims) -> bool:
    return all(isinstance(cast(fx.Node, node.args[0]).meta["val"].shape[d], int) for d in dims)


def _val(a):
    """An argument's fake value (of each node in a list)."""
    if isinstance(a, (list, tuple)):
        return [_val(b) for b in a]
    return a.meta["val"] if isinstance(a, fx.Node) else a


class _Writer:
    """Inserts ops before ``node``, each with its fake value and ``node``'s provenance."""

    def __init__(self, graph: fx.Graph, node: fx.Node):
        self.graph, self.node = graph, node
        self.fake = node.meta["val"].fake_mode

    def __call__(self, op, *args, **kwargs):
        vals = [_val(a) for a in args]
        with self.graph.inserting_before(self.node):
            new = self.graph.call_function(op, tuple(args), kwargs)
        with self.fake:
            new.meta["val"] = op(*vals, **kwargs)
        new.meta.update({k: self.node.meta[k] for k in _KEEP if k in self.node.meta})
        return new

    def replace(self, write) -> None:
        args = args_of(self.node)
        x = args["input"] if "input" in args else args["self"]
        out = self.node.meta["val"].dtype
        compute = torch.float32 if out in (torch.float16, torch.bfloat16) else out
        if x.meta["val"].dtype != compute:
            x = self(aten._to_copy.default, x, dtype=compute)
        y = write(self, x, args)
        if y.meta["val"].dtype != out:
            y = self(aten._to_copy.default, y, dtype=out)
        self.node.replace_all_uses_with(y)
        self.graph.erase_node(self.node)


def _affine(w: _Writer, y, args):
    if args.get("weight") is not None:
        y = w(aten.mul.Tensor, y, args["weight"])
    if args.get("bias") is not None:
        y = w(aten.add.Tensor, y, args["bias"])
    return y


def _normalized(args) -> list[int]:
    """A norm's normalized dims: the last len(normalized_shape)."""
    return list(range(-len(args["normalized_shape"]), 0))


def _layer_norm(w: _Writer, x, args):
    mean, var = _moments(w, x, _normalized(args))
    rstd = w(aten.rsqrt.default, w(aten.add.Scalar, var, args["eps"]))
    # the two statistics enter the parts stacked: one f sums both gradients
    both = w(aten.stack.default, [mean, rstd])
    mean, rstd = (w(aten.select.int, both, 0, i) for i in (0, 1))
    y = w(aten.mul.Tensor, w(aten.sub.Tensor, x, mean), rstd)
    return _affine(w, y, args)


def _moments(w: _Writer, x, dims: list[int]):
    """The mean and the (biased) variance of ``x`` over ``dims``, kept: both from one
    mean of ``x`` and ``x * x`` stacked, so a split dim costs one message of both."""
    rank = x.meta["val"].dim()
    both = w(aten.stack.default, [x, w(aten.mul.Tensor, x, x)])
    stats = w(aten.mean.dim, both, [d % rank - rank for d in dims], True)
    mean, square = (w(aten.select.int, stats, 0, i) for i in (0, 1))
    var = w(aten.sub.Tensor, square, w(aten.mul.Tensor, mean, mean))
    return mean, w(aten.clamp_min.default, var, 0.0)  # rounding may take it below 0


def _rms_norm(w: _Writer, x, args):
    eps = args.get("eps")
    if eps is None:
        eps = torch.finfo(args["input"].meta["val"].dtype).eps
    ms = w(aten.mean.dim, w(aten.mul.Tensor, x, x), _normalized(args), True)
    y = w(aten.mul.Tensor, x, w(aten.rsqrt.default, w(aten.add.Scalar, ms, eps)))
    return _affine(w, y, args)


def _softmax(w: _Writer, x, args):
    z, total = _shifted(w, x, args["dim"])
    return w(aten.div.Tensor, w(aten.exp.default, z), total)


def _log_softmax(w: _Writer, x, args):
    z, total = _shifted(w, x, args["dim"])
    return w(aten.sub.Tensor, z, w(aten.log.default, total))


def _logsumexp(w: _Writer, x, args):
    dims = list(args["dim"])
    shift = w(aten.amax.default, w(aten.detach.default, x), dims, True)
    z = w(aten.sub.Tensor, x, shift)
    y = w(aten.add.Tensor, w(aten.log.default, w(aten.sum.dim_IntList, w(aten.exp.default, z),
                                                   dims, True)), shift)
    return y if args["keepdim"] else w(aten.squeeze.dims, y, dims)


def _shifted(w: _Writer, x, dim: int):
    """``x - max`` along ``dim`` (the max of the detached ``x``) and its sum of exps."""
    z = w(aten.sub.Tensor, x, w(aten.amax.default, w(aten.detach.default, x), [dim], True))
    return z, w(aten.sum.dim_IntList, w(aten.exp.default, z), [dim], True)


def _variance(w: _Writer, x, args, root: bool = False):
    dims = _dims(w.node, args.get("dim"))
    n = math.prod(x.meta["val"].shape[d] for d in dims)
    correction = args.get("correction")
    if "unbiased" in args:  # var.dim / std.dim
        correction = 1 if args["unbiased"] else 0
    correction = 1 if correction is None else correction
    y = _moments(w, x, dims)[1]
    if correction:
        y = w(aten.mul.Scalar, y, n / (n - correction) if n > correction else math.inf)
    if root:
        y = w(aten.sqrt.default, y)
    return y if args.get("keepdim") else w(aten.squeeze.dims, y, dims)


def _std(w: _Writer, x, args):
    return _variance(w, x, args, root=True)


def _vector_norm(w: _Writer, x, args):
    dims = _dims(w.node, args.get("dim"))
    y = w(aten.sqrt.default, w(aten.sum.dim_IntList, w(aten.mul.Tensor, x, x), dims, True))
    return y if args.get("keepdim") else w(aten.squeeze.dims, y, dims)


def _amax(w: _Writer, x, args):
    dims = _dims(w.node, args.get("dim"))
    top = w(aten.amax.default, w(aten.detach.default, x), dims, True)
    hit = w(aten._to_copy.default, w(aten.eq.Tensor, x, top), dtype=x.meta["val"].dtype)
    # the sum at the maxima and their count, stacked: one message of both
    both = w(aten.stack.default, [w(aten.mul.Tensor, x, hit), hit])
    stats = w(aten.sum.dim_IntList, both, [d + 1 for d in dims], True)
    y = w(aten.div.Tensor, *(w(aten.select.int, stats, 0, i) for i in (0, 1)))
    return y if args.get("keepdim") else w(aten.squeeze.dims, y, dims)


_VARIANCES = {"aten.var.correction": _variance, "aten.var.dim": _variance,
              "aten.std.correction": _std, "aten.std.dim": _std}
_NORMS = {"aten.layer_norm.default": _layer_norm, "aten.rms_norm.default": _rms_norm}
_SOFTMAXES = {"aten._softmax.default": _softmax, "aten.softmax.int": _softmax,
              "aten._log_softmax.default": _log_softmax, "aten.log_softmax.int": _log_softmax,
              "aten.logsumexp.default": _logsumexp}
_WRITTEN = {**_NORMS, **_SOFTMAXES, **_VARIANCES, "aten.amax.default": _amax,
            "aten.linalg_vector_norm.default": _vector_norm}
