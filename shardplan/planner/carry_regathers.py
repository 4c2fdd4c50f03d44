"""carry_regathers: a region's re-gather rides in its closing scatter's backward call.

Sequence parallelism's backward all-gathers twice per region: the closing
reduce-scatter's backward gathers the output gradient, then the opening linears
re-gather the input shard they kept (``SEQ_REGATHER``). Both are a shard of the
tokens, and the scatter's backward always runs first (the linears' outputs
reach it), so one all-gather can carry both: the regather's ``carrier`` is that
scatter. On gloo a call's latency, not its bytes, sets its cost.
"""

from __future__ import annotations

from dataclasses import replace

import torch.fx as fx

from .kinds.base import any_sharded
from .transitions import Purpose, Transition


def carry_regathers(ts: list[Transition], layouts: dict, on_tokens, block) -> list[Transition]:
    """``ts`` with each ``SEQ_REGATHER`` whose linears' region closes at a ``SEQ_SCATTER``
    in the same block carried by it (the last in graph order, where the region closes at
    several: its backward runs first). ``on_tokens(node)``: is it held as S(seq)?
    ``block(node)``: the block it runs in (recomputation and FSDP run blocks apart)."""
    scatters = {t.src for t in ts if t.purpose is Purpose.SEQ_SCATTER}
    out = []
    for t in ts:
        if t.purpose is Purpose.SEQ_REGATHER and scatters:
            linears = [c for c, _ in t.consumers]
            closing = [s for s in _closings(linears, scatters, layouts, on_tokens)
                       if block(s) == block(linears[0])]
            if closing:
                t = replace(t, carrier=max(closing))
        out.append(t)
    return out


def _closings(starts: list[fx.Node], scatters: set, layouts: dict, on_tokens) -> set:
    """The scatters reached from ``starts`` through the region (sharded or partial values,
    none on the tokens)."""
    seen, todo, found = set(starts), list(starts), set()
    while todo:
        for u in todo.pop().users:
            if u in seen:
                continue
            seen.add(u)
            if u in scatters:
                found.add(u)
            elif any_sharded(layouts.get(u)) and not on_tokens(u):
                todo.append(u)
    return found
