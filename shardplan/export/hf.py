"""A plan as Hugging Face ``tp_plan`` strings.

``to_hf_tp_plan(plan)`` gives the styles ``styles.analyse`` settles as Hugging Face's
strings ("colwise", "rowwise", "embedding_rowwise", "colwise_gather_output",
"packed_colwise", "packed_rowwise"), keyed by module paths with ``*`` for the index of
identical blocks ("model.layers.*.self_attn.q_proj"), and spells two things DTensor's
styles cannot: HF's fused experts (``moe_tp_experts`` on the module, a style per 3-D
parameter) and a replicated parameter whose gradient is partial (a per-head q/k norm:
``replicated_with_grad_allreduce``). Keys of the model's own ``tp_plan`` that the plan
leaves whole are given as ``replicate`` (transformers merges a given plan into the
model's).
"""

from __future__ import annotations

from collections import OrderedDict

from ..planner import blocks
from .check import ModelCode, checked_styles
from .styles import owner_of


_HF_STYLE = {"column": "colwise", "column_gather": "colwise_gather_output", "row": "rowwise",
             "embedding": "embedding_rowwise", "packed_column": "packed_colwise",
             "packed_row": "packed_rowwise", "experts": "moe_tp_experts",
             "grad_allreduce": "replicated_with_grad_allreduce"}


def to_hf_tp_plan(plan, *, model, prefix: str | None = None, example_inputs=None,
                  code: ModelCode | None = None) -> dict[str, str]:
    """Hugging Face ``tp_plan`` strings keyed by module path, ``*`` for block indices.

    Keys are relative to the model the plan was made for (compare with an HF
    model's ``model.tp_plan``). ``prefix="model"`` keeps only modules under
    ``model.`` with that prefix removed (compare with ``config.base_model_tp_plan``).
    A pattern is used only where every block of the list gets the same string;
    otherwise each block is listed by its index.

    transformers merges a given plan into the model's own ``tp_plan``: every key of
    the model's plan that this one does not style is given as ``"replicate"``, so the
    plan loaded is exactly this one.

    HF's styles hand the model's own code local tensors and adapt nothing else
    (no head count is divided, a ``-1`` in a view is what adapts): ``model`` is
    captured on fake tensors as HF would run it, and the export is refused
    (``LayoutError`` naming the module and source line) where a size would come
    out wrong, e.g. OPT's ``view(bsz, -1, self.num_heads, self.head_dim)``. ``code``:
    a ``ModelCode`` of ``model`` shared with the other export.
    """
    mods = checked_styles(plan, "hf", model, example_inputs=example_inputs, code=code)
    styles = {}
    for m in mods.values():
        if m.style:
            styles[m.path] = _HF_STYLE[m.style]
        styles.update((f"{m.path}.{attr}", style) for attr, style in m.param_styles.items())
    # every module and parameter path the plan knows, to check a pattern covers all blocks alike
    known: set[str] = set()
    for p in plan.params:
        for n in [p.name, *p.aliases]:
            known.add(n)
            mod = owner_of(n)[0]
            while mod:
                known.add(mod)
                mod = mod.rpartition(".")[0]
    known |= {d.module for d in plan.decisions}
    by_pattern: OrderedDict = OrderedDict()
    for path in styles:
        by_pattern.setdefault(blocks.pattern(path), []).append(path)
    out: dict[str, str] = {}
    for pattern, paths in by_pattern.items():
        instances = blocks.instances(pattern, known)
        values = {styles.get(k) for k in instances}
        if pattern != paths[0] and len(values) == 1 and len(instances) > 1:
            out[pattern] = styles[paths[0]]
        else:
            out.update((p, styles[p]) for p in paths)
    # transformers merges a given tp_plan into the model's own: what ours leaves whole stays so
    out.update((k, "replicate") for k in (getattr(model, "tp_plan", None) or {}) if k not in out)
    if prefix:
        head = prefix.rstrip(".") + "."
        out = {k[len(head):]: v for k, v in out.items() if k.startswith(head)}
    return out
