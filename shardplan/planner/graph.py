"""Small questions asked of fx graph nodes: op names, operands, shapes, arguments.

``args_of`` and ``set_arg`` read and write an argument by its name in the op's ATen
schema (``args_of(node)["dim"]``, ``set_arg(node, "dim", 0)``), so a rule reading them
never depends on whether an argument was spelled positionally or by keyword. Code
matching one op's fixed form (the input tensor, getitem's index) reads ``node.args``
by position, as export writes positional arguments.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .capture import module_of
from ..torch_compat import OpOverload


def op_name(node: fx.Node) -> str:
    """``aten.<op>.<overload>`` as the rule files spell it (``getitem`` for tuple access)."""
    t = node.target
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, OpOverload):
        return f"aten.{t.__name__}" if t.namespace == "aten" else f"{t.namespace}.{t.__name__}"
    return getattr(t, "__name__", str(t))


def operands(node: fx.Node) -> list[tuple[tuple, fx.Node]]:
    """Every fx.Node argument with its path: (i,), (i, j) for lists, ("k", name)."""
    out: list[tuple[tuple, fx.Node]] = []
    for i, a in enumerate(node.args):
        if isinstance(a, fx.Node):
            out.append(((i,), a))
        elif isinstance(a, (list, tuple)):
            out.extend(((i, j), b) for j, b in enumerate(a) if isinstance(b, fx.Node))
    for k, a in node.kwargs.items():
        if isinstance(a, fx.Node):
            out.append((("k", k), a))
    return out


def operand(node: fx.Node, path: tuple):
    """The argument at ``path`` (as ``operands`` spells it)."""
    if path[0] == "k":
        return node.kwargs[path[1]]
    a = node.args[path[0]]
    return a[path[1]] if len(path) == 2 else a


def replace_operand(node: fx.Node, path: tuple, new) -> None:
    """Set the argument at ``path`` to ``new``."""
    if path[0] == "k":
        node.kwargs = {**node.kwargs, path[1]: new}
        return
    args = list(node.args)
    if len(path) == 2:
        inner = list(args[path[0]])
        inner[path[1]] = new
        args[path[0]] = type(node.args[path[0]])(inner)
    else:
        args[path[0]] = new
    node.args = tuple(args)


def schema_of(op) -> torch.FunctionSchema | None:
    return op._schema if isinstance(op, OpOverload) else None


def args_of(node: fx.Node) -> dict:
    """The op's arguments by schema name, defaults filled in."""
    schema = schema_of(node.target)
    if schema is None:
        return {}
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args) and not a.kwarg_only:
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def set_arg(node: fx.Node, name: str, value) -> None:
    """Set the argument called ``name`` (in the op's schema) to ``value``."""
    schema = schema_of(node.target)
    if schema is None:
        raise TypeError(f"{describe(node)} is not an ATen op: it has no schema")
    names = [a.name for a in schema.arguments]
    i = names.index(name)
    if i < len(node.args):
        args = list(node.args)
        args[i] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: value}


def shape(node: fx.Node) -> tuple | None:
    """The shape of the tensor ``node`` makes; None for a node that makes no tensor."""
    v = node.meta.get("val")
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def tensor_shape(node: fx.Node) -> tuple:
    """The shape of a node known to make a tensor (a rule's operand, a parameter)."""
    s = shape(node)
    if s is None:
        raise TypeError(f"{describe(node)} makes no tensor")
    return s


def hint(d) -> int:
    """A concrete size for a (possibly symbolic) dim: its example value."""
    if isinstance(d, int):
        return d
    h = getattr(getattr(d, "node", None), "hint", None)
    return int(h) if h is not None else int(d)


def is_symbolic(d) -> bool:
    return not isinstance(d, int)


def coefficient(d) -> int:
    """The static factor of a size: ``d`` itself, 4 for a symbolic ``4*s0``, else 1."""
    if isinstance(d, int):
        return d
    coeff = getattr(getattr(d, "node", None), "expr", d).as_coeff_Mul()[0]
    return int(coeff) if coeff.is_Integer and coeff > 0 else 1


def numel(node: fx.Node) -> int:
    """Elements of the (full-size) tensor ``node`` makes; 0 for a non-tensor."""
    s = shape(node)
    return 0 if s is None else _prod(hint(d) for d in s)


def floating(node: fx.Node) -> bool:
    v = node.meta.get("val")
    if isinstance(v, (tuple, list)):
        return any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in v)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def describe(node: fx.Node) -> str:
    mod = module_of(node)
    return f"{node.name} ({op_name(node)}{' in ' + mod if mod else ''})"


def _prod(xs) -> int:
    total = 1
    for x in xs:
        total *= x
    return total
