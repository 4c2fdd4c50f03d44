"""Exported plans run in their target runtimes, against the unsharded model.

The coverage survey and ``tests/test_export.py`` share this. For one family,
``prepare`` exports the plan both ways (``to_hf_tp_plan``, ``to_dtensor_plan``,
one ``ModelCode`` capture of the model's code for both); where either exports,
it writes the model with ``save_pretrained`` and, beside it, the exported plans
and the unsharded model's own results (logits; loss and every gradient of one
backward). ``run_all`` then executes every prepared export on one pool of 2
real gloo ranks (one spawn for all families and both runtimes);
``run_families`` does all of it on the pool, each rank building, planning and
exporting every other family, a few at a time:

- HF: ``from_pretrained(folder, distributed_config=DistributedConfig(tp_plan=plan,
  tp_size=2))``, logits under ``no_grad`` (HF's
  inference kernels), then a forward with labels and a backward (its DTensor path);
- DTensor: the unpatched model loaded from the folder, ``parallelize_module``
  with the exported styles, a forward with labels and a backward;

and compares every rank's logits, loss and gradients with the unsharded model's, and checks that the runtime split exactly the parameters the
plan splits (a plan that silently ran replicated is not an export). Outcomes:
``runs equal``, ``refused: <LayoutError>``, ``WRONG: <what differs>``,
``crash: <error>`` (the last two are export bugs).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

TP = 2
TARGETS = ("hf", "dtensor")
ATOL, RTOL = 2e-5, 1e-4


def _head(text: str, n: int = 200) -> str:
    text = " ".join(str(text).split())
    return text[:n] + ("..." if len(text) > n else "")


def refusal(e: Exception) -> str:
    """A LayoutError's first problem line (the module, layout and reason)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return _head(lines[1] if len(lines) > 1 else lines[0], 320)  # to the source line


def prepare(model, plan, inputs: dict, folder: Path, class_name: str,
            targets=TARGETS) -> dict:
    """Export ``plan`` for each target; where one exports, save what the ranks need in ``folder``.

    Returns ``{target: "refused: ..." | "crash: ..." | "exported"}``.
    """
    from shardplan.errors import LayoutError
    from shardplan.report.export import ModelCode, to_dtensor_plan, to_hf_tp_plan

    outcome, exported = {}, {}
    code = ModelCode(model, inputs)  # the model's code captured once for both targets
    for target in targets:
        fn = to_hf_tp_plan if target == "hf" else to_dtensor_plan
        try:
            exported[target] = fn(plan, model=model, example_inputs=inputs, code=code)
            outcome[target] = "exported"
        except LayoutError as e:
            outcome[target] = "refused: " + refusal(e)
        except Exception as e:  # noqa: BLE001 - an exporter crash is a bug, recorded
            outcome[target] = f"crash: {type(e).__name__}: {_head(e)}"
    if exported:
        folder = Path(folder)
        # under a process group transformers writes on rank 0 only; this unsharded model is
        # whole on the rank that prepared it
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
        try:
            model.save_pretrained(folder)
        finally:
            del model.should_save_on_this_rank
        split = sorted(n for p in plan.params if p.layout != "R" for n in [p.name, *p.aliases])
        torch.save({"class": class_name, "inputs": inputs, "plan": plan, "exported": exported,
                    "split": split, "reference": reference(model, inputs)}, folder / "export.pt")
    return outcome


def reference(model, inputs: dict) -> dict:
    """The unsharded model's logits (no grad) and one forward/backward's loss and gradients."""
    with torch.no_grad():
        logits = model(**_without_labels(inputs)).logits
    m = copy.deepcopy(model)
    out = m(**inputs)
    out.loss.backward()
    return {"logits": logits, "loss": out.loss.detach(), "train_logits": out.logits.detach(),
            "grads": {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}}


def _without_labels(inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if k != "labels"}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _split_params(model) -> dict:
    """Parameter name -> (local, global) shape, for those the runtime split."""
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        local = p.to_local().shape if hasattr(p, "to_local") else p.shape
        if tuple(local) != tuple(p.shape):
            out[n] = (tuple(local), tuple(p.shape))
    return out


def _rank_step(ctx, folder: str, target: str) -> dict:
    """On each rank: run one export of ``folder`` in its runtime."""
    import warnings

    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from shardplan.report.export import tie_again

    warnings.filterwarnings("ignore")
    saved = torch.load(Path(folder) / "export.pt", weights_only=False)
    cls = getattr(transformers, saved["class"])
    inputs = saved["inputs"]
    result = {}
    if target == "hf":
        config = transformers.DistributedConfig(tp_plan=saved["exported"]["hf"], tp_size=ctx.world_size)
        m = cls.from_pretrained(folder, distributed_config=config, attn_implementation="eager").eval()
        with torch.no_grad():  # HF's inference path: local kernels
            result["logits"] = _full(m(**_without_labels(inputs)).logits).detach()
    else:
        m = cls.from_pretrained(folder, attn_implementation="eager").eval()
        parallelize_module(m, init_device_mesh("cpu", (ctx.world_size,)), saved["exported"]["dtensor"])
        tie_again(m, saved["plan"])
    out = m(**inputs)
    out.loss.backward()
    grads = {n: _full(p.grad).detach() for n, p in m.named_parameters() if p.grad is not None}
    return {**result, "train_logits": _full(out.logits).detach(), "loss": _full(out.loss).detach(),
            "grads": grads, "split": _split_params(m)}


def compare(saved: dict, target: str, results: list) -> str:
    """``runs equal`` or ``WRONG: ...``: every rank against the unsharded model, and the
    parameters the runtime split against those the plan splits."""
    ref = saved["reference"]
    want_split = set(saved["split"])
    for rank, got in enumerate(results):
        split = set(got["split"])
        if split != want_split:
            missing, extra = sorted(want_split - split), sorted(split - want_split)
            return (f"WRONG: rank {rank} split other parameters than the plan (not split: "
                    f"{_head(', '.join(missing), 80) or '-'}; also split: {_head(', '.join(extra), 80) or '-'})")
        pairs = [("logits", got["logits"], ref["logits"])] if "logits" in got else []
        pairs += [("logits (training)", got["train_logits"], ref["train_logits"]),
                  ("loss", got["loss"], ref["loss"])]
        if set(got["grads"]) != set(ref["grads"]):
            return f"WRONG: rank {rank} gradients for other parameters than the unsharded model's"
        pairs += [(f"grad {n}", got["grads"][n], g) for n, g in ref["grads"].items()]
        for what, g, w in pairs:
            if g.shape != w.shape:
                return f"WRONG: rank {rank} {what} shape {list(g.shape)}, unsharded {list(w.shape)}"
            if not torch.allclose(g.float(), w.float(), atol=ATOL, rtol=RTOL):
                diff = (g.float() - w.float()).abs().max().item()
                return f"WRONG: rank {rank} {what} differs by {diff:.1e}"
    return "runs equal"


def run_all(prepared: dict, ranks=None, timeout: float = 120.0) -> dict:
    """``{(family, target): outcome}`` for every exported target of ``prepared``
    (``{family: folder}``), all on one pool of ``TP`` real gloo ranks (``ranks``, or a new
    ``RealRanks`` closed at the end)."""
    from shardplan.ranks import RealRanks

    pool = ranks or RealRanks(TP, timeout=timeout)
    out = {}
    try:
        for family, folder in prepared.items():
            saved = torch.load(Path(folder) / "export.pt", weights_only=False)
            for target in saved["exported"]:
                try:
                    results = pool.run(_rank_step, str(folder), target)
                except Exception as e:  # noqa: BLE001 - the runtime failed: an export bug
                    out[(family, target)] = _crash(e)
                    continue
                out[(family, target)] = compare(saved, target, results)
    finally:
        if ranks is None:
            pool.close()
    return out


def _crash(e: Exception) -> str:
    return f"crash: {type(e).__name__}: {_head(str(e).splitlines()[0] if str(e) else e)}"


def prepare_family(family: str, folder: Path) -> dict:
    """Build a survey family tiny (``benchmarks.coverage``), plan it at ``TP`` and
    ``prepare`` both exports: ``{"export": {target: outcome}, "modules": [...]}`` (the
    model's module names), or ``{"not_planned": why}``."""
    import shardplan

    from . import coverage

    task, class_name = coverage.families()[family]
    inputs = coverage.example_inputs(task)
    try:
        model = coverage.build(family, class_name)
        plan = shardplan.plan(model, TP, example_inputs=inputs)
    except Exception as e:  # noqa: BLE001 - the survey's "not built" / "refused": nothing to export
        return {"not_planned": f"{type(e).__name__}: {_head(e)}"}
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
                runs[target] = _rank_step(ctx, str(folder), target)
            except Exception as e:  # noqa: BLE001 - the runtime failed on this rank: an export bug
                runs[target] = _crash(e)
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
