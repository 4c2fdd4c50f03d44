"""complex_view: real pairs seen as complex numbers and back (complex RoPE).

``view_as_complex`` takes ``[..., 2]`` reals to ``[...]`` complex numbers,
``view_as_real`` the reverse: every other dim keeps its place, so a shard
does; the pair dim itself is never split.
"""

from __future__ import annotations

from ..graph import op_name, tensor_shape
from .base import Context, Kind, Outcome, conflict, register

_AS_COMPLEX = "aten.view_as_complex.default"


@register
class ComplexViewKind(Kind):
    name = "complex_view"
    ops = frozenset({_AS_COMPLEX, "aten.view_as_real.default"})

    def rule(self, node, lays, ctx: Context) -> Outcome:
        lay = lays[(0,)]
        if op_name(node) == _AS_COMPLEX and lay.dim == len(tensor_shape(node.args[0])) - 1:
            return conflict(node, "view_as_complex of a split pair dim")
        return Outcome(lay, rule="complex view")
