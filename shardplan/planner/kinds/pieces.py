"""split, slice and concat: ops that cut a tensor into pieces along a dim, or join them.

Along another dim the shard passes through. Along the sharded dim a piece
must be made of whole blocks of the shard (a fused QKV ``[B, T, 3*C]``
sharded by blocks ``(C, C, C)`` splits into q, k, v each sharded on ``C``),
and the cut points become this rank's: ``split(qkv, C)`` runs as
``split(qkv, C // tp)``.
"""

from __future__ import annotations

from ..graph import args_of, hint, op_name, operands, tensor_shape
from ...layouts import Shard
from ..reshape import group_blocks
from .base import Context, Kind, Outcome, conflict, cumsum, register, with_dim

_SPLITS = {  # overload -> its argument of piece sizes (None: it has none to rewrite)
    "aten.split.Tensor": "split_size", "aten.split_with_sizes.default": "split_sizes",
    "aten.chunk.default": None, "aten.unbind.int": None,
}
_DROPS_DIM = {"aten.unbind.int", "aten.select.int"}  # pieces lose the cut dim


@register
class SplitKind(Kind):
    name = "split"
    cuts_or_joins = True
    ops = frozenset(_SPLITS)

    def rule(self, node, lays, ctx: Context) -> Outcome:
        lay = lays[(0,)]
        dim = args_of(node)["dim"] % len(tensor_shape(node.args[0]))
        pieces = [tuple(v.shape) for v in node.meta["val"]]
        if dim != lay.dim:
            d = lay.dim - (1 if op_name(node) in _DROPS_DIM and lay.dim > dim else 0)
            return Outcome(tuple(with_dim(lay, d) for _ in pieces), rule="split (other dim)")
        sizes = [hint(p[dim]) for p in pieces]
        out = _pieces(lay, dim, sizes) if not lay.period else None
        if out is None:
            return conflict(node, f"split {sizes} across the sharded dim does not follow its "
                                  f"blocks {lay.blocks}")
        if op_name(node) == "aten.split.Tensor" and \
                len({o.local_size(n, ctx.size) for o, n in zip(out, sizes[:-1])}) > 1:
            return conflict(node, "equal pieces of blocks held by different rank counts")
        return Outcome(out, rule="split (sharded dim, by blocks)")

    def cuts(self, node, dim) -> set[int]:
        if op_name(node) in _DROPS_DIM \
                or args_of(node)["dim"] % len(tensor_shape(node.args[0])) != dim:
            return set()
        return set(cumsum(hint(v.shape[dim]) for v in node.meta["val"]))

    def local_args(self, node, src, out, size, divide) -> dict:
        arg = _SPLITS[op_name(node)]
        args = args_of(node)
        if arg is None or args["dim"] % len(tensor_shape(node.args[0])) != src.dim:
            return {}
        sizes = args[arg]
        if isinstance(sizes, (list, tuple)):
            return {arg: [o.local_size(n, size) for o, n in zip(out, sizes)]}
        return {arg: out[0].local_size(sizes, size)}


@register
class SliceKind(Kind):
    name = "slice"
    keeps_element_order = True
    cuts_or_joins = True
    ops = frozenset({"aten.slice.Tensor", "aten.narrow.default", "aten.select.int"})

    def rule(self, node, lays, ctx: Context) -> Outcome:
        lay = lays[(0,)]
        dim = args_of(node)["dim"] % len(tensor_shape(node.args[0]))
        if dim != lay.dim:
            d = lay.dim - (1 if op_name(node) in _DROPS_DIM and lay.dim > dim else 0)
            return Outcome(with_dim(lay, d), rule="slice (other dim)")
        if op_name(node) in _DROPS_DIM:
            return conflict(node, "select on the sharded dim")
        full = hint(tensor_shape(node.args[0])[dim])
        start, stop = _range(node, full)
        if start is None:
            return conflict(node, "strided slice of a dim merging batch and heads") \
                if lay.period else _strided(node, lay, full, ctx.size)
        if lay.period:  # batch rows and heads in one dim: only the whole of it
            return Outcome(lay, rule="slice (all of it)") if (start, stop) == (0, full) else \
                conflict(node, f"slice [{start}:{stop}] of a dim merging batch and heads")
        bounds = [0, *cumsum(lay.blocks or [full])]
        if start not in bounds or stop not in bounds or lay.padded or start == stop:
            return conflict(node, f"slice [{start}:{stop}] cuts a block of the sharded dim")
        piece = _piece(lay, dim, bounds.index(start), bounds.index(stop))
        return Outcome(piece, rule="slice (sharded dim, whole blocks)")

    def cuts(self, node, dim) -> set[int]:
        if op_name(node) in _DROPS_DIM \
                or args_of(node)["dim"] % len(tensor_shape(node.args[0])) != dim:
            return set()
        start, stop = _range(node, hint(tensor_shape(node.args[0])[dim]))
        return set() if start is None else {start, stop}

    def local_args(self, node, src, out, size, divide) -> dict:
        args = args_of(node)
        if op_name(node) in _DROPS_DIM or args["dim"] % len(tensor_shape(node.args[0])) != src.dim \
                or src.period:  # the whole dim: nothing to change
            return {}
        full = hint(tensor_shape(node.args[0])[src.dim])
        start, stop = _range(node, full)
        if start is None:  # every step-th of the whole dim: the same start, the end clamps
            return {}
        bounds = [0, *cumsum(src.blocks or [full])]
        local = [0, *cumsum(src.local_blocks(size) if src.blocks else [src.local_size(full, size)])]
        start, stop = local[bounds.index(start)], local[bounds.index(stop)]
        if "length" in args:
            return {"start": start, "length": stop - start}
        return {"start": start, "end": stop}


def piece_bounds(node, piece: int | None) -> tuple[int | None, int | None]:
    """``[start, stop)`` along its dim of what ``node`` cuts out: a slice's range, or
    piece ``piece`` of a split; (None, None) for a strided slice."""
    dim = args_of(node)["dim"] % len(tensor_shape(node.args[0]))
    if piece is None:
        return _range(node, hint(tensor_shape(node.args[0])[dim]))
    sizes = [hint(v.shape[dim]) for v in node.meta["val"]]
    return sum(sizes[:piece]), sum(sizes[:piece + 1])


def _piece(lay: Shard, dim: int, i: int, j: int) -> Shard:
    """The shard of blocks ``i:j`` of ``lay`` (each block keeps its replica count)."""
    blocks, reps = (lay.blocks or ())[i:j], lay.block_replicas()[i:j]
    return Shard(dim, blocks if len(blocks) > 1 else None, None,
                 reps if len(reps) > 1 else reps[0])


def _pieces(lay: Shard, dim: int, sizes: list[int]) -> tuple[Shard, ...] | None:
    """The shards of consecutive pieces of ``sizes`` along ``lay``'s dim, made of whole
    blocks; None if a piece would cut one."""
    groups = group_blocks(lay, sizes)
    if groups is None:
        return None
    out, i = [], 0
    for g in groups:
        out.append(_piece(lay, dim, i, i + len(g)))
        i += len(g)
    return tuple(out)


def _strided(node, lay: Shard, full: int, tp: int) -> Outcome:
    """``x[start::step]`` over the whole sharded dim (GPT-OSS's interleaved gate | up,
    ``gate_up[..., ::2]`` and ``[..., 1::2]``): local when every rank's part of every
    block is a whole multiple of ``step``; each rank then takes every step-th of its part,
    and the result is sharded the same way, its blocks ``step`` times smaller."""
    a = args_of(node)
    start, stop, step = a["start"] or 0, a["end"], a["step"]
    blocks = lay.blocks or (full,)
    if not (isinstance(start, int) and isinstance(step, int) and 0 <= start < step) \
            or (stop is not None and not (isinstance(stop, int) and stop >= full)) \
            or lay.padded or lay.replicas != 1 or any(b % (tp * step) for b in blocks):
        return conflict(node, "strided slice on the sharded dim")
    return Outcome(Shard(lay.dim, tuple(b // step for b in blocks) if lay.blocks else None),
                   rule=f"strided slice [{start}::{step}] (sharded dim, whole multiples per rank)")


def _range(node, full: int):
    """``[start, stop)`` of a unit-step slice or narrow, non-negative; (None, None) if strided."""
    a = args_of(node)
    if "length" in a:  # narrow
        start = a["start"] % full if a["start"] < 0 else a["start"]
        return start, start + a["length"]
    start, stop = a["start"], a["end"]
    if a["step"] != 1 or not isinstance(start, (int, type(None))) \
            or not isinstance(stop, (int, type(None))):
        return None, None
    start = 0 if start is None else (start + full if start < 0 else start)
    stop = full if stop is None else (stop + full if stop < 0 else min(stop, full))
    return start, stop


@register
class ConcatKind(Kind):
    name = "concat"
    cuts_or_joins = True
    ops = frozenset({"aten.cat.default"})

    def rule(self, node, lays, ctx: Context) -> Outcome:
        dim = args_of(node)["dim"] % len(tensor_shape(node))
        ls = [lays[(0, j)] for j in range(len(node.args[0]))]
        split = [lay for lay in ls if isinstance(lay, Shard)]
        if len({lay.dim for lay in split}) != 1:
            return conflict(node, "cat of tensors sharded on different dims")
        if split[0].dim != dim:  # the pieces join along another dim: each rank its part
            if len(set(split)) != 1 or split[0].padded:
                return conflict(node, "cat of differently sharded tensors")
            # a replicated piece (GPT-OSS's per-head sinks next to the heads' scores) is
            # read as this rank's part of it
            needs = {(0, j): split[0] for j, lay in enumerate(ls) if not isinstance(lay, Shard)}
            return Outcome(split[0], needs, rule="cat (other dim)")
        if len(split) != len(ls):
            return conflict(node, "cat of sharded and replicated tensors")
        blocks: list[int] = []
        for lay, (_, a) in zip(ls, operands(node)):
            if lay.padded or lay.period:
                return conflict(node, "cat of padded shards, or of dims merging batch and heads")
            blocks.extend(lay.blocks or [hint(tensor_shape(a)[dim])])
        return Outcome(Shard(dim, tuple(blocks)), rule="cat (sharded dim: blocks)")
