"""sequence_dims: where the sequence is in every tensor, for sequence parallelism.

The sequence dim is the symbolic token dim of the inputs, followed by its
symbol through every reshape and transpose. With ``sequence_parallel`` a
partial result that has it is read as ``Shard(seq)`` (reduce-scattered); one
that has none (batch and sequence flattened into one dim) is warned about.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .annotation import Annotation
from ..errors import ConfigurationError
from ..layouts import Partial
from .graph import describe, op_name
from .kinds import Role
from .transitions import message


def sequence_dims(gm: fx.GraphModule) -> dict[fx.Node, frozenset[int]]:
    """node -> the dims of its value whose size is the sequence length.

    The sequence length is the symbolic token dim of the first integer input
    (token ids; else the first input): its one symbolic dim, or, with batch
    and sequence both symbolic, the one attention runs along (a softmax's
    reduced dim, SDPA's query dim), else the last (batch-first ids).
    """
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"
              and isinstance(n.meta.get("val"), torch.Tensor)]
    ints = [n for n in inputs if not n.meta["val"].is_floating_point()]
    first = (ints or inputs or [None])[0]
    syms = [] if first is None else [d.node.expr for d in first.meta["val"].shape
                                     if isinstance(d, torch.SymInt)]
    if not syms or len(set(syms)) < len(syms):
        raise ConfigurationError(
            "sequence_parallel=True needs a sequence dim of the inputs, and "
            + ("the example inputs have no symbolic dim" if not syms else
               f"the example's dims {list(first.meta['val'].shape)} share one size"),
            where=first.name if first is not None else None,
            fix="pass example_inputs whose batch size and sequence length differ "
                "(e.g. batch 2, sequence 8)")
    attended = _attended(gm)
    seq = next((s for s in syms if s in attended), syms[-1])
    out = {}
    for node in gm.graph.nodes:
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor):
            dims = {i for i, d in enumerate(v.shape) if isinstance(d, torch.SymInt)
                    and d.node.expr == seq}
            if dims:
                out[node] = frozenset(dims)
    return out


def _attended(gm: fx.GraphModule) -> set:
    """Size symbols attention runs along: softmax's reduced dim, SDPA's query dim."""
    found = set()
    for node in gm.graph.nodes:
        name = op_name(node) if node.op == "call_function" else ""
        if name in ("aten._softmax.default", "aten.softmax.int"):
            v, d = node.meta["val"], node.args[1]
        elif name == "aten.scaled_dot_product_attention.default":
            v, d = node.args[0].meta["val"], -2
        else:
            continue
        size = v.shape[d]
        if isinstance(size, torch.SymInt):
            found.add(size.node.expr)
    return found


def sequence_warnings(ann: Annotation) -> list[str]:
    """One warning per partial result without a sequence dim of its own (batch and
    sequence flattened into one dim, as HF's Conv1D does): it is all-reduced, and sliced
    onto the tokens after, instead of reduce-scattered. Where no partial result is
    reduce-scattered at all, one warning instead: sequence parallelism has no effect."""
    unscattered = [n for n, o in ann.outcomes.items()
                   if o.role in (Role.ROW, Role.PARTIAL) and isinstance(o.out, Partial)
                   and n not in ann.seq_dims and n not in ann.deferred]
    if not ann.scattered and not ann.deferred:
        why = (f"no partial result has a dim that is the sequence alone (e.g. "
               f"{describe(unscattered[0])}, output {list(message(unscattered[0]))})"
               if unscattered else "no region ends in a partial sum")
        return [f"sequence_parallel=True has no effect on this model: {why}, so no activation "
                "is held on 1/tp of the sequence and the plan is the one without sequence "
                "parallelism; pass sequence_parallel=False"]
    return [f"{describe(n)}: sequence parallel falls back to all-reduce and slice: its "
            f"output {list(message(n))} has no dim that is the sequence alone (a rank's "
            "tokens are not contiguous in a flattened batch x sequence dim)"
            for n in unscattered]
