"""A plan in other tools' words: DTensor parallel styles and Hugging Face tp_plan strings.

``to_dtensor_plan(plan)`` maps module FQNs to ``torch.distributed.tensor.parallel``
styles for ``parallelize_module(model, mesh, styles)``:

==========================  ==================================================
shardplan decision          DTensor style
==========================  ==================================================
column, weight ``S(0)``     ``ColwiseParallel(use_local_output=local_output)``
column whose output the     ``ColwiseParallel(output_layouts=DReplicate())``
plan gathers (an LM head)
row, weight ``S(1)``        ``RowwiseParallel()``
vocab_embedding             ``RowwiseParallel(input_layouts=Replicate())``
replicated / no decision    (no entry: the module stays as it is)
==========================  ==================================================

A sequence-parallel plan (``Plan.sequence_parallel``) exports torchtitan's layout:
the embedding ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``,
row layers that reduce-scatter ``RowwiseParallel(output_layouts=Shard(1))``, column
layers ``ColwiseParallel(input_layouts=Shard(1))`` (they all-gather their tokens) and
``SequenceParallel()`` for the leaf modules run on tokens (norms, dropout). The
residual stream stays a DTensor ``Shard(1)`` between modules, so the model's code
reads the global sequence length from it. A ``seq_unshard`` fallback inside a leaf
module raises ``LayoutError``; one in the model's own code between modules is a note
(DTensor's op rule redistributes there, e.g. HF's ``logits_to_keep`` slice).

``to_hf_tp_plan(plan)`` gives the same as Hugging Face ``tp_plan`` strings
("colwise", "rowwise", "embedding_rowwise", "colwise_gather_output",
"packed_colwise", "packed_rowwise"), keyed by module paths with ``*`` for the
index of identical blocks ("model.layers.*.self_attn.q_proj"), and spells two
things DTensor's styles cannot: HF's fused experts (``moe_tp_experts`` on the
module, a style per 3-D parameter) and a replicated parameter whose gradient is
partial (a per-head q/k norm: ``replicated_with_grad_allreduce``). Keys of the
model's own ``tp_plan`` that the plan leaves whole are given as ``replicate``
(transformers merges a given plan into the model's).

An export is a promise that the target runtime runs the model's own, unchanged
code right: both functions need the model, capture it as the runtime
would run it (column layers hand it local tensors, nothing else adapts) and
refuse, naming module and source line, where a size would come out wrong (a
view by ``self.num_heads``, mixed layouts in one attention).

What cannot be exported raises ``LayoutError`` naming every such module;
``export_issues(plan, target)`` lists the problems (and the notes: what is
exported but communicates differently) without raising:

- blocked shards ``S(0|a+b+c)`` (a fused QKV: each rank holds its slice of
  every block). DTensor's public styles shard a weight in one piece; Hugging
  Face's ``packed_colwise`` / ``packed_rowwise`` express exactly two equal
  blocks (fused gate/up), so those export there, other blocks nowhere;
- shards held by groups of ranks ``S(d|xR)`` (fewer KV heads than tp);
- ``partial`` decisions (a contraction of a split activation with another
  activation, not a parameter): no module style places that;
- a module planned with two different roles (called twice);
- split weights stored (in, out) (HF ``Conv1D``): the styles handle
  ``nn.Linear`` / ``nn.Embedding`` only;
- a split parameter that no exported module owns (used functionally by a
  parent module, or not named ``weight`` / ``bias``);
- with ``model=`` given: a split module that is not an ``nn.Linear`` /
  ``nn.Embedding``; a split tied weight also held by a module with no style;
  a styled module's output the model's code writes in place (the runtimes hand
  it a view of a DTensor's local tensor, which autograd refuses to modify).

Notes (exported, not fatal): a padded vocabulary ``S(0|padN)`` becomes an
uneven DTensor shard (same values, rank-local shapes differ from shardplan's);
a vocab-parallel loss is not a module style, so the exported model computes
the loss on gathered logits (more communication, same values); tied weights
must be tied again after ``parallelize_module`` (``parallelize_with_dtensor``
does it).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..errors import LayoutError
from ..layouts import Placement, Replicate, Shard
from ..planner import blocks

__all__ = ["to_dtensor_plan", "to_hf_tp_plan", "export_issues", "ExportIssue", "ModelCode",
           "parallelize_with_dtensor", "tie_again"]


@dataclass(frozen=True)
class ExportIssue:
    module: str
    layout: str
    reason: str
    fatal: bool = True

    def __str__(self) -> str:
        return f"{self.module or '(model)'} [{self.layout}]: {self.reason}"


@dataclass
class _Module:
    path: str
    roles: set
    params: dict  # attribute name -> ParamEntry (own or tied alias)
    gathered: bool = False
    style: str | None = None  # column | column_gather | row | embedding | packed_column | packed_row
    #                           | experts | grad_allreduce
    param_styles: dict = field(default_factory=dict)  # experts: parameter name -> HF style


def _owner(name: str) -> tuple[str, str]:
    mod, _, attr = name.rpartition(".")
    return mod, attr


def _analyse(plan, target: str, model=None) -> tuple[OrderedDict, list[ExportIssue]]:
    """Per module: the style it exports as, and every issue found."""
    issues: list[ExportIssue] = []
    mods: OrderedDict[str, _Module] = OrderedDict()
    params_of: dict[str, dict] = {}
    for p in plan.params:
        for name in [p.name, *p.aliases]:
            mod, attr = _owner(name)
            params_of.setdefault(mod, {})[attr] = p
    for d in plan.decisions:
        if d.role in ("replicated", "local"):  # local: sequence-parallel ops on tokens
            continue
        if d.role == "vocab_loss":
            issues.append(ExportIssue(d.module, d.layout, "vocab-parallel cross-entropy is not a module "
                                      "style: the exported model computes the loss on gathered logits "
                                      "(same values, more communication)", fatal=False))
            continue
        m = mods.setdefault(d.module, _Module(d.module, set(), params_of.get(d.module, {})))
        m.roles.add(d.role)
    for c in plan.collectives:
        if c.purpose == "gather_output" and c.module in mods:
            mods[c.module].gathered = True
        if c.purpose == "gather":  # the planner's gather move, inside the model's own code
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

    order = {}
    for p in plan.params:
        for n in [p.name, *p.aliases]:
            order.setdefault(_owner(n)[0], len(order))
    mods = OrderedDict(sorted(mods.items(), key=lambda kv: order.get(kv[0], len(order))))
    exported = {m.path for m in mods.values() if m.style}
    for p in plan.params:
        lay = Placement.parse(p.layout)
        if isinstance(lay, Replicate):
            continue
        owners = [_owner(n)[0] for n in [p.name, *p.aliases]]
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
        owners = list(dict.fromkeys(_owner(n)[0] for n in names))
        styled = [o for o in owners if o in mods and mods[o].style]
        if not styled:
            continue
        lead = mods[styled[0]]
        for o in owners:
            if o in styled:
                continue
            if model is not None and type(model.get_submodule(o)) is type(model.get_submodule(lead.path)):
                mods[o] = _Module(o, set(lead.roles), params_of.get(o, {}), style=lead.style)
                continue
            issues.append(ExportIssue(o, p.layout, f"tied to {lead.path}'s split {_owner(p.name)[1]} "
                                      f"({', '.join(names)}), but no style places it here: the "
                                      "runtime ties them again after placing them, mixing a plain "
                                      "tensor with a DTensor"))


def _experts(m: _Module) -> bool:
    """HF's fused experts: column and row GEMMs on 3-D (expert, out, in) parameters."""
    split = [p for p in m.params.values() if p.layout != "R"]
    return bool(split) and m.roles <= {"column", "row"} and all(len(p.global_shape) == 3 for p in split)


# a 3-D expert weight's split -> HF's parameter style: (expert, out, in) split on out (gate | up
# as two equal blocks: packed) or on in
_EXPERT_STYLE = {(1, False): "colwise", (1, True): "packed_colwise", (2, False): "rowwise"}


def _experts_style(m: _Module, target: str, issues: list) -> None:
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
        blocks_ = getattr(lay, "blocks", None) or ()
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


def _check_module_type(model, m: _Module, issues: list) -> None:
    import torch.nn as nn
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
_SP_SPELLED = {"seq_scatter", "seq_gather", "seq_regather", "seq_grad", "seq_grad_bucket"}


def _in_model_code(model, path: str) -> bool:
    """Whether ``path`` names a module with children (its own code runs between styled modules)."""
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        return False
    return any(True for _ in mod.children())


def _sp_leaves(plan, model) -> list[str]:
    """Leaf modules (norms, dropout) the plan runs on this rank's tokens: ``SequenceParallel()``."""
    seen = dict.fromkeys(d.module for d in plan.decisions if getattr(d, "sequence", False) and d.module)
    out = []
    for path in seen:
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        if not any(True for _ in mod.children()):
            out.append(path)
    return out


# styles whose module hands the model's code a local slice of its output / takes one as input
# (experts run on their local weights, and their partial output is all-reduced)
_LOCAL_OUT = {"column", "packed_column"}
_LOCAL_IN = {"row", "packed_row", "experts"}


class ModelCode:
    """The model's own code as the runtimes run it, captured (on fake tensors, on the
    model's own device: a kernel's output strides differ between devices, and with them
    the ops a reshape becomes) once as it is, and once per set of local weight shapes the
    exported styles hand it.

    Both exports of one plan read the same captures: pass one ``ModelCode(model,
    example_inputs)`` as ``code=`` to ``to_hf_tp_plan`` and ``to_dtensor_plan`` (each
    makes its own otherwise). The capture as it is is the plan's own where the plan
    was made from this model and inputs of these shapes. The model must not change
    in between.
    """

    def __init__(self, model, example_inputs=None):
        self.model, self.example_inputs = model, example_inputs
        self._copy = self._whole = None
        self._truncate = True
        self._annotations: dict = {}
        self._cuts: dict = {}

    @property
    def clone(self):
        """A copy of the model whose weights the cut captures replace."""
        from ..planner.inputs import example_args

        if self._copy is None:
            self._copy = copy.deepcopy(self.model)
            self._args, self._kwargs = example_args(self._copy, self.example_inputs)
        return self._copy

    def whole(self, plan):
        """The capture as it is, annotated like ``plan`` (its baseline: a plan with a
        distributed reduction is refused before this is read)."""
        from ..planner.annotate import annotate
        from ..planner.capture import capture, planned_capture
        from ..planner.rules import load_rules

        model = self.clone
        if self._whole is None:
            planned = planned_capture(plan)  # (model ref, args, kwargs, Captured)
            if planned and planned[0]() is self.model and \
                    _same_shapes(planned[1:3], (self._args, self._kwargs)):
                self._whole, self._truncate = planned[3], bool(planned[3].truncated)
            else:
                self._whole = capture(model, self._args, self._kwargs, truncate=True)
        key = (plan.dims, plan.rules)
        if key not in self._annotations:
            self._annotations[key] = annotate(self._whole.gm, plan.dims, load_rules(plan.rules),
                                              distribute=False)
        return self._whole, self._annotations[key]

    def cut(self, shapes: dict):
        """The capture with each ``(module, parameter)`` of ``shapes`` at that local shape;
        the exception the model's code raises on them instead, if it does."""
        from ..planner.capture import capture

        key = tuple(sorted(shapes.items()))
        if key not in self._cuts:
            saved = []
            for (path, attr), local in shapes.items():
                owner = self.clone.get_submodule(path)
                old = getattr(owner, attr)
                saved.append((owner, attr, old))
                setattr(owner, attr, torch.nn.Parameter(torch.empty(local, dtype=old.dtype, device=old.device)))
            try:
                self._cuts[key] = capture(self.clone, self._args, self._kwargs, truncate=self._truncate)
            except Exception as e:  # noqa: BLE001 - the model's own code refused the local shapes
                self._cuts[key] = e
            finally:
                for owner, attr, param in reversed(saved):
                    setattr(owner, attr, param)
        return self._cuts[key]


def _same_shapes(a, b) -> bool:
    """Whether two ``(args, kwargs)`` hold the same structure, tensor shapes and dtypes, and
    other values."""
    from ..torch_compat import pytree

    (la, sa), (lb, sb) = pytree.tree_flatten(a), pytree.tree_flatten(b)
    key = lambda x: (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return sa == sb and all(type(x) is type(y) and key(x) == key(y) for x, y in zip(la, lb))


def _runtime_issues(plan, mods, code: ModelCode, target: str) -> list[ExportIssue]:
    """Where the model's own code goes wrong when the exported modules hand it local tensors
    (first settling which column layers export gathered, ``_gather_heads``, and which
    replicated parameters need their gradient summed, ``_grad_sums``).

    Both targets (HF's styles, DTensor's with ``use_local_output``) give the code
    between a column and a row layer this rank's slice, and change nothing else:
    no head count, no view size. So the model is captured twice (``ModelCode``):
    as it is, annotated like the plan, and with the styled layers'
    weights cut to their local shapes. Op by op, the second capture must make the
    plan's shard of each tensor (or the whole tensor: computed redundantly, still
    right); a size the model computes from a constant such as ``self.num_heads``
    shows up as the first op where it does not.
    """
    from ..layouts import Shard as _Shard
    from ..planner.capture import module_of, source_of
    from ..planner.graph import hint, shape
    from ..planner.kinds.permute import viewed_parameter
    from ..planner.shards import local_shape

    tp = plan.tp
    whole, ann = code.whole(plan)
    _gather_heads(ann, mods)
    problems = _grad_sums(ann, mods, code.clone, target) or _written_in_place(whole.gm, mods)
    if problems:
        return problems
    cut = code.cut({(m.path, attr): local_shape(tuple(p.global_shape), Placement.parse(p.layout), tp)
                    for m in mods.values() if m.style in _LOCAL_OUT | _LOCAL_IN
                    for attr, p in m.params.items()})
    if isinstance(cut, Exception):
        return _crash_issues(cut, whole.gm, ann, mods, tp)

    ops = [n for n in whole.gm.graph.nodes if n.op == "call_function"]
    local_ops = [n for n in cut.gm.graph.nodes if n.op == "call_function"]
    for a, b in zip(ops, local_ops):
        where = f"{source_of(a) or a.name}"
        if a.target != b.target:
            return [ExportIssue(module_of(a), "-", f"with local tensors the model's code takes another "
                                f"path at {where} ({b.target} instead of {a.target})")]
        full = shape(a)
        if full is None or shape(b) is None or viewed_parameter(a):  # a weight's view: cut by the style
            continue
        full = tuple(hint(d) for d in full)
        lay = ann.layouts.get(a)
        want = local_shape(full, lay, tp) if isinstance(lay, _Shard) else full
        got = tuple(hint(d) for d in shape(b))
        if got not in (want, full):
            return [ExportIssue(module_of(a), str(lay), f"the model's own code makes {list(got)} where "
                                f"this rank's part is {list(want)}, at {where}: a size the code "
                                "computes from a constant (a head count?) that the plan divides by tp")]
    return []


def _crash_issues(e: Exception, gm, ann, mods, tp: int) -> list[ExportIssue]:
    """Why the model's code fails on the local tensors: the sizes shardplan divides by tp
    that the code computes from a constant (on tensors the export leaves local), else the
    whole tensors the plan reads as this rank's part (T5's position bias: shardplan slices
    it, no style does)."""
    from ..planner.capture import module_of, source_of
    from ..planner.transitions import Purpose

    at = getattr(e, "source", None)
    crash = str(e).splitlines()[0] + (f" at {at}" if at else "")
    lines: dict[str, list[str]] = {}
    for line, module in _resized(gm, ann, tp, mods).items():
        lines.setdefault(blocks.pattern(module), []).append(line)
    if lines:
        return [ExportIssue(module, "-", "shardplan divides a size by tp here that the model's code "
                            f"computes from a constant ({'; '.join(found)}); on the local tensors these "
                            f"styles hand it, the model's code fails: {crash}")
                for module, found in lines.items()]
    split: dict[str, list[str]] = {}  # whole tensors the plan slices, by reading module
    for t in ann.transitions:
        if t.purpose is Purpose.SPLIT:
            for node, _ in t.consumers:
                made = f"made at {source_of(t.src) or t.src.name}, read at {source_of(node) or node.name}"
                split.setdefault(blocks.pattern(module_of(node)), []).append(made)
    if not split:
        return [ExportIssue(getattr(e, "where", None) or "(model)", "-", "the model's own code fails on "
                            f"the local tensors these styles hand it: {crash}")]
    return [ExportIssue(module, "R", "the plan reads a whole tensor as this rank's part here, keeping its "
                        f"slice ({'; '.join(dict.fromkeys(found))}); no style slices it, so the model's "
                        f"code meets the whole tensor beside its local ones and fails: {crash}")
            for module, found in split.items()]


def _gather_heads(ann, mods) -> None:
    """A column layer whose split output reaches a graph output or the vocab-parallel loss
    unchanged (an LM head) exports gathered: the model's own code (HF's loss function, its
    ``.float()``) then reads whole logits, as it does unsharded."""
    from ..planner.capture import module_of
    from ..planner.transitions import Purpose

    for t in ann.transitions:
        if t.purpose not in (Purpose.GATHER_OUTPUT, Purpose.VOCAB_LOSS):
            continue
        node = t.src
        while isinstance(node, type(t.src)) and isinstance(ann.layouts.get(node), Shard):
            m = mods.get(module_of(node))
            if m is not None and m.style == "column":
                m.style = "column_gather"
                break
            node = next((a for a in node.args if isinstance(a, type(t.src))), None)


def _grad_sums(ann, mods, model, target: str) -> list[ExportIssue]:
    """A replicated parameter read on this rank's part (a per-head q/k norm's weight) has a
    partial gradient: the plan's f all-reduces it. Hugging Face spells that on the owning
    module (``replicated_with_grad_allreduce``: every parameter of the module summed);
    DTensor's styles do not."""
    from ..planner.capture import source_of
    from ..planner.transitions import Purpose

    owners: dict[str, set] = {}
    where: dict[str, str] = {}
    for t in ann.transitions:
        if t.purpose is not Purpose.F:
            continue
        for param in _parameters_only(t.src):  # the weight, a view of it, Gemma's 1 + weight
            mod, attr = _owner(str(param.target))
            if attr not in dict(model.get_submodule(mod).named_parameters(recurse=False)):
                continue  # a buffer: no gradient
            owners.setdefault(mod, set()).add(attr)
            where.setdefault(mod, source_of(t.consumers[0][0]) or t.consumers[0][0].name)
    issues = []
    for mod, attrs in owners.items():
        own = {n for n, p in model.get_submodule(mod).named_parameters(recurse=False) if p.requires_grad}
        if target == "dtensor":
            why = "no DTensor style sums a replicated parameter's gradient (Hugging Face's " \
                  "replicated_with_grad_allreduce does)"
        elif mod in mods or own != attrs:
            why = ("its module has a style of its own" if mod in mods else
                   f"the style would also sum {', '.join(sorted(own - attrs))}, which is not read so")
        else:
            mods[mod] = _Module(mod, set(), {}, style="grad_allreduce")
            continue
        issues.append(ExportIssue(mod, "R", f"replicated {', '.join(sorted(attrs))} read on this rank's "
                                  f"part at {where[mod]}: its gradient is partial and must be summed; {why}"))
    return issues


def _parameters_only(node) -> list:
    """The ``get_attr`` nodes ``node`` is computed from, when it reads nothing else (no graph
    input): its gradient reaches them only."""
    seen, stack, params = set(), [node], []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return []
        if n.op == "get_attr":
            params.append(n)
        stack.extend(n.all_input_nodes)
    return params


# styles whose module hands the model's code its output as a view of a DTensor (``to_local``)
_DTENSOR_VIEW_OUT = {"column", "column_gather", "row", "embedding"}


def _written_in_place(gm, mods) -> list[ExportIssue]:
    """The model's code writing a styled module's output in place (Falcon's ``mlp_output +=
    attention_output``): in training the runtimes hand it a view of a DTensor's local tensor,
    which autograd refuses to modify in place."""
    from ..planner.capture import module_of, source_of

    styled = {m.path for m in mods.values() if m.style in _DTENSOR_VIEW_OUT}
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.arguments or not node.args:
            continue
        alias = schema.arguments[0].alias_info
        src = node.args[0]
        if alias is None or not alias.is_write or not isinstance(src, type(node)):
            continue
        owner = module_of(src)
        if owner in styled and module_of(node) != owner:
            return [ExportIssue(owner, "-", f"the model's code writes this module's output in place at "
                                f"{source_of(node) or node.name}: in training the runtime hands it a view "
                                "of a DTensor's local tensor, which autograd refuses to modify in place")]
    return []


def _resized(gm, ann, tp: int, mods) -> dict[str, str]:
    """Source line -> module, for each size argument shardplan's rewrite divides by tp, on
    a tensor the export leaves local (not an LM head's logits, which it gathers)."""
    from ..planner.annotation import read_as
    from ..planner.capture import module_of, source_of
    from ..planner.graph import args_of, op_name
    from ..planner.kinds import KINDS

    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        kind = ann.rules.kind(op_name(node)) if node.op == "call_function" else None
        if kind is None or not node.args or not isinstance(node.args[0], type(node)):
            continue
        src = read_as(ann.layouts.get(node.args[0]))
        if not isinstance(src, Shard) or _gathered_by_export(node.args[0], ann, mods):
            continue
        old = args_of(node)
        local = KINDS[kind].local_args(node, src, ann.layouts.get(node), tp, lambda s, by: f"{s}//{by}")
        if any(v != old.get(k) for k, v in local.items()):
            found.setdefault(source_of(node) or node.name, module_of(node))
    return found


def _gathered_by_export(node, ann, mods) -> bool:
    """Whether ``node``'s split value comes unchanged from a column layer the export gathers."""
    from ..planner.capture import module_of

    while isinstance(node, torch.fx.Node) and isinstance(ann.layouts.get(node), Shard):
        m = mods.get(module_of(node))
        if m is not None:
            return m.style == "column_gather"
        node = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
    return False


def export_issues(plan, target: str = "dtensor", model=None, *, example_inputs=None,
                  code: ModelCode | None = None) -> list[ExportIssue]:
    """What cannot be exported (``fatal``) and what exports with a difference (notes).

    With ``model``, also where the model's own code would compute wrong sizes on the
    local tensors the exported styles hand it (``_runtime_issues``).
    """
    if target not in ("dtensor", "hf"):
        raise ValueError(f"target must be 'dtensor' or 'hf', not {target!r}")
    mods, issues = _analyse(plan, target, model)
    if model is not None and not any(i.fatal for i in issues):
        issues += _runtime_issues(plan, mods, code or ModelCode(model, example_inputs), target)
    return issues


def _need(model) -> None:
    if model is None:
        raise TypeError("an export needs the model (model=...): whether the target runtime computes the "
                        "plan right depends on the model's own code, which is checked")


def _raise(issues: list[ExportIssue], target: str) -> None:
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


def to_dtensor_plan(plan, *, model, local_output: bool = True, example_inputs=None,
                    code: ModelCode | None = None) -> dict:
    """``{module FQN: ParallelStyle}`` for ``parallelize_module(model, mesh, ...)``.

    ``local_output=True`` (the default, as in torchtitan) hands plain local tensors
    from column-parallel layers to the model's own code, unchanged: the export is
    refused (``LayoutError`` naming the module and source line) where that code
    would compute a wrong size from a constant, e.g. ``view(B, T, self.n_heads, D)``
    (checked by capturing ``model`` on fake tensors, with ``example_inputs`` if given). With
    ``local_output=False`` they stay DTensors with global shapes, so sizes need no
    change, but every op between a column and a row layer must have a DTensor
    sharding rule (on CPU: run attention under ``sdpa_kernel(SDPBackend.MATH)`` and
    ``implicit_replication()``).

    Every styled module must be an ``nn.Linear`` (``nn.Embedding`` for the
    vocabulary). ``code``: a ``ModelCode`` of ``model`` shared with the other export.
    Raises ``LayoutError`` for layouts with no DTensor style (see ``export_issues``).
    """
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    _need(model)
    mods, issues = _analyse(plan, "dtensor", model)
    if local_output and not any(i.fatal for i in issues):
        issues += _runtime_issues(plan, mods, code or ModelCode(model, example_inputs), "dtensor")
    _raise(issues, "dtensor")
    if getattr(plan, "sequence_parallel", False):
        return _sp_styles(plan, mods, model, local_output, DReplicate, DShard, ColwiseParallel,
                          RowwiseParallel, SequenceParallel)
    out = {}
    for m in mods.values():
        if m.style == "column":
            out[m.path] = ColwiseParallel(use_local_output=local_output)
        elif m.style == "column_gather":
            out[m.path] = ColwiseParallel(output_layouts=DReplicate())
        elif m.style == "row":
            out[m.path] = RowwiseParallel()
        elif m.style == "embedding":
            out[m.path] = RowwiseParallel(input_layouts=DReplicate())
    return out


def _sp_styles(plan, mods, model, local_output, DReplicate, DShard, ColwiseParallel, RowwiseParallel,
               SequenceParallel) -> dict:
    """Styles for a sequence-parallel plan (torchtitan's ``enable_sequence_parallel`` layout).

    The residual stream stays a DTensor ``Shard(1)`` between modules (embedding,
    row layers and norms keep DTensor outputs), so the model's own code reads the
    global sequence length (positions, masks) from it; column layers all-gather
    their tokens (``input_layouts=Shard(1)``) and hand the code local slices as
    without sequence parallelism.
    """
    scatters = {c.module for c in plan.collectives if str(c.purpose) == "seq_scatter"}
    gathers = any(str(c.purpose) == "seq_gather" for c in plan.collectives)
    out = {}
    for path in _sp_leaves(plan, model):
        if path not in mods:
            out[path] = SequenceParallel()
    bad = []
    for m in mods.values():
        tokens_in = DShard(1) if gathers else DReplicate()
        if m.style == "column":
            out[m.path] = ColwiseParallel(input_layouts=tokens_in, use_local_output=local_output)
        elif m.style == "column_gather":
            out[m.path] = ColwiseParallel(input_layouts=tokens_in, output_layouts=DReplicate())
        elif m.style == "row":
            if m.path not in scatters:
                bad.append(ExportIssue(m.path, "P", "a row layer whose sum the plan all-reduces inside a "
                                       "sequence-parallel plan: no style spells the Replicate->Shard(1) step"))
                continue
            out[m.path] = RowwiseParallel(output_layouts=DShard(1), use_local_output=False)
        elif m.style == "embedding":
            if m.path in scatters:
                out[m.path] = RowwiseParallel(input_layouts=DReplicate(), output_layouts=DShard(1),
                                              use_local_output=False)
            else:
                out[m.path] = RowwiseParallel(input_layouts=DReplicate())
    _raise(bad, "dtensor")
    return out


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
    _need(model)
    mods, issues = _analyse(plan, "hf", model)
    if not any(i.fatal for i in issues):
        issues += _runtime_issues(plan, mods, code or ModelCode(model, example_inputs), "hf")
    _raise(issues, "hf")
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
            mod = _owner(n)[0]
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


def parallelize_with_dtensor(model, mesh, plan, *, local_output: bool = True):
    """``parallelize_module(model, mesh, to_dtensor_plan(plan))``, then ``tie_again``."""
    from torch.distributed.tensor.parallel import parallelize_module

    styles = to_dtensor_plan(plan, local_output=local_output, model=model)
    parallelize_module(model, mesh, styles)
    tie_again(model, plan)
    return model


def tie_again(model, plan) -> None:
    """Tie again the weights the plan lists as aliases (``parallelize_module`` makes a new
    parameter per module)."""
    for p in plan.params:
        if not p.aliases:
            continue
        canonical = model.get_parameter(p.name)
        for alias in p.aliases:
            mod, attr = _owner(alias)
            owner = model.get_submodule(mod)
            current = getattr(owner, attr)
            if current is canonical:
                continue
            if getattr(current, "placements", None) != getattr(canonical, "placements", None):
                raise LayoutError(f"tied weights {p.name} and {alias} were placed differently "
                                  f"({getattr(canonical, 'placements', None)} vs "
                                  f"{getattr(current, 'placements', None)})", where=alias,
                                  fix="give both modules styles that shard the weight the same way")
            setattr(owner, attr, canonical)
