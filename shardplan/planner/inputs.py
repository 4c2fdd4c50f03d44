"""Checks of a call's inputs against its captured graph, before anything runs.

Capture runs on fake tensors, which accept what the real kernels reject:
integer inputs to a float ``Linear``, float32 inputs to a float64 model, a
model whose parameters have several dtypes. ``check_dtypes`` finds these in
the graph and names the module and the user's source line. ``check_token_ids``
checks the ids a model is called with against the embedding (or the
cross-entropy classes) they index: unsharded, torch would raise an
``IndexError`` naming neither the input nor the module.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from .capture import IN_SPEC, module_of, source_of
from ..errors import CaptureError, ConfigurationError
from ..runtime.layers import check_ids
from ..torch_compat import tree_flatten_spec

aten = torch.ops.aten

#: ops whose first n tensor operands must share one dtype
_SAME_DTYPE = {
    aten.linear.default: 3, aten.mm.default: 2, aten.addmm.default: 3, aten.bmm.default: 2,
    aten.baddbmm.default: 3, aten.matmul.default: 2, aten.conv1d.default: 3,
    aten.conv2d.default: 3, aten.conv3d.default: 3, aten.convolution.default: 3,
    aten.scaled_dot_product_attention.default: 3,
}
#: ops that only reshape: ids keep their values through them
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.flatten.using_ints, aten.contiguous.default, aten.clone.default}
#: torch's names for dtypes in its own error messages
_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
          torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int",
          torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype, str(dtype))


def check_dtypes(gm: fx.GraphModule) -> None:
    """Raise ``ConfigurationError`` at the first matmul, convolution or attention
    whose operands have different dtypes (the real kernel would reject them)."""
    for node in gm.graph.nodes:
        n = _SAME_DTYPE.get(node.target)
        if n is None:
            continue
        schema = node.target._schema.arguments
        operands = [(schema[i].name, a, t) for i, a in enumerate(node.args[:n])
                    if (t := _val(a)) is not None]
        if len({t.dtype for _, _, t in operands}) < 2:
            continue
        listed = ", ".join(f"{role} {_dtype_name(t.dtype)} ({_origin(a)})"
                           for role, a, t in operands)
        raise ConfigurationError(
            f"{node.target._schema.name.split('::')[-1]} in {_module(node)} gets operands of "
            f"different dtypes ({listed}): its kernel needs one dtype",
            where=_module(node), source=source_of(node), fix=_dtype_fix(gm, operands))


def check_token_ids(gm: fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Raise ``ConfigurationError`` if an input that indexes an embedding (or is a
    cross-entropy target) holds an id outside its rows (classes)."""
    flat = tree_flatten_spec((args, kwargs), gm.meta[IN_SPEC])
    values = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], flat))
    for node in gm.graph.nodes:
        if node.target is aten.embedding.default:
            ids, table, ignore = node.args[1], _val(node.args[0]), None
            size = table.shape[0] if table is not None else None
        elif node.target is aten.cross_entropy_loss.default:
            ids, logits = node.args[1], _val(node.args[0])
            ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
            size = None if logits is None else logits.shape[1 if logits.dim() > 1 else 0]
        else:
            continue
        while isinstance(ids, fx.Node) and ids.target in _VIEWS:
            ids = ids.args[0]
        value = values.get(ids)
        if not isinstance(value, torch.Tensor) or not isinstance(size, int):
            continue
        try:
            check_ids(value, size, f"input {ids.name!r}", ignore)
        except ConfigurationError as e:
            raise ConfigurationError(e.what, where=_module(node), source=source_of(node),
                                     fix=e.fix) from None


def _val(a) -> torch.Tensor | None:
    v = a.meta.get("val") if isinstance(a, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _module(node: fx.Node) -> str:
    return module_of(node) or "the top level"


def _origin(a: fx.Node) -> str:
    if a.op == "get_attr":
        return str(a.target)
    return f"the input {a.name!r}" if a.op == "placeholder" else f"from {a.name}"


def _dtype_fix(gm: fx.GraphModule, operands) -> str:
    if any(not (t.is_floating_point() or t.is_complex()) for _, _, t in operands):
        return ("this op computes in floating point: pass floating-point inputs (x.float()); "
                "integer inputs are token ids for an embedding")
    params: dict[torch.dtype, str] = {}
    for name, p in gm.named_parameters():
        params.setdefault(p.dtype, name)
    if len(params) > 1:
        listed = ", ".join(f"{n} is {_dtype_name(d)}" for d, n in params.items())
        return f"give the model one dtype ({listed}), e.g. model.to(torch.float32)"
    theirs = next((t.dtype for _, a, t in operands if a.op != "get_attr"), None)
    if not params or theirs is None:
        return "cast the operands to one dtype"
    return (f"cast the inputs to the model's dtype (x.to({next(iter(params))})), or the model "
            f"to the inputs' (model.to({theirs}))")


def check_model_arg(model, tp=None) -> None:
    """An unsharded ``nn.Module`` and, when given, a positive integer tp."""
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"expected a torch.nn.Module, got {type(model).__name__}",
                                 fix="pass the model object (an nn.Module), not a function or "
                                     "class")
    if getattr(model, "is_parallelized", False):
        raise ConfigurationError("this model is already parallelized",
                                 where=type(model).__name__,
                                 fix="use the original, unsharded model once")
    if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
        raise ConfigurationError(f"tp must be a positive integer, got {tp!r}",
                                 fix="pass the tensor-parallel size, e.g. tp=8")


def example_args(model: nn.Module, example_inputs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` to capture with: given, or token ids for a language model."""
    if example_inputs is not None:
        if isinstance(example_inputs, dict):
            return (), example_inputs
        if isinstance(example_inputs, torch.Tensor):
            return (example_inputs,), {}
        if isinstance(example_inputs, (tuple, list)):
            return tuple(example_inputs), {}
        raise CaptureError(
            f"example_inputs for {type(model).__name__} is a {type(example_inputs).__name__}",
            where=type(model).__name__,
            fix="pass a tensor, a tuple/list of positional arguments or a dict of keyword "
                "arguments, shaped as you call the model")
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise CaptureError(
            f"cannot infer example inputs for {type(model).__name__}: it has no token embedding",
            where=type(model).__name__,
            fix="pass example_inputs=(tensor, ...) shaped as you call the model")
    vocab = max(e.num_embeddings for e in embeddings)
    device = next(model.parameters()).device
    return (torch.randint(0, vocab, (2, 8), device=device),), {}
