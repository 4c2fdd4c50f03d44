"""The input shapes a capture's graph was specialised to, and which calls it serves.

Export keeps a dim symbolic only while the forward lets it: a Python loop over
the sequence length (litgpt's sliding-window mask) or a size compared with a
constant turns the example's value into a literal, and every symbolic dim has
a range (never 0 or 1 under ``Dim.AUTO``). A graph called outside that fails
inside torch (``Guard failed: idx.size()[1] == 10``). ``InputShapes`` reads,
from the capture's placeholders, what each tensor dim of each input is (a
literal, or a symbol with its range); ``mismatch`` says why a call falls
outside, so the sharded module captures that call anew.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ..torch_compat import pytree

# a dim: its literal size, or (symbol expression, low, high or None for unbounded)
Dim = int | tuple[str, int, int | None]


@dataclass(frozen=True)
class InputShapes:
    """Per flattened input leaf (``(args, kwargs)`` in the graph's order): its dims,
    or None for a non-tensor leaf."""

    leaves: tuple[tuple[Dim, ...] | None, ...]

    @classmethod
    def of(cls, gm: fx.GraphModule, ranges: dict) -> InputShapes:
        """From ``gm``'s placeholders and the exported program's ``range_constraints``."""
        bounds = {str(s): (_bound(r.lower) or 0, _bound(r.upper)) for s, r in ranges.items()}
        leaves: list[tuple[Dim, ...] | None] = []
        for node in gm.graph.find_nodes(op="placeholder"):
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                leaves.append(None)
                continue
            leaves.append(tuple(_dim(d, bounds) for d in val.shape))
        return cls(tuple(leaves))

    def mismatch(self, args: tuple, kwargs: dict) -> str | None:
        """Why ``(args, kwargs)`` falls outside these shapes (None: it fits)."""
        leaves = pytree.tree_leaves((args, kwargs))
        if len(leaves) != len(self.leaves):
            return f"{len(leaves)} input leaves, the graph takes {len(self.leaves)}"
        bound: dict[sympy.Symbol, int] = {}
        checks = []
        for i, (x, dims) in enumerate(zip(leaves, self.leaves)):
            if dims is None or not isinstance(x, torch.Tensor):
                continue
            if x.dim() != len(dims):
                return f"input {i} has {x.dim()} dims, the graph {len(dims)}"
            for d, (size, want) in enumerate(zip(x.shape, dims)):
                if isinstance(want, int):
                    if size != want:
                        return f"input {i} dim {d} is {size}; the graph was specialised to {want}"
                    continue
                expr, low, high = want
                if size < low or (high is not None and size > high):
                    top = "inf" if high is None else high
                    return f"input {i} dim {d} is {size}, outside the graph's [{low}, {top}]"
                sym = _parsed(expr)
                if isinstance(sym, sympy.Symbol):
                    if bound.setdefault(sym, size) != size:
                        return (f"input {i} dim {d} is {size} but the graph has it equal to "
                                f"another dim of size {bound[sym]}")
                else:
                    checks.append((i, d, size, sym))
        for i, d, size, sym in checks:  # derived dims (2*s0): after every symbol is bound
            value = sym.subs(bound)
            if value.is_number and int(value) != size:
                return f"input {i} dim {d} is {size}; the graph has it {sym} = {value}"
        return None


@functools.lru_cache(maxsize=None)
def _parsed(expr: str):
    """A dim's expression, parsed once (``mismatch`` runs on every call)."""
    return sympy.sympify(expr)


def _bound(value) -> int | None:
    """A range end as an int; None for torch's unbounded ``int_oo``."""
    return int(value) if value.is_Integer else None


def _dim(d, bounds: dict) -> Dim:
    if isinstance(d, int):
        return d
    expr = d.node.expr
    if expr.is_number:
        return int(expr)
    low, high = bounds.get(str(expr), (0, None))
    return str(expr), low, high
