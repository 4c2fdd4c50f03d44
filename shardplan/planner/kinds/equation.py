"""equation: ``torch.einsum``, whose factor signature is its own equation argument.

``einsum("bhqd,bhkd->bhqk", q, k)`` names each operand dim by a letter, as the
rule file's fixed signatures do for ``linear`` or ``bmm``, so it runs by the
same factor rule: a sharded factor kept in the output stays sharded, a
contracted one gives a partial sum (einsum is linear in every operand, so an
operand without that factor just multiplies this rank's part).
"""

from __future__ import annotations

from dataclasses import replace

from ..graph import args_of, tensor_shape
from .base import Context, Kind, Outcome, conflict, register
from .factors import expand_labels, factor_rule


@register
class EquationKind(Kind):
    name = "equation"
    ops = frozenset({"aten.einsum.default"})

    def rule(self, node, lays, ctx: Context) -> Outcome:
        eq = args_of(node)["equation"].replace(" ", "")
        lab = einsum_labels(node, eq)
        if lab is None:
            return conflict(node, f"einsum '{eq}': implicit output or operands not matching")
        out = factor_rule(node, lays, lab, ctx.size, partial_ok=True, shardable=None,
                          rule=f"einsum {eq}")
        return replace(out, bias=None)  # no operand is added: none moves after g


def einsum_labels(node, eq: str) -> dict | None:
    """Letters per operand dim (path ``(1, j)``) and ``"out"``, '...' expanded."""
    if "->" not in eq:
        return None
    ins, out = eq.split("->")
    specs = ins.split(",")
    tensors = node.args[1]
    if len(specs) != len(tensors):
        return None
    lab: dict[tuple | str, list[str] | None] = {
        (1, j): expand_labels(s, len(tensor_shape(t)))
        for j, (s, t) in enumerate(zip(specs, tensors))}
    lab["out"] = expand_labels(out, len(tensor_shape(node)))
    if any(v is None or len(v) != len(tensor_shape(node if p == "out" else tensors[p[1]]))
           for p, v in lab.items()):
        return None
    return lab
