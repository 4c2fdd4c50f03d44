"""The export check: the model's own code run as the target runtime would run it.

An export is a promise that the target runtime runs the model's own, unchanged code
right. Both runtimes (Hugging Face's styles, DTensor's with ``use_local_output``) hand
the code between a column and a row layer this rank's slice and adapt nothing else: no
head count is divided. So ``runtime_issues`` captures the model (``ModelCode``, on fake
tensors) as it is and with the styled layers' weights cut to their local shapes, and
refuses, naming module and source line, where a size comes out wrong (a view by
``self.num_heads``, mixed layouts in one attention). On the way it settles which
column layers export gathered (an LM head) and which replicated parameters need
their gradient summed (a per-head q/k norm), and refuses a styled module's output
the model's code writes in place (the runtimes hand it a view of a DTensor's local
tensor, which autograd refuses to modify).
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch

from ..layouts import Placement, Shard
from ..planner import blocks
from ..planner.annotate import annotate
from ..planner.annotation import read_as
from ..planner.capture import capture, module_of, planned_capture, source_of
from ..planner.graph import args_of, hint, op_name, shape
from ..planner.inputs import example_args
from ..planner.kinds import KINDS
from ..planner.kinds.permute import viewed_parameter
from ..planner.rules import load_rules
from ..planner.shards import local_shape
from ..planner.transitions import Purpose
from ..torch_compat import pytree
from .styles import ExportIssue, ExportModule, analyse, need_model, owner_of, raise_fatal

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
        if self._copy is None:
            self._copy = copy.deepcopy(self.model)
            self._args, self._kwargs = example_args(self._copy, self.example_inputs)
        return self._copy

    def whole(self, plan):
        """The capture as it is, annotated like ``plan`` (its baseline: a plan with a
        distributed reduction is refused before this is read)."""
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
    (la, sa), (lb, sb) = pytree.tree_flatten(a), pytree.tree_flatten(b)
    key = lambda x: (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return sa == sb and all(type(x) is type(y) and key(x) == key(y) for x, y in zip(la, lb))


def runtime_issues(plan, mods, code: ModelCode, target: str) -> list[ExportIssue]:
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
        full, cut_shape = shape(a), shape(b)
        if full is None or cut_shape is None or viewed_parameter(a):  # a weight's view: cut by the style
            continue
        full = tuple(hint(d) for d in full)
        lay = ann.layouts.get(a)
        want = local_shape(full, lay, tp) if isinstance(lay, Shard) else full
        got = tuple(hint(d) for d in cut_shape)
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
    owners: dict[str, set] = {}
    where: dict[str, str] = {}
    for t in ann.transitions:
        if t.purpose is not Purpose.F:
            continue
        for param in _parameters_only(t.src):  # the weight, a view of it, Gemma's 1 + weight
            mod, attr = owner_of(str(param.target))
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
            mods[mod] = ExportModule(mod, set(), {}, style="grad_allreduce")
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
    local tensors the exported styles hand it (``runtime_issues``).
    """
    if target not in ("dtensor", "hf"):
        raise ValueError(f"target must be 'dtensor' or 'hf', not {target!r}")
    mods, issues = analyse(plan, target, model)
    if model is not None and not any(i.fatal for i in issues):
        issues += runtime_issues(plan, mods, code or ModelCode(model, example_inputs), target)
    return issues


def checked_styles(plan, target: str, model, *, example_inputs=None, code: ModelCode | None = None,
                   run_code: bool = True) -> OrderedDict[str, ExportModule]:
    """Each module's style for ``target`` (``analyse``), the model's own code checked on the
    local tensors (``runtime_issues``) unless ``run_code`` is false; ``LayoutError`` naming
    every fatal issue."""
    need_model(model)
    mods, issues = analyse(plan, target, model)
    if run_code and not any(i.fatal for i in issues):
        issues += runtime_issues(plan, mods, code or ModelCode(model, example_inputs), target)
    raise_fatal(issues, target)
    return mods
