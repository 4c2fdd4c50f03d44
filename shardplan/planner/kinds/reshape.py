"""reshape and expand: ops that change the shape, not the data order.

A reshape's layout follows the dims through the regrouping (``..reshape``);
its size argument, if any, names the full size of the sharded dim and
becomes the local one: ``view(x, [B, T, 12, 64])`` on rank r of tp=4 holding
3 heads runs ``view(x, [B, T, 3, 64])``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch

from ..graph import args_of, hint, is_symbolic, op_name, shape, tensor_shape
from ..reshape import map_reshape, reshape_groups
from ...layouts import Shard
from .equation import einsum_labels
from .permute import PERMUTATIONS
from .base import UNLISTED, Conflict, Context, Kind, Outcome, conflict, cumsum, local_size, \
    register, with_dim
from .index import constant_index

_DROPS = {"aten.unbind.int", "aten.select.int"}  # pieces lose the cut dim
_CUTS = _DROPS | {"aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default",
                  "aten.slice.Tensor", "aten.narrow.default"}  # ops cutting along their `dim`
# each overload -> the name of its list-of-sizes argument (None: it has none)
_SIZES = {
    "aten.view.default": "size", "aten.reshape.default": "shape",
    "aten._unsafe_view.default": "size", "aten.unflatten.int": "sizes",
    "aten.unsqueeze.default": None, "aten.squeeze.dim": None, "aten.squeeze.dims": None,
    "aten.squeeze.default": None, "aten.flatten.using_ints": None,
}


@register
class ReshapeKind(Kind):
    name = "reshape"
    shape_only = True
    keeps_element_order = True
    ops = frozenset(_SIZES)

    def rule(self, node, lays, ctx: Context) -> Outcome:
        lay = lays[(0,)]
        src, dst = list(tensor_shape(node.args[0])), tensor_shape(node)
        if lay.replicas != 1 and _merges_expanded_copies(node, lay, ctx):
            d = lay.dim  # the copies of each part are split between the ranks holding it
            src[d:d + 2] = [hint(src[d]) * hint(src[d + 1])]  # [B, KV, n, T, D] -> [B, KV*n, T, D]
            lay = Shard(d)
        res = map_reshape(lay, src, dst, ctx.size)
        if isinstance(res, Shard) and _repeats_heads_outer(node, res, ctx):
            return Outcome(None, conflict=Conflict(
                node, "K/V heads repeated outside them (query head h reads K/V head "
                      "h % kv_heads): every rank needs every K/V head, so K and V stay whole"))
        if isinstance(res, Shard) and lay.replicas == 1 and (
                _one_head_split(node, lay, res, ctx) or _inside_one_head(node, lay, ctx)):
            return Outcome(None, conflict=Conflict(  # hold the one head on every rank
                node, "one head (a size-1 dim) broadcast against more heads later",
                divisibility=True, replicas=ctx.size))
        if isinstance(res, tuple):
            reason, extra = res
            return Outcome(None, conflict=Conflict(node, reason, **extra))
        return Outcome(res, rule="reshape")

    def cuts(self, node, dim) -> set[int]:
        """A fused output viewed with its pieces as a new major dim that is then taken
        apart (``qkv.view(B, T, 3, H, D)``, then ``unbind``/index along the 3): the
        pieces' edges, so the column shard is blocked ``[q_r | k_r | v_r]``."""
        src = [hint(x) for x in tensor_shape(node.args[0])]
        dst = [hint(x) for x in tensor_shape(node)]
        for (a, b), (c, e) in reshape_groups(src, dst) or []:
            if (a, b) == (dim, dim + 1) and e - c >= 2 and dst[c] > 1:
                piece = src[dim] // dst[c]
                return {k * piece for k in _cut_points(node, c) if 0 < k < dst[c]}
        return set()

    def local_args(self, node, src, out, size, divide) -> dict:
        arg = _SIZES[op_name(node)]
        sizes = args_of(node).get(arg) if arg else None
        if not isinstance(out, Shard) or not isinstance(sizes, (list, tuple)):
            return {}
        sizes = list(sizes)
        j = out.dim - (len(tensor_shape(node)) - len(sizes))  # unflatten's sizes cover some dims
        if not 0 <= j < len(sizes):
            return {}
        sizes[j] = local_size(sizes[j], out, size, divide)
        return {arg: sizes}


@register
class ExpandKind(Kind):
    name = "expand"
    shape_only = True
    ops = frozenset({"aten.expand.default", "aten.broadcast_to.default"})

    def rule(self, node, lays, ctx: Context) -> Outcome:
        lay = lays[(0,)]
        src, dst = tensor_shape(node.args[0]), tensor_shape(node)
        if lay.replicas == ctx.size and not lay.blocks:
            lay = _onto_repeated_head(lay, [hint(x) for x in src], [hint(x) for x in dst])
        d = lay.dim + len(dst) - len(src)
        if hint(dst[d]) != hint(src[lay.dim]):
            return conflict(node, "expand along a sharded dim")
        if lay.blocked_replicas:
            return conflict(node, "expand of blocks held by different rank counts")
        if lay.replicas > 1:  # broadcast copies of a part held by several ranks: split them
            e = lay.dim + 1  # [B, KV, 1, T, D] -> [B, KV, n, T, D]
            copies = hint(dst[d + 1]) if e < len(src) and hint(src[e]) == 1 else 0
            one_each = lay.local_size(hint(src[lay.dim]), ctx.size) == 1  # one K/V head per rank
            if not one_each or copies % lay.replicas or not all(
                    ctx.kind_of(u) == "reshape" for u in node.users):
                return conflict(node, "expand of a dim held by groups of ranks")
        return Outcome(with_dim(lay, d), rule="expand")

    def local_args(self, node, src, out, size, divide) -> dict:
        sizes = list(args_of(node)["size"])
        if not isinstance(out, Shard):
            return {}
        j = out.dim
        sizes[j] = local_size(sizes[j], out, size, divide)
        if isinstance(out.replicas, int) and out.replicas > 1:  # copies split between replicas
            s = sizes[j + 1]
            sizes[j + 1] = (s if s == -1 else s // out.replicas) if isinstance(s, int) \
                else divide(s, out.replicas)
        return {"size": sizes}


@register
class RepeatKind(Kind):
    """repeat: a shard moves with its dim (new leading dims shift it); a sharded dim
    repeated (DeBERTa's per-head position keys for every batch row: ``[H, R, D] ->
    [B*H, R, D]``) holds the shard in every copy, a ``period`` of the dim's size. The
    repeat counts stay as they are: this rank's part, repeated, is its part of the result."""

    name = "repeat"
    ops = frozenset({"aten.repeat.default"})

    def rule(self, node, lays, ctx: Context) -> Outcome:
        lay = lays[(0,)]
        repeats, size = args_of(node)["repeats"], tensor_shape(node.args[0])[lay.dim]
        d = lay.dim + len(repeats) - len(tensor_shape(node.args[0]))
        if isinstance(repeats[d], int) and repeats[d] == 1:
            return Outcome(with_dim(lay, d), rule="repeat (other dims)")
        if lay.padded or is_symbolic(size):
            return conflict(node, "repeat of a padded or symbolic sharded dim")
        return Outcome(replace(lay, dim=d, period=lay.period or hint(size)),
                       rule="repeat (the shard in every copy)")


def _onto_repeated_head(lay: Shard, src, dst) -> Shard:
    """A tensor every rank holds whole is held on any of its dims alike; one whose size-1
    dim (one K/V head) is followed by a size-1 dim this expand repeats is taken as held on
    that head, so the copies split between the ranks (GPT-BigCode's one K head, its
    head dim the split one in the fused output): ``[B, 1, 1, T, D] -> [B, 1, n, T, D]``."""
    off = len(dst) - len(src)
    for e in range(1, len(src)):
        if src[e] == 1 and dst[e + off] > 1 and src[e - 1] == 1:
            return Shard(e - 1, None, None, lay.replicas)
    return lay


def _inside_one_head(node, lay: Shard, ctx: Context) -> bool:
    """Does ``node``'s input hold one head in a size-1 dim before its split dim, later
    broadcast against more heads? Then the split cuts inside that head (GPT-BigCode's
    ``c_attn(x).unsqueeze(1).split(...)``: the K piece ``[B, 1, T, D]`` split on D)."""
    src = [hint(x) for x in tensor_shape(node.args[0])]
    if lay.blocks or lay.padded:
        return False
    return any(src[h] == 1 and _broadcast_later(node.args[0], h, ctx) for h in range(lay.dim))


def _merges_expanded_copies(node, lay: Shard, ctx: Context) -> bool:
    """Is ``node`` a reshape merging ``lay``'s dim with the next one, made by an expand
    from size 1 (a repeat of K/V heads for grouped-query attention)?

    ``[B, KV, 1, T, D] -expand-> [B, KV, n, T, D] -reshape-> [B, KV*n, T, D]``
    """
    src = node.args[0]
    d = lay.dim
    if ctx.kind_of(src) != "expand" or lay.blocks or lay.padded:
        return False
    before = tensor_shape(src.args[0])
    off = len(tensor_shape(src)) - len(before)
    if d + 1 - off >= len(before) or hint(before[d + 1 - off]) != 1:
        return False
    dst = [hint(x) for x in tensor_shape(node)]
    src_h = [hint(x) for x in tensor_shape(src)]
    merged = src_h[:d] + [src_h[d] * src_h[d + 1]] + src_h[d + 2:]
    return reshape_groups(merged, dst) is not None and \
        hint(tensor_shape(src)[d + 1]) % cast(int, lay.replicas) == 0  # no blocks: one count


def _repeats_heads_outer(node, res: Shard, ctx: Context) -> bool:
    """Is ``node`` an unsqueeze of sharded heads whose new size-1 dim, right before them,
    is expanded and then merged with them as the outer factor (x-transformers' GQA
    ``repeat(t, 'b kvh n d -> b (r kvh) n d')``): ``[B, KV, T, D] -> [B, 1, KV, T, D]
    -expand-> [B, r, KV, T, D] -reshape-> [B, r*KV, T, D]``? Query head ``h`` then reads
    K/V head ``h % KV``: a contiguous split of the query heads needs all K/V heads."""
    h = res.dim - 1
    dst = [hint(x) for x in tensor_shape(node)]
    if h < 0 or dst[h] != 1 or dst[res.dim] == 1 or res.blocks or res.padded:
        return False
    for expand in node.users:
        if ctx.kind_of(expand) != "expand" or hint(tensor_shape(expand)[h]) == 1:
            return False
        for merge in expand.users:
            out = [hint(x) for x in tensor_shape(merge)]
            wide = [hint(x) for x in tensor_shape(expand)]
            if ctx.kind_of(merge) != "reshape" or ((h, h + 2), (h, h + 1)) not in (
                    reshape_groups(wide, out) or []):
                return False
    return bool(node.users)


def _one_head_split(node, lay: Shard, res: Shard, ctx: Context) -> bool:
    """Does ``node`` split the shard into one head (a new size-1 dim in front of it)
    that is later broadcast against several heads (multi-query attention's K/V)?

    ``[B, T, D] -> [B, T, 1, D]`` is an unsqueeze by shape; it is a head split
    when the size-1 dim meets an expand or a broadcast to more than one.
    """
    src, dst = [hint(x) for x in tensor_shape(node.args[0])], [hint(x) for x in tensor_shape(node)]
    h = res.dim - 1
    if h < 0 or dst[h] != 1 or lay.blocks or lay.padded:
        return False
    group = next(((a, b), (c, e)) for (a, b), (c, e) in reshape_groups(src, dst)
                 if a <= lay.dim < b)
    return group[1][0] <= h and _broadcast_later(node, h, ctx)


def _broadcast_later(node, d: int, ctx: Context) -> bool:
    """Is size-1 dim ``d`` of ``node`` later made larger than 1, by an expand (of it,
    or of a size-1 dim unsqueezed right after it: a repeat of K/V heads) or by an
    elementwise broadcast? Follows the dim through layout-keeping ops."""
    frontier, seen = [(node, d)], set()
    while frontier:
        cur, d = frontier.pop()
        if (cur, d) in seen:
            continue
        seen.add((cur, d))
        src = [hint(x) for x in tensor_shape(cur)]
        for user in cur.users:
            kind = ctx.kind_at(user) if user.op == "call_function" else UNLISTED
            if kind.cuts_or_joins and op_name(user) not in _DROPS:
                if isinstance(user.meta.get("val"), (list, tuple)):
                    frontier.extend((g, d) for g in user.users)
                else:
                    frontier.append((user, d))
                continue
            shp = shape(user) if isinstance(user.meta.get("val"), torch.Tensor) else None
            if kind.name == "equation" and shp is not None:  # the dim's letter, if kept
                e = _einsum_dim(user, cur, d)
                if e is not None and hint(shp[e]) > 1:
                    return True
                frontier.extend([] if e is None else [(user, e)])
                continue
            if shp is None or user.args[0] is not cur and kind.name != "elementwise":
                continue
            out = [hint(x) for x in shp]
            if kind.per_element and len(out) >= len(src):
                e = d + len(out) - len(src)
                if out[e] > 1:
                    return True
                frontier.append((user, e))
            elif kind.name == "permute":
                perm = PERMUTATIONS[op_name(user)](args_of(user), len(out))
                frontier.append((user, perm.index(d)))
            elif kind.name == "reshape":
                groups = reshape_groups(src, out) or []
                frontier.extend((user, c) for (a, b), (c, e) in groups
                                if (a, b) == (d, d + 1) and e == c + 1 and out[c] == 1)
            elif kind.name == "expand":
                e = d + len(out) - len(src)
                if out[e] > 1 or (d + 1 < len(src) and src[d + 1] == 1 and out[e + 1] > 1):
                    return True
    return False


def _einsum_dim(node, operand, d: int) -> int | None:
    """Where dim ``d`` of ``operand`` lands in the output of einsum ``node`` (None: summed)."""
    lab = einsum_labels(node, args_of(node)["equation"].replace(" ", ""))
    if lab is None:
        return None
    letter = lab[(1, list(node.args[1]).index(operand))][d]
    return lab["out"].index(letter) if letter in lab["out"] else None


def _cut_points(node, d: int) -> set[int]:
    """Where dim ``d`` of ``node`` is cut into pieces by a split, unbind, slice or index
    along it, directly or after permutes and cuts along other dims: indices along ``d``
    (Falcon's ``[..., :-2, :]``, ``[..., [-2], :]``, ``[..., [-1], :]`` of ``H + 2`` heads
    cut at ``H`` and ``H + 1``)."""
    size = hint(tensor_shape(node)[d])
    out: set[int] = set()
    for user in node.users:
        name = op_name(user) if user.op == "call_function" else ""
        if name in PERMUTATIONS:
            perm = PERMUTATIONS[name](args_of(user), len(tensor_shape(user)))
            out |= _cut_points(user, perm.index(d))
        elif name == "aten.index.Tensor" and user.args[0] is node:
            idx = list(args_of(user)["indices"])
            at = constant_index(idx[d]) if d < len(idx) and idx[d] is not None else None
            out |= {p for v in at or () for p in (v % size, v % size + 1)}
        elif name in _CUTS:
            cut, val = args_of(user)["dim"] % len(tensor_shape(node)), user.meta.get("val")
            pieces = isinstance(val, (list, tuple))
            if cut == d and name in _DROPS:
                out |= set(range(1, size))
            elif cut == d and pieces and len(val) > 1:
                out |= set(cumsum(hint(v.shape[d]) for v in val))
            elif cut == d and not pieces and hint(val.shape[d]) < size:
                a = args_of(user)
                start = a.get("start") or 0
                start = start % size if isinstance(start, int) else None
                stop = hint(val.shape[d])
                out |= set(range(1, size)) if start is None or a.get("step", 1) != 1 \
                    else {start, start + stop}
            elif cut != d and not pieces:
                out |= _cut_points(user, d - (name in _DROPS and cut < d))
    return out
