"""Exported plans run in their target runtimes, against the unsharded model.

The coverage survey and ``tests/test_export.py`` share this. For one family,
``prepare`` exports the plan both ways (``to_hf_tp_plan``, ``to_dtensor_plan``,
one ``ModelCode`` capture of the model's code for both); where either exports,
it writes the model with ``save_pretrained`` and, beside it, the exported plans
and the unsharded model's own results (logits; loss and every gradient of one
backward). ``run_all`` then executes every prepared export on one pool of 2
real gloo ranks (one spawn for all families and both runtimes);
``family_exports.run_families`` does all of it on the pool, each rank building, planning and
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


def head(text: str, n: int = 200) -> str:
    text = " ".join(str(text).split())
    return text[:n] + ("..." if len(text) > n else "")


def refusal(e: Exception) -> str:
    """A LayoutError's first problem line (the module, layout and reason)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return head(lines[1] if len(lines) > 1 else lines[0], 320)  # to the source line


def prepare(model, plan, inputs: dict, folder: Path, class_name: str,
            targets=TARGETS) -> dict:
    """Export ``plan`` for each target; where one exports, save what the ranks need in ``folder``.

    Returns ``{target: "refused: ..." | "crash: ..." | "exported"}``.
    """
    from shardplan.errors import LayoutError
    from shardplan.export import ModelCode, to_dtensor_plan, to_hf_tp_plan

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
            outcome[target] = f"crash: {type(e).__name__}: {head(e)}"
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


def rank_step(ctx, folder: str, target: str) -> dict:
    """On each rank: run one export of ``folder`` in its runtime."""
    import warnings

    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from shardplan.export import tie_again

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
                    f"{head(', '.join(missing), 80) or '-'}; also split: {head(', '.join(extra), 80) or '-'})")
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
                    results = pool.run(rank_step, str(folder), target)
                except Exception as e:  # noqa: BLE001 - the runtime failed: an export bug
                    out[(family, target)] = crash_outcome(e)
                    continue
                out[(family, target)] = compare(saved, target, results)
    finally:
        if ranks is None:
            pool.close()
    return out


def crash_outcome(e: Exception) -> str:
    return f"crash: {type(e).__name__}: {head(str(e).splitlines()[0] if str(e) else e)}"
