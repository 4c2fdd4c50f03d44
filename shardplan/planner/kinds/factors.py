"""einsum and elementwise: ops whose dims are named factors, one of them sharded.

An einsum rule names each operand dim by a letter (``"...k,nk,n->...n"`` for
``linear``); an elementwise op names the dims it broadcasts from the right.
A sharded factor that appears in the output stays sharded there; one that
is contracted gives a partial sum (row parallel) where the rule allows.
"""

from __future__ import annotations

from ..graph import hint, op_name, operand, operands, shape, tensor_shape
from ...layouts import Partial, Shard
from .permute import viewed_parameter
from .base import R, Context, Kind, Outcome, Role, conflict, register, returns_one_tensor


@register
class EinsumKind(Kind):
    name = "einsum"

    def reads(self, op) -> bool:
        return returns_one_tensor(op)

    def rule(self, node, lays, ctx: Context) -> Outcome:
        es = ctx.rules.einsum[op_name(node)]
        lab = labels(node, es)
        if lab is None:
            return conflict(node, f"{op_name(node)}: operands do not match '{es.sig}'")
        return factor_rule(node, lays, lab, ctx.size, partial_ok=es.partial,
                           shardable=es.shardable, rule=f"einsum {es.sig}")


@register
class ElementwiseKind(Kind):
    name = "elementwise"
    per_element = True

    def reads(self, op) -> bool:
        return returns_one_tensor(op)

    def rule(self, node, lays, ctx: Context) -> Outcome:
        # [B, T, C] + [C]: dims named from the right, d0 d1 d2 + d2
        out_rank = len(shape(node) or ())
        lab: dict[tuple | str, list[str]] = {
            p: [f"d{out_rank - len(tensor_shape(a)) + i}" for i in range(len(tensor_shape(a)))]
            for p, a in operands(node) if shape(a) is not None}
        lab["out"] = [f"d{i}" for i in range(out_rank)]
        return factor_rule(node, lays, lab, ctx.size, partial_ok=False, shardable=None,
                           rule="elementwise")


def labels(node, es) -> dict | None:
    """Factor letters per operand dim (and "out"), expanding '...' from the right.

    An operand with fewer dims than its spec broadcasts (an attention mask
    [T, T] against '...hqk'): its dims are the spec's last ones. Broadcasting
    adds no dims to the output, so an operand with more '...' dims than the
    output does not match (matmul with a 1-D operand drops a dim instead).
    """
    rank = len(tensor_shape(node))
    out_body = es.output.removeprefix("...")
    if rank < len(out_body):
        return None
    out: dict = {"out": expand_labels(es.output, rank)}
    batch = rank - len(out_body)
    for p, a in operands(node):
        if shape(a) is None or len(p) != 1 or p[0] >= len(es.operands):
            continue
        spec = es.operands[p[0]]
        out[p] = expand_labels(spec, len(tensor_shape(a)))
        if out[p] is None or len(tensor_shape(a)) - len(spec.removeprefix("...")) > batch:
            return None
    return out if out["out"] is not None else None


def expand_labels(spec: str, rank: int) -> list[str] | None:
    """Letters for ``rank`` dims: '...' as ".n" … ".1"; fewer dims take the last letters."""
    body = spec.removeprefix("...")
    if rank <= len(body):
        return list(body[len(body) - rank:])
    if spec.startswith("..."):
        n = rank - len(body)
        return [f".{n - i}" for i in range(n)] + list(body)
    return None


def _broadcast_whole(node, lays, labels, tp) -> set:
    """Operands held whole by every rank (``Shard(d, replicas=tp)``: one K/V head beside
    split query heads) that broadcast (size 1) along the factor another operand is split
    on: they are used as they are, as a replicated one would be, and their gradient stays
    the ranks' partial sums (Falcon's ``q @ k.transpose(-1, -2)`` with one K head)."""
    whole = {p for p, lay in lays.items() if isinstance(lay, Shard) and p in labels
             and lay.replicas == tp and hint(tensor_shape(operand(node, p))[lay.dim]) == 1}
    split = {labels[p][lay.dim] for p, lay in lays.items()
             if isinstance(lay, Shard) and p not in whole and p in labels}
    return {p for p in whole if labels[p][lays[p].dim] in split} if len(split) == 1 else set()


def factor_rule(node, lays, labels, tp, *, partial_ok, shardable, rule) -> Outcome:
    """The shared rule of einsum and elementwise ops: one sharded factor at most.

    An operand of size 1 along the sharded factor (or without it) broadcasts
    and is used whole. One with a smaller size that divides the full one is
    grouped (SDPA's enable_gqa: query head i uses K/V head i // (H / KV)):
    contiguous shards of both pair up when that size divides by tp.
    """
    sizes: dict = {}
    for p, lab in labels.items():
        shp = tensor_shape(node) if p == "out" else tensor_shape(operand(node, p))
        for f, d in zip(lab, shp):
            sizes[f] = max(sizes.get(f, 1), hint(d))
    sharded: dict = {}
    held = _broadcast_whole(node, lays, labels, tp)
    for p, lay in lays.items():
        if isinstance(lay, Shard) and p not in held:
            if p not in labels:
                return conflict(node, "sharded operand outside the op's signature")
            f = labels[p][lay.dim]
            key = (lay.blocks, lay.padded, lay.replicas, lay.period)
            if lay.replicas != 1 and not rule.startswith("elementwise") and f not in labels["out"]:
                return conflict(node, f"{op_name(node)} on a dim held by groups of ranks")
            if sharded.setdefault(f, key) != key:
                return conflict(node, "operands sharded with different blocks")
    if len(sharded) > 1:
        return conflict(node, f"operands sharded on different dims ({', '.join(sharded)})")
    (f, (blocks, padded, replicas, period)), = sharded.items()
    if shardable is not None and not (f in shardable or (f.startswith(".") and "." in shardable)):
        return conflict(node, f"factor {f!r} of {op_name(node)} cannot be sharded")
    needs, bias = {}, None
    for p, lab in labels.items():
        if p == "out":
            continue
        size = hint(tensor_shape(operand(node, p))[lab.index(f)]) if f in lab else 1
        if p in held:
            needs[p] = lays[p]  # as it is: whole on every rank
        elif size == 1:
            needs[p] = R
        elif size == sizes[f] or (sizes[f] % size == 0 and size % tp == 0
                                  and not (blocks or padded or period)):
            needs[p] = Shard(lab.index(f), blocks, padded, replicas, period)
        else:
            return conflict(node, f"{op_name(node)}: operand {p} has {size} of the "
                                  f"{sizes[f]} along the sharded factor {f!r}")
    if f in labels["out"]:
        return Outcome(Shard(labels["out"].index(f), blocks, padded, replicas, period), needs,
                       rule=rule)
    if not partial_ok or padded:
        return conflict(node, f"{op_name(node)} contracts the sharded factor {f!r}")
    for p, lab in labels.items():  # a bias: added to the output (not grouped_mm's offsets)
        if p != "out" and f not in lab and set(lab) <= set(labels["out"]):
            bias = p
    is_row = any(operand(node, p).op == "get_attr" or viewed_parameter(operand(node, p))
                 for p, n in needs.items() if isinstance(n, Shard))
    return Outcome(Partial(), needs, role=Role.ROW if is_row else Role.PARTIAL, rule=rule,
                   bias=bias)
