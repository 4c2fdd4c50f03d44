"""identity, inspect and size: ops that keep or only look at a layout."""

from __future__ import annotations


from ..graph import args_of, op_name, tensor_shape
from .base import R, Context, Kind, Outcome, conflict, register, tensor_to_tensor


@register
class IdentityKind(Kind):
    """One tensor in, same layout out; other operands only lend a dtype (type_as)."""

    name = "identity"
    shape_only = True
    per_element = True
    keeps_element_order = True

    def reads(self, op) -> bool:
        return tensor_to_tensor(op)

    def rule(self, node, lays, ctx: Context) -> Outcome:
        return Outcome(lays.get((0,), R), rule="identity")


@register
class InspectKind(Kind):
    """Ops that only check their input (metadata asserts): no output to lay out."""

    name = "inspect"
    metadata_only = True

    def reads(self, op) -> bool:
        return not op._schema.returns

    def rule(self, node, lays, ctx: Context) -> Outcome:
        return Outcome(None, rule="inspect")


@register
class SizeKind(Kind):
    """A size query: fine unless it asks for the size of the split dim."""

    name = "size"
    metadata_only = True
    ops = frozenset({"aten.sym_size.int"})

    def rule(self, node, lays, ctx: Context) -> Outcome:
        dim = args_of(node)["dim"]
        if dim % len(tensor_shape(node.args[0])) == lays[(0,)].dim:
            return conflict(node, f"{op_name(node)} asks for the size of the sharded dim")
        return Outcome(None, rule="size of another dim")
