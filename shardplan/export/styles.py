"""A plan's decisions as module styles: the mapping from the plan alone.

``analyse(plan, target)`` gives every module the plan splits the style it exports as
(``ExportModule.style``), and every ``ExportIssue`` found on the way: what no style of the
target spells (fatal) and what exports with a difference (notes). It reads the plan, and,
with ``model`` given, the model's module tree (types, children, tied owners); it never runs
the model's code: ``check`` does. The styles:

==========================  ==================================================
shardplan decision          style (``ExportModule.style``)
==========================  ==================================================
column, weight ``S(0)``     ``column``; ``column_gather`` where the plan gathers
                            the output (an LM head)
row, weight ``S(1)``        ``row``
vocab_embedding             ``embedding``
two equal blocks            ``packed_column`` / ``packed_row`` (Hugging Face only)
``S(0|a+a)``
3-D expert weights          ``experts``, a style per parameter (Hugging Face only)
replicated / no decision    (no entry: the module stays as it is)
==========================  ==================================================

The export check adds ``column_gather`` for a column layer whose output reaches a graph
output unchanged, and ``grad_allreduce`` for a module whose replicated parameters have a
partial gradient (Hugging Face only). What is fatal and what is a note: the package's docstring.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch.nn as nn

from ..errors import LayoutError
from ..layouts import Placement, Replicate, Shard
from ..planner.transitions import Purpose

@dataclass(frozen=True)
class ExportIssue:
    """One module's layout that does not export (``fatal``), or exports with a difference."""

    module: str
    layout: str
    reason: str
    fatal: bool = True

    def __str__(self) -> str:
        return f"{self.module or '(model)'} [{self.layout}]: {self.reason}"


@dataclass
class ExportModule:
    """A module the plan splits, and the style it exports as (``None``: none)."""

    path: str
    roles: set
    params: dict  # attribute name -> ParamEntry (own or tied alias)
    gathered: bool = False
    style: str | None = None  # column | column_gather | row | embedding | packed_column | packed_row
    #                           | experts | grad_allreduce
    param_styles: dict = field(default_factory=dict)  # experts: parameter name -> HF style


def owner_of(name: str) -> tuple[str, str]:
    """A parameter's dotted name as (its module's path, its attribute)."""
    mod, _, attr = name.rpartition(".")
    return mod, attr


def analyse(plan, target: str, model=None) -> tuple[OrderedDict, list[ExportIssue]]:
    """Per module: the style it exports as, and every issue found."""
    issues: list[ExportIssue] = []
    mods: OrderedDict[str, ExportModule] = OrderedDict()
    params_of: dict[str, dict] = {}
    for p in plan.params:
        for name in [p.name, *p.aliases]:
            mod, attr = owner_of(name)
            params_of.setdefault(mod, {})[attr] = p
    for d in plan.decisions:
        if d.role in ("replicated", "local"):  # local: sequence-parallel ops on tokens
            continue
        if d.role == "vocab_loss":
            issues.append(ExportIssue(d.module, d.layout, "vocab-parallel cross-entropy is not a module "
                                      "style: the exported model computes the loss on gathered logits "
                                      "(same values, more communication)", fatal=False))
            continue
        m = mods.setdefault(d.module, ExportModule(d.module, set(), params_of.get(d.module, {})))
        m.roles.add(d.role)
    for c in plan.collectives:
        if c.purpose == Purpose.GATHER_OUTPUT and c.module in mods:
            mods[c.module].gathered = True
        if c.purpose == Purpose.GATHER:  # the planner's gather move, inside the model's own code
            issues.append(ExportIssue(c.module or "(model)", "S", "a split activation all-gathered "
                                      f"for an op with no distributed form at {c.source or c.node}: "
                                      "no module style spells it, and the model's own op would "
                                      "run on this rank's part only"))
    if target == "dtensor" and getattr(plan, "sequence_parallel", False):
        for c in plan.collectives:
            if c.purpose in _SP_SPELLED or not str(c.purpose).startswith("seq_") or \
                    any(i.module == c.module and i.fatal for i in issues):
                continue
            if model is not None and _in_model_code(model, c.module):
                # an op of the model's own code between modules, on the DTensor Shard(1)
                # residual stream the export keeps: DTensor's sharding propagation gathers it
                issues.append(ExportIssue(c.module or "(model)", "S(1)", f"sequence-parallel {c.purpose} at "
                                          f"{c.source or c.node}: no style; DTensor's own op rule "
                                          "redistributes the Shard(1) tensor there", fatal=False))
                continue
            issues.append(ExportIssue(c.module or "(model)", "S(1)", f"sequence-parallel {c.purpose} "
                                      f"({c.kind}) at {c.source or c.node}: no DTensor style spells it"))

    for m in mods.values():
        weight = m.params.get("weight")
        wlay = Placement.parse(weight.layout) if weight else None
        lay_text = weight.layout if weight else "-"
        if _experts(m):
            _experts_style(m, target, issues)
            continue
        if len(m.roles) > 1:
            issues.append(ExportIssue(m.path, lay_text, f"planned with several roles ({', '.join(sorted(m.roles))}): "
                                      "a module style gives one"))
            continue
        role = next(iter(m.roles))
        if role == "partial":
            issues.append(ExportIssue(m.path, "P", "a partial sum from contracting a split activation with "
                                      "another activation: no module style places it"))
            continue
        if role == "distributed_reduce":
            at = next((d.source for d in plan.decisions if d.module == m.path and d.role == role), None)
            issues.append(ExportIssue(m.path, "P", "a reduction over the split dim run distributed (its "
                                      "small result all-reduced)" + (f" at {at}" if at else "") +
                                      ": no module style spells it, and the model's own code would "
                                      "reduce this rank's part only"))
            continue
        if weight is None or not isinstance(wlay, Shard):
            issues.append(ExportIssue(m.path, lay_text, f"{role} decision without a split 'weight' "
                                      "parameter of its own (a functional op on a parent's parameter?)"))
            continue
        ndim = len(weight.global_shape)
        dim = wlay.dim + ndim if wlay.dim < 0 else wlay.dim
        if wlay.replicas != 1:
            issues.append(ExportIssue(m.path, lay_text, f"each part is held by a group of {wlay.replicas} "
                                      "ranks (fewer heads than tp): not expressible on a 1-D mesh"))
            continue
        want = {"column": 0, "row": 1, "vocab_embedding": 0}.get(role)
        if want is None:
            issues.append(ExportIssue(m.path, lay_text, f"role {role!r} has no export"))
            continue
        if ndim != 2 or dim != want:
            issues.append(ExportIssue(m.path, lay_text, f"{role} weight split on dim {dim} of a {ndim}-D weight: "
                                      "the styles expect nn.Linear's (out, in) / nn.Embedding's (rows, dim) "
                                      "(an HF Conv1D stores (in, out))"))
            continue
        if wlay.blocks:
            packable = target == "hf" and len(wlay.blocks) == 2 and wlay.blocks[0] == wlay.blocks[1] \
                and role in ("column", "row")
            if not packable:
                where = ("DTensor's styles shard a weight in one piece" if target == "dtensor" else
                         "Hugging Face's packed styles express two equal blocks only")
                issues.append(ExportIssue(m.path, lay_text, f"blocked shard (each rank holds its slice of "
                                          f"blocks {'+'.join(map(str, wlay.blocks))}): {where}"))
                continue
            m.style = "packed_column" if role == "column" else "packed_row"
        elif role == "column":
            m.style = "column_gather" if m.gathered else "column"
        elif role == "row":
            m.style = "row"
        else:
            m.style = "embedding"
        if wlay.padded:
            issues.append(ExportIssue(m.path, lay_text, "padded vocabulary: exported as an uneven shard "
                                      "(same values; rank-local shapes differ from shardplan's)", fatal=False))
        for attr, p in m.params.items():
            if attr == "weight":
                continue
            blay = Placement.parse(p.layout)
            ok = attr == "bias" and (
                (role == "row" and isinstance(blay, Replicate))
                or (role == "column" and isinstance(blay, Shard) and (blay.blocks or None) == (wlay.blocks or None)))
            if not ok:
                m.style = None
                issues.append(ExportIssue(m.path, p.layout, f"parameter {attr!r} with layout {p.layout} "
                                          f"beside a {role} weight: the style would place it differently"))
        if model is not None and m.style:
            _check_module_type(model, m, issues)
    _tied_owners(plan, mods, params_of, model, issues)

    order: dict[str, int] = {}
    for p in plan.params:
        for n in [p.name, *p.aliases]:
            order.setdefault(owner_of(n)[0], len(order))
    mods = OrderedDict(sorted(mods.items(), key=lambda kv: order.get(kv[0], len(order))))
    exported = {m.path for m in mods.values() if m.style}
    for p in plan.params:
        lay = Placement.parse(p.layout)
        if isinstance(lay, Replicate):
            continue
        owners = [owner_of(n)[0] for n in [p.name, *p.aliases]]
        if not any(o in exported for o in owners) and not any(i.module in owners for i in issues):
            issues.append(ExportIssue(owners[0], p.layout, f"parameter {p.name} is split but no exported "
                                      "module owns it"))
    return mods, issues


def _tied_owners(plan, mods, params_of, model, issues: list) -> None:
    """Every module holding a split tied weight gets the style of the one that reads it (BART's
    ``shared`` embedding, never called, beside its encoder's and decoder's ``embed_tokens``):
    both runtimes tie the weights again after placing them, and a tie to a module left whole
    mixes a plain tensor with a DTensor. An owner of another type (BERT's decoder bias, also
    held by its prediction head) has no style to give: refused."""
    for p in plan.params:
        names = [p.name, *p.aliases]
        if not p.aliases or p.layout == "R":
            continue
        owners = list(dict.fromkeys(owner_of(n)[0] for n in names))
        styled = [o for o in owners if o in mods and mods[o].style]
        if not styled:
            continue
        lead = mods[styled[0]]
        for o in owners:
            if o in styled:
                continue
            if model is not None and type(model.get_submodule(o)) is type(model.get_submodule(lead.path)):
                mods[o] = ExportModule(o, set(lead.roles), params_of.get(o, {}), style=lead.style)
                continue
            issues.append(ExportIssue(o, p.layout, f"tied to {lead.path}'s split {owner_of(p.name)[1]} "
                                      f"({', '.join(names)}), but no style places it here: the "
                                      "runtime ties them again after placing them, mixing a plain "
                                      "tensor with a DTensor"))


def _experts(m: ExportModule) -> bool:
    """HF's fused experts: column and row GEMMs on 3-D (expert, out, in) parameters."""
    split = [p for p in m.params.values() if p.layout != "R"]
    return bool(split) and m.roles <= {"column", "row"} and all(len(p.global_shape) == 3 for p in split)


# a 3-D expert weight's split -> HF's parameter style: (expert, out, in) split on out (gate | up
# as two equal blocks: packed) or on in
_EXPERT_STYLE = {(1, False): "colwise", (1, True): "packed_colwise", (2, False): "rowwise"}


def _experts_style(m: ExportModule, target: str, issues: list) -> None:
    """HF spells an experts module as ``moe_tp_experts`` (its input and routing weights'
    gradients summed, its partial output all-reduced) with a style per 3-D parameter."""
    if target == "dtensor":
        issues.append(ExportIssue(m.path, ", ".join(p.layout for p in m.params.values()),
                                  "experts' 3-D weights: DTensor's styles shard nn.Linear / nn.Embedding "
                                  "only (Hugging Face's tp_plan spells it: moe_tp_experts)"))
        return
    styles = {}
    for attr, p in m.params.items():
        lay = Placement.parse(p.layout)
        blocks_: tuple[int, ...] = getattr(lay, "blocks", None) or ()
        packed = len(blocks_) == 2 and blocks_[0] == blocks_[1]
        style = _EXPERT_STYLE.get((lay.dim % 3, packed)) if isinstance(lay, Shard) and lay.replicas == 1 \
            and len(p.global_shape) == 3 and not lay.padded and (packed or not blocks_) else None
        if style is None:
            issues.append(ExportIssue(m.path, p.layout, f"expert parameter {attr!r} [{p.layout}]: no Hugging "
                                      "Face style places it (a replicated one would be added on every "
                                      "rank before the all-reduce)"))
            return
        styles[attr] = style
    m.style, m.param_styles = "experts", styles


def _check_module_type(model, m: ExportModule, issues: list) -> None:
    try:
        mod = model.get_submodule(m.path)
    except AttributeError:
        issues.append(ExportIssue(m.path, "-", "no such module in the model"))
        m.style = None
        return
    want = nn.Embedding if m.style == "embedding" else nn.Linear
    if not isinstance(mod, want):
        issues.append(ExportIssue(m.path, m.params["weight"].layout,
                                  f"{type(mod).__name__} is not an nn.{want.__name__}: the style cannot "
                                  "shard it"))
        m.style = None


# sequence-parallel collectives the DTensor styles spell: the embedding's / a row layer's
# reduce-scatter (output_layouts=Shard(1)), a column layer's all-gather of its tokens
# (input_layouts=Shard(1)) with its backward re-gather, the replicated norm weights' grad all-reduce
# (one per weight in DTensor, one per block in shardplan's bucket)
_SP_SPELLED = {Purpose.SEQ_SCATTER, Purpose.SEQ_GATHER, Purpose.SEQ_REGATHER, Purpose.SEQ_GRAD,
               Purpose.SEQ_GRAD_BUCKET}


def _in_model_code(model, path: str) -> bool:
    """Whether ``path`` names a module with children (its own code runs between styled modules)."""
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        return False
    return any(True for _ in mod.children())


def need_model(model) -> None:
    """An export reads the model's own code: refuse one without the model."""
    if model is None:
        raise TypeError("an export needs the model (model=...): whether the target runtime computes the "
                        "plan right depends on the model's own code, which is checked")


def raise_fatal(issues: list[ExportIssue], target: str) -> None:
    """``LayoutError`` naming every fatal issue, if there is one."""
    fatal = [i for i in issues if i.fatal]
    if not fatal:
        return
    name = "DTensor parallel styles" if target == "dtensor" else "Hugging Face tp_plan strings"
    raise LayoutError(
        f"{len(fatal)} layout{'s' if len(fatal) != 1 else ''} of the plan cannot be expressed as {name}:\n"
        + "\n".join(f"    {i}" for i in fatal),
        where=", ".join(dict.fromkeys(i.module or "(model)" for i in fatal)),
        fix="run the model with shardplan.parallelize() instead, or change the model: plain nn.Linear / "
            "nn.Embedding layers with unfused weights (separate q/k/v projections), and sizes of the "
            "split dim read from the tensor or written -1 (view(B, T, -1, head_dim)), not a head count")
