"""Where a shard lands after a row-major reshape: the algebra of dim groups.

A reshape regroups runs of dims with equal products:
``[B, T, H*D] -> [B, T, H, D]`` pairs ``(B)-(B)``, ``(T)-(T)``, ``(H*D)-(H, D)``.
A shard of ``H*D`` by tp lands on ``H`` when every rank's part is whole
heads, and on ``D`` never (the shard would cut every head). Blocked shards
(a fused QKV ``[B, T, 3*H*D]``) follow block by block.
"""

from __future__ import annotations

import math

from ..layouts import Shard
from .graph import coefficient, hint, is_symbolic


def map_reshape(lay: Shard, src, dst, tp) -> Shard | tuple[str, dict]:
    """Where a shard of ``src`` lands in ``dst`` (sizes: ints or symbolic), or
    ``(why not, Conflict fields)``.

    The sharded group, read in row-major order, repeats one *pattern*: the
    sharded dim's blocks times the dims inside it. Dims outside it only repeat
    the pattern, so they may be symbolic (the batch); the pattern itself must
    be static. A ``dst`` dim that merges a symbolic count with the pattern
    (``[B, H, T, D] -> [B*H, T, D]``) gets a shard with a ``period``.
    """
    src_h, dst_h = [hint(d) for d in src], [hint(d) for d in dst]
    groups = reshape_groups(src_h, dst_h)
    if groups is None:
        return "reshape groups do not match", {}
    (a, b), (c, e) = next(g for g in groups if g[0][0] <= lay.dim < g[0][1])
    if lay.padded:
        if (b - a, e - c) == (1, 1):
            return Shard(c, None, lay.padded)
        return "reshape of a padded dim", {}
    pattern = _pattern(lay, src, b)
    if pattern is None:
        return "reshape mixes the sharded dim with batch/sequence dims", {}
    period = sum(x for x, _ in pattern)
    for j in range(c, e):  # try each dst dim of the group, outermost first
        if any(is_symbolic(x) for x in dst[j + 1:e]):
            continue
        inner_out = math.prod(dst_h[j + 1:e])  # elements of one index along dst[j]
        merged = is_symbolic(dst[j])  # a symbolic count times whole patterns
        if merged and (period % inner_out or j > c and coefficient(dst[j]) * inner_out % period):
            continue
        row = period if merged else dst_h[j] * inner_out  # elements of one index along dst[c:j]
        rows = _rows(pattern, row)
        if rows is None or any(blk % inner_out for blk, _ in rows[0]):
            continue
        counts = [blk // inner_out for blk, _ in rows[0]]  # indices of dst[j] per block
        parts = [tp // r for _, r in rows[0]]
        if all(n == 1 for n in counts) and j < e - 1 and max(parts) > 1:
            continue  # a dim enumerating the blocks, or a new size-1 dim: the shard lies inside
            # (held whole by every rank, the size-1 dim is one head: the shard stays on it)
        if any(n % p for n, p in zip(counts, parts)):  # the major dim carries the shard (heads):
            # no moving it inward; ranks holding a block's heads in groups would divide it
            per_block = [tp // math.gcd(n, tp) for n in counts]
            needed = per_block[0] if len(counts) == 1 else tuple(per_block) \
                if len(counts) == len(lay.blocks or ()) else 1
            return (f"split of a sharded dim into {[dst_h[k] for k in range(c, e)]} does not "
                    f"divide by tp={tp} (e.g. heads not divisible by tp)",
                    {"divisibility": True, "replicas": needed, "sizes": tuple(counts)})
        reps = tuple(r for _, r in rows[0])  # equal counts collapse to one (Shard)
        blocks, per = (tuple(counts) if len(counts) > 1 else None), None
        if merged:  # equal blocks, alike held, in every period are a shorter period
            if blocks and len(set(counts)) == 1 and len(set(reps)) == 1:
                blocks = None
            per = sum(counts) if blocks else counts[0]
        return Shard(j, blocks, None, reps if blocks else reps[0], per)
    return f"reshape {src_h} -> {dst_h} cuts the shard", {}


def _pattern(lay: Shard, src, b: int) -> list[tuple[int, int]] | None:
    """One period of the shard in its reshape group, in elements, each block with the
    count of ranks holding its parts: the sharded dim's blocks times the static dims inside
    it (``[B, T, 3*H*D]`` by ``(H*D,)*3``: ``[H*D]*3``). None where the period is not
    static: a symbolic dim inside it, or a symbolic sharded dim that is not a batch count
    times a ``period``."""
    d = lay.dim
    if any(is_symbolic(x) for x in src[d + 1:b]) or is_symbolic(src[d]) and not lay.period:
        return None
    inner = math.prod(hint(x) for x in src[d + 1:b])
    return [(blk * inner, r) for blk, r in zip(lay.blocks or [lay.period or hint(src[d])],
                                                 lay.block_replicas())]


def _rows(pattern: list[tuple[int, int]], row: int) -> list[list[tuple[int, int]]] | None:
    """The repeated pattern cut into runs of ``row`` elements, each made of whole blocks
    and all alike; None if they are not."""
    size = sum(x for x, _ in pattern)
    flat = pattern * (math.lcm(size, row) // size)
    rows, cur = [], []
    for blk in flat:
        cur.append(blk)
        if sum(x for x, _ in cur) == row:
            rows.append(cur)
            cur = []
        elif sum(x for x, _ in cur) > row:
            return None
    return rows if not cur and all(r == rows[0] for r in rows) else None


def reshape_groups(src, dst):
    """Pair runs of dims with equal products: [((a, b), (c, e)), ...].

    ``[B, T, H*D] -> [B, T, H, D]`` gives ``[((0, 1), (0, 1)), ((1, 2), (1, 2)),
    ((2, 3), (2, 4))]``. Size-1 dims facing each other pair up; one that
    appears on one side only joins the run after it (a new head dim of size 1
    is the major dim of what follows); trailing ones join the last run.
    """
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        if i < len(src) and j < len(dst) and src[i] == 1 and dst[j] == 1:
            groups.append(((i, i + 1), (j, j + 1)))  # a size-1 dim on both sides: kept
            i, j = i + 1, j + 1
            continue
        a, c = i, j
        while i < len(src) and src[i] == 1:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i == len(src) and j == len(dst):  # only size-1 dims were left
            if groups:
                (ga, _), (gc, _) = groups[-1]
                groups[-1] = ((ga, i), (gc, j))
            else:
                groups.append(((a, i), (c, j)))
            break
        if i == len(src) or j == len(dst):
            return None
        ps, pd = src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd and i < len(src):
                ps *= src[i]; i += 1  # noqa: E702
            elif pd < ps and j < len(dst):
                pd *= dst[j]; j += 1  # noqa: E702
            else:
                return None
        groups.append(((a, i), (c, j)))
    return groups


def keeps_last_dim(src, dst) -> bool:
    """Does ``src -> dst`` leave the last dim whole, regrouping only the others?

    ``[B, T, H*D] -> [B*T, H*D]`` does; ``[B, T, H*D] -> [B, T, H, D]`` does not.
    """
    groups = reshape_groups(src, dst)
    if not groups:
        return False
    (a, b), (c, e) = groups[-1]
    return b - a == 1 and e - c == 1


def group_blocks(lay: Shard, sizes: list[int]):
    """Split a sharded dim's blocks into consecutive groups of the given sizes.

    Blocks ``(H, H, H)`` split as ``[H, 2*H]`` give ``[(H,), (H, H)]``.
    """
    if lay.padded:
        return None
    blocks = list(lay.blocks or [sum(sizes)])
    groups = []
    for s in sizes:
        g: list[int] = []
        while blocks and sum(g) < s:
            g.append(blocks.pop(0))
        if sum(g) != s:
            return None
        groups.append(tuple(g))
    return groups
