"""Parameters split where their view is needed split.

A parameter that reaches an op needing it split only through shape-only ops
(GPT-OSS's attention sinks, one logit per head, viewed and expanded to the
scores' shape, ``sinks.reshape(1, -1, 1, 1).expand(B, -1, T, -1)``, then
joined to the heads' scores) is held split itself: each rank binds its heads'
part and the view runs on it, where slicing the full view every step would
also need an all-reduce of the parameter's gradient. ``annotate`` asks
``split_parameter`` where a rule needs a replicated operand split, and plans
again with the layouts of the parameter and of each view of it given.
"""

from __future__ import annotations

from typing import cast

import torch.fx as fx

from ..layouts import Shard
from .graph import args_of, hint, op_name, tensor_shape
from .kinds import Context
from .kinds.base import with_dim
from .kinds.permute import PERMUTATIONS
from .reshape import map_reshape


def split_parameter(node: fx.Node, need: Shard, params: dict, ctx: Context) -> dict | None:
    """``node`` -> ``need`` and the layouts of the views before it, back to the parameter
    read (``get_attr``) it views through shape-only ops, each read by the next alone;
    None when there is no such parameter or no layout of it gives ``need``."""
    chain = []
    cur = node
    while cur.op == "call_function" and ctx.kind_at(cur).shape_only and cur.args \
            and isinstance(cur.args[0], fx.Node) and (cur is node or len(cur.users) == 1):
        chain.append(cur)
        cur = cur.args[0]
    if not chain or cur.op != "get_attr" or cur.target not in params or len(cur.users) != 1 \
            or need.padded or need.replicas != 1 or need.blocks:
        return None
    for d in range(len(tensor_shape(cur))):
        if hint(tensor_shape(cur)[d]) % ctx.size:
            continue
        lays = {cur: Shard(d)}
        lay = lays[cur]
        for n in reversed(chain):
            through = _through(n, lay, ctx)
            if through is None:
                break
            lay = lays[n] = through
        else:
            if lay == need:
                return lays
    return None


def _through(node: fx.Node, lay: Shard, ctx: Context) -> Shard | None:
    """Where a shard of ``node``'s input lands in its output (None: it is not kept whole)."""
    kind = ctx.kind_of(node)
    if kind == "identity":
        return lay
    src, dst = tensor_shape(cast(fx.Node, node.args[0])), tensor_shape(node)
    if kind == "permute":
        return with_dim(lay, PERMUTATIONS[op_name(node)](args_of(node), len(dst)).index(lay.dim))
    if kind == "expand":
        d = lay.dim + len(dst) - len(src)
        return with_dim(lay, d) if hint(dst[d]) == hint(src[lay.dim]) else None
    out = map_reshape(lay, list(src), list(dst), ctx.size)
    return out if isinstance(out, Shard) else None
