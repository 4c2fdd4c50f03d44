"""The text layout report: warnings first, then memory, communication, and
per-block tables with identical blocks collapsed."""

from __future__ import annotations

import re
from collections import Counter

from ..planner import blocks
from ..planner.purposes import PURPOSES


def _scaled(n: float, base: int, units: tuple[str, ...]) -> str:
    """``n`` in the largest of ``units`` (each ``base`` times the one before) below ``base``."""
    for unit in units:
        if abs(n) < base or unit == units[-1]:
            return f"{n:.0f} {unit}".rstrip() if unit == units[0] else f"{n:.2f} {unit}"
        n /= base
    return str(n)


def human(n: float) -> str:
    """``1.50 KiB``: bytes with a binary prefix."""
    return _scaled(n, 1024, ("B", "KiB", "MiB", "GiB", "TiB"))


def render_text(plan, width: int = 100) -> str:
    lines = [f"shardplan plan: {plan.model} at {plan.dims} (rules: {plan.rules}, "
             f"{plan.tokens} tokens in the example)"]
    if plan.warnings:
        lines.append(f"\nWARNINGS ({len(plan.warnings)})")
        lines += [f"  ! {_clip(w, width - 4)}" for w in plan.warnings]
    m = plan.memory
    ratio = m.param_bytes_per_rank / max(m.param_bytes_unsharded, 1)
    lines.append(f"\nparameters per rank: {human(m.param_bytes_per_rank)} of "
                 f"{human(m.param_bytes_unsharded)} unsharded ({ratio:.1%})")
    if m.training is not None:
        lines += _training_memory(m.training)
    if plan.pipeline is not None:
        lines += _pipeline(plan.pipeline)
    lines.append("\ncommunication per training step (example inputs):")
    groups = Counter()
    nbytes = Counter()
    for c in plan.collectives:
        key = (c.direction, c.kind, c.purpose, c.elements_per_token)
        groups[key] += 1
        nbytes[key] += c.bytes
    for (direction, kind, purpose, per_tok), n in sorted(groups.items()):
        lines.append(f"  {direction:8} {n:4} x {kind:14} {purpose:13} "
                     f"{per_tok:10.1f} elements/token  {human(nbytes[(direction, kind, purpose, per_tok)]):>11}")
    total = sum(c.bytes for c in plan.collectives)
    lines.append(f"  total {len(plan.collectives)} collectives, {human(total)}")
    if plan.choices:
        lines += _choices(plan, width)
    if plan.sequence_parallel:
        lines += _sequence(plan, width)
    lines.append("\nparameters (layout: R replicated, S(d) split on dim d, |a+b blocks, |padN padded):")
    rows = [(p.name, (p.layout, tuple(p.global_shape), tuple(p.local_shape))) for p in plan.params]
    for title, group in _collapse(rows):
        lines.append(f"  {title}")
        for name, (lay, gshape, lshape) in group:
            lines.append(_clip(f"    {name:40} {lay:14} {str(gshape):>18} -> {str(lshape)}", width))
    return "\n".join(lines)


def _choices(plan, width: int) -> list[str]:
    """Ops a region stopped at: distributed, the region kept replicated, or the shard
    gathered there, with costs."""
    lines = ["\nreductions and other ops over a split dim (*chosen; cost: bytes moved per step + "
             "parameter bytes per rank; ties: distributed, replicated, gathered):"]
    rows = [(c.module or "(top level)", c) for c in plan.choices]
    for title, group in _collapse(rows):
        lines.append(f"  {title}")
        for name, c in group:
            alts = ", ".join(f"{'*' if k == c.chosen else ''}{k} {human(v['moved'])}+"
                             f"{human(v['params'])}" for k, v in c.costs.items())
            lines.append(_clip(f"    {name:22} {alts}", width))
    return lines


def _data_parallel(t) -> str:
    """``dp=4``, ``dp_shard=4 FSDP`` or ``dp_replicate=2 x dp_shard=2 HSDP``."""
    if not t.fsdp:
        return f"dp={t.dp}"
    if t.dp_replicate == 1:
        return f"dp_shard={t.dp_shard} FSDP"
    return f"dp_replicate={t.dp_replicate} x dp_shard={t.dp_shard} HSDP"


def _training_memory(t) -> list[str]:
    """The per-rank memory table of a training step, and whether it fits."""
    setup = [_data_parallel(t), t.dtype, t.optimizer or "no optimizer"]
    setup += [w for w, on in (("sequence parallel", t.sequence_parallel),
                              ("recompute", t.recompute)) if on]
    lines = [f"\ntraining memory per rank ({', '.join(setup)}):"]
    lines += [f"  {name:22} {human(n):>11}" for name, n in t.rows() if n or name != "FSDP gathered block"]
    lines.append(f"    of which {t.blocks} blocks x {human(t.activations_per_block)} + "
                 f"{human(t.activations_outside_blocks)} outside them")
    lines.append(f"  {'peak (sum)':22} {human(t.peak):>11}")
    if t.fits is not None:
        verdict = "FITS" if t.fits else "DOES NOT FIT"
        lines.append(f"  {verdict} in {human(t.gpu_memory)} ({t.peak / t.gpu_memory:.0%} used)")
    return lines


#: how each schedule's bubble is computed, for the report
BUBBLE_FORMULA = {"gpipe": "(p-1)/m", "1f1b": "(p-1)/m", "interleaved": "(p-1)/(v*m)",
                  "zbv": "0 (ZB-V)"}


def stage_blocks(s, layers: str) -> str:
    """``transformer.h.0-3 + embedding``: a stage's blocks and the parts around them."""
    first, end = s.blocks
    text = f"{layers}.{first}" + (f"-{end - 1}" if end - first > 1 else "")
    return text + "".join(f" + {part}" for part, on in (("embedding", s.embedding),
                                                        ("head", s.head)) if on)


def count(n: float) -> str:
    """``1.23 G``: a count with a decimal prefix."""
    return _scaled(n, 1000, ("", "K", "M", "G", "T"))


def _pipeline(pipe) -> list[str]:
    """The stages: their blocks, parameters, FLOPs share and memory per rank, the bubble."""
    v = f", v={pipe.virtual_stages} stages per rank" if pipe.virtual_stages > 1 else ""
    lines = [f"\npipeline: pp={pipe.pp}, schedule {pipe.schedule}{v}, {pipe.microbatches} "
             f"microbatches; bubble {BUBBLE_FORMULA[pipe.schedule]} = {pipe.bubble:.1%} of "
             f"the compute time",
             f"  {'stage':5} {'rank':4} {'blocks':36} {'params/rank':>11} "
             f"{'FLOPs/microbatch':>16} {'time':>6} {'in flight':>9} {'activations':>11} "
             f"{'state':>11} {'peak':>11}"]
    for s in pipe.stages:
        state = s.param_bytes + s.grad_bytes + s.optimizer_bytes
        verdict = "" if s.fits is None or pipe.virtual_stages > 1 else \
            ("  FITS" if s.fits else "  DOES NOT FIT")
        lines.append(f"  {s.index:<5} {s.pp_rank:<4} {_clip(stage_blocks(s, pipe.layers), 36):36} "
                     f"{count(s.params):>11} {count(s.flops):>16} {s.time_share:>6.1%} "
                     f"{s.in_flight:>9} {human(s.activations):>11} {human(state):>11} "
                     f"{human(s.peak):>11}{verdict}")
    if pipe.memory_limit is not None and pipe.virtual_stages > 1:
        for rank, peak in enumerate(pipe.rank_peaks):
            verdict = "FITS" if peak <= pipe.memory_limit else "DOES NOT FIT"
            lines.append(f"  rank {rank}: peak {human(peak)} {verdict} in "
                         f"{human(pipe.memory_limit)}")
    elif pipe.memory_limit is not None:
        lines.append(f"  memory limit per rank {human(pipe.memory_limit)}")
    lines.append("  (time: the stage's share of the forward and backward FLOPs; state: "
                 "parameters, gradients, optimizer)")
    return lines


def _sequence(plan, width: int) -> list[str]:
    """The ops run on this rank's tokens, and the reduce-scatters / all-gathers around them."""
    seq = [d for d in plan.decisions if d.sequence]
    sites = Counter((c.module, c.purpose, c.kind, c.direction) for c in plan.collectives
                    if PURPOSES[c.purpose].tokens)
    nbytes = Counter()
    for c in plan.collectives:
        nbytes[(c.module, c.purpose, c.kind, c.direction)] += c.bytes
    lines = [f"\nsequence parallel: {len(seq)} ops on S(seq), this rank's 1/{plan.tp} of the tokens; "
             "reduce-scatter leaving a region, all-gather entering one:"]
    rows = [(d.module or "(top level)", ("S(seq)", re.sub(r"_\d+$", "", d.node), d.layout))
            for d in seq]
    rows += [(module or "(top level)", (purpose, f"{n} x {kind} {direction}", human(nbytes[key])))
             for key, n in sites.items() for module, purpose, kind, direction in [key]]
    for title, group in _collapse(sorted(rows, key=lambda r: _order(plan, r[0]))):
        lines.append(f"  {title}")
        for name, (what, node, detail) in group:
            lines.append(_clip(f"    {name:30} {what:12} {node:28} {detail}", width))
    return lines


def _order(plan, module: str) -> int:
    """Position of ``module``'s first decision or collective in the plan (graph order)."""
    for i, item in enumerate(list(plan.decisions) + list(plan.collectives)):
        if (item.module or "(top level)") == module:
            return i
    return len(plan.decisions) + len(plan.collectives)


def _collapse(items):
    """(title, rows) groups of (name, row) items: one per top-level item, consecutive
    identical blocks merged."""
    groups: dict = {}
    for name, row in items:
        key, idx, rest = blocks.split_first(name) or ("", -1, name)
        groups.setdefault((key, idx), []).append((rest, row))
    result = []
    for run in blocks.runs((idx, (key, rows), (key, rows)) for (key, idx), rows in groups.items()):
        key, rows = run.item
        if run.first < 0:
            title = "(top level)"
        elif run.count == 1:
            title = f"{key}.{run.first}"
        else:
            title = f"{key}.{run.first}-{run.last} ({run.count} identical blocks)"
        result.append((title, rows))
    return result


def _clip(s: str, width: int) -> str:
    return s if len(s) <= width else s[: width - 1] + "…"
