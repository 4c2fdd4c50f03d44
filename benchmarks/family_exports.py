"""The coverage survey's families exported and run on real ranks: each rank builds,
plans and exports its share of the families (``benchmarks.coverage``), then every rank
runs every export of the lot (``benchmarks.export_check``). ``tests/test_export.py``
runs the survey's representative families through it."""

from __future__ import annotations

from pathlib import Path

import torch

from . import coverage
from .export_check import TP, compare, crash_outcome, head, prepare, rank_step


def prepare_family(family: str, folder: Path) -> dict:
    """Build a survey family tiny (``benchmarks.coverage``), plan it at ``TP`` and
    ``prepare`` both exports: ``{"export": {target: outcome}, "modules": [...]}`` (the
    model's module names), or ``{"not_planned": why}``."""
    import shardplan

    task, class_name = coverage.families()[family]
    inputs = coverage.example_inputs(task)
    try:
        model = coverage.build(family, class_name)
        plan = shardplan.plan(model, TP, example_inputs=inputs)
    except Exception as e:  # noqa: BLE001 - the survey's "not built" / "refused": nothing to export
        return {"not_planned": f"{type(e).__name__}: {head(e)}"}
    return {"export": prepare(model, plan, inputs, folder, class_name),
            "modules": [n for n, _ in model.named_modules()]}


def _rank_families(ctx, families: list, tmp: str) -> dict:
    """On each rank: prepare every ``world_size``-th family from ``rank`` on, then run
    every export of each family."""
    import torch.distributed as dist

    out = {f: {"prepared": prepare_family(f, Path(tmp) / f)} for f in families[ctx.rank::ctx.world_size]}
    dist.barrier()  # every folder is written
    for family in families:
        folder = Path(tmp) / family
        if not (folder / "export.pt").exists():
            continue
        runs = out.setdefault(family, {}).setdefault("runs", {})
        for target in torch.load(folder / "export.pt", weights_only=False)["exported"]:
            try:
                runs[target] = rank_step(ctx, str(folder), target)
            except Exception as e:  # noqa: BLE001 - the runtime failed on this rank: an export bug
                runs[target] = crash_outcome(e)
    return out


def run_families(families: list[str], tmp: Path, ranks, per_rank: int = 2) -> dict:
    """``{family: {target: outcome, "modules": [...]} | {"not_planned": why}}`` for survey
    families, on the ``TP`` real gloo ranks of ``ranks``, ``per_rank`` families per rank at
    a time: each rank builds, plans and exports its share (``prepare_family``), then every
    rank runs every export of the lot. ``modules`` are the model's module names (what a
    refusal may name)."""
    out = {}
    size = ranks.world_size * per_rank
    for i in range(0, len(families), size):
        lot = families[i:i + size]
        results = ranks.run(_rank_families, lot, str(tmp))
        for family in lot:
            prepared = next(r[family]["prepared"] for r in results if "prepared" in r.get(family, {}))
            if "not_planned" in prepared:
                out[family] = prepared
                continue
            outcome = dict(prepared["export"], modules=prepared["modules"])
            folder = Path(tmp) / family
            if (folder / "export.pt").exists():
                saved = torch.load(folder / "export.pt", weights_only=False)
                for target in saved["exported"]:
                    got = [r[family]["runs"][target] for r in results]
                    crash = next((g for g in got if isinstance(g, str)), None)
                    outcome[target] = crash or compare(saved, target, got)
            out[family] = outcome
    return out
