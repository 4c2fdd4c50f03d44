"""plan: the decisions as data.

A ``Plan`` lists every parameter's layout and local shape, every collective
(kind, direction, bytes, graph node, source line), every decision with the
rule that made it, per-rank memory and warnings. It is built from the
annotation's transitions, the list the rewriter executes, so it cannot
disagree with the runtime.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from pydantic import BaseModel, Field

from . import blocks
from .capture import Captured, capture, module_of, source_of
from .annotate import Annotation, annotate
from .inputs import check_dtypes, check_model_arg, example_args
from .kinds import Role
from ..layouts import Replicate, Shard
from .rules import RuleSet, load_rules
from .shards import local_shape
from .transitions import Purpose, Transition

SCHEMA_VERSION = 1


class ParamEntry(BaseModel):
    name: str
    aliases: list[str] = []
    layout: str
    global_shape: list[int]
    local_shape: list[int]
    dtype: str
    bytes_per_rank: int
    rule: str


class CollectiveEntry(BaseModel):
    kind: str  # the c10d collective: all_reduce | all_gather | reduce_scatter
    direction: str  # forward | backward
    purpose: Purpose
    elements: int  # for the plan's example inputs
    elements_per_token: float
    bytes: int
    node: str
    module: str
    source: str | None = None


class Decision(BaseModel):
    node: str
    module: str
    role: Role
    layout: str
    rule: str
    evidence: list[str] = []
    source: str | None = None
    sequence: bool = Field(
        default=False, description="the layout splits the sequence: S(seq), this rank's "
                                   "1/tp of the tokens (sequence parallelism)")


class Memory(BaseModel):
    param_bytes_per_rank: int
    param_bytes_unsharded: int


class Plan(BaseModel):
    """What shardplan decided for one model at one tp."""

    schema_version: int = SCHEMA_VERSION
    model: str
    tp: int
    rules: str
    tokens: int = Field(description="tokens (batch x sequence) of the example inputs")
    params: list[ParamEntry]
    collectives: list[CollectiveEntry]
    decisions: list[Decision]
    warnings: list[str]
    memory: Memory
    repeated: dict[str, list[int]] = Field(
        default={}, description="block lists planned once: FQN -> [captured, real] length")
    sequence_parallel: bool = Field(
        default=False, description="activations between the regions held on 1/tp of the "
                                   "sequence (decisions with sequence=True)")

    def count(self, **match) -> int:
        return sum(1 for c in self.collectives
                   if all(getattr(c, k) == v for k, v in match.items()))

    def param(self, name: str) -> ParamEntry:
        for p in self.params:
            if p.name == name or name in p.aliases:
                return p
        raise KeyError(name)

    def report(self, width: int = 100) -> str:
        from ..report.text import render_text
        return render_text(self, width)

    def to_html(self) -> str:
        """The plan as one self-contained HTML page (docs/report.md)."""
        from ..report.html import render_html
        return render_html(self)

    def diff(self, other: Plan) -> str:
        """What changed from this plan to ``other`` (``plan_diff.compare_plans`` for data)."""
        from ..report.diff import diff_plans
        return diff_plans(self, other)

    def to_dtensor_plan(self, **kw) -> dict:
        """``{module FQN: ParallelStyle}`` for ``torch.distributed.tensor.parallel.parallelize_module``."""
        from ..report.export import to_dtensor_plan
        return to_dtensor_plan(self, **kw)

    def to_hf_tp_plan(self, **kw) -> dict[str, str]:
        """The Hugging Face ``base_model_tp_plan`` strings for this plan."""
        from ..report.export import to_hf_tp_plan
        return to_hf_tp_plan(self, **kw)

    def to_json(self, **kw) -> str:
        return self.model_dump_json(indent=2, **kw)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.model_validate_json(text)


def plan(model: nn.Module, tp: int, *, example_inputs=None, rules="megatron",
         strict: bool = False, sequence_parallel: bool = False) -> Plan:
    """The plan for ``model`` at ``tp``, with no process group and no real memory.

    Lists of identical blocks are captured and planned once (two blocks), and
    their decisions stamped onto the rest. ``sequence_parallel`` holds the
    activations between regions on 1/tp of the sequence (``annotate``).
    """
    check_model_arg(model, tp)
    ruleset = load_rules(rules)
    args, kwargs = example_args(model, example_inputs)
    captured = capture(model, args, kwargs, truncate=True)
    check_dtypes(captured.gm)
    ann = annotate(captured.gm, tp, ruleset, strict=strict, sequence_parallel=sequence_parallel)
    return build_plan(model, captured, ann, ruleset, args, kwargs)


def build_plan(model: nn.Module, captured: Captured, ann: Annotation, ruleset: RuleSet,
               args, kwargs) -> Plan:
    """A ``Plan`` from an annotation: its collectives are its communicating transitions."""
    tp = ann.tp
    tokens = _tokens(args, kwargs)
    layouts = {captured.aliases.get(k, k): v for k, v in ann.params.items()}
    stamp = _Stamp(captured.truncated)
    params = _params(model, captured, layouts, tp, stamp)
    collectives = stamp.entries(_collectives(ann.transitions, tokens))
    decisions = stamp.entries(_decisions(ann))
    per_rank = sum(p.bytes_per_rank for p in params)
    unsharded = sum(math.prod(p.global_shape) * _itemsize(p.dtype) for p in params)
    return Plan(model=type(model).__name__, tp=tp, rules=ruleset.name, tokens=tokens,
                params=params, collectives=collectives, decisions=decisions,
                warnings=list(ann.warnings),
                memory=Memory(param_bytes_per_rank=per_rank, param_bytes_unsharded=unsharded),
                repeated={k: list(v) for k, v in captured.truncated.items()},
                sequence_parallel=bool(ann.seq_dims))


def _tokens(args, kwargs) -> int:
    tensors = [x for x in list(args) + list(kwargs.values()) if isinstance(x, torch.Tensor)]
    ints = [t for t in tensors if not t.is_floating_point()]
    first = (ints or tensors or [None])[0]
    if first is None:
        return 1
    return math.prod(first.shape) if not first.is_floating_point() else math.prod(first.shape[:2])


def _decisions(ann: Annotation) -> list[Decision]:
    """Every non-local decision, and in sequence parallelism every op run on the ranks'
    tokens (``sequence=True``; a region's partial output reduce-scattered onto them is
    listed as its ``seq_scatter`` collective)."""
    out = []
    for node, o in ann.outcomes.items():
        role = Role.REPLICATED if node in ann.disabled else o.role
        tokens = ann.on_tokens(node)
        if role is Role.LOCAL and not tokens:
            continue
        rule = ann.disabled.get(node, o.rule)
        if role is Role.LOCAL:
            rule = f"runs on this rank's tokens (sequence parallel): {rule}"
        elif node in ann.scattered:
            rule = f"{rule}; reduce-scattered onto the ranks' tokens: S(seq)"
        elif ann.seq_dims and role in (Role.ROW, Role.PARTIAL) and node not in ann.seq_dims:
            rule = (f"{rule}; all-reduced, then sliced onto the ranks' tokens (no dim of its "
                    "own is the sequence: sequence-parallel fallback)")
        out.append(Decision(
            node=node.name, module=module_of(node), role=role, layout=str(ann.layouts.get(node)),
            rule=rule, evidence=[a.name for a in node.all_input_nodes], source=source_of(node),
            sequence=tokens))
    return out


def _collectives(transitions: list[Transition], tokens: int) -> list[CollectiveEntry]:
    out = []
    for t in transitions:
        size = torch.empty((), dtype=t.dtype).element_size()
        # a sequence scatter or gather communicates both ways: one entry per side
        for direction, coll in (("forward", t.forward), ("backward", t.backward)):
            if not coll.communicates:
                continue
            for elements in t.elements:
                out.append(CollectiveEntry(
                    kind=coll.c10d, direction=direction, purpose=t.purpose,
                    elements=elements, elements_per_token=elements / max(tokens, 1),
                    bytes=elements * size, node=t.src.name, module=module_of(t.src),
                    source=source_of(t.src)))
    return out


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype.replace("torch.", ""))).element_size()


def _params(model, captured: Captured, layouts, tp, stamp) -> list[ParamEntry]:
    by_canon: dict[str, list[str]] = {}
    for fqn, canon in captured.aliases.items():
        by_canon.setdefault(canon, []).append(fqn)
    entries = []
    for name, p in model.named_parameters():
        lay = layouts.get(name) or layouts.get(stamp.origin(name), Replicate())
        local = local_shape(tuple(p.shape), lay, tp)
        entries.append(ParamEntry(
            name=name, aliases=[a for a in by_canon.get(name, []) if a != name],
            layout=str(lay), global_shape=list(p.shape), local_shape=list(local),
            dtype=str(p.dtype).replace("torch.", ""),
            bytes_per_rank=math.prod(local) * p.element_size(),
            rule=_param_rule(lay)))
    return entries


def _param_rule(lay) -> str:
    if isinstance(lay, Shard):
        if lay.padded:
            return "split along the vocabulary (padded)"
        return f"split on dim {lay.dim}" + (" by blocks" if lay.blocks else "")
    return "replicated"


class _Stamp:
    """Block 1's decisions, stamped onto blocks 2..N-1 of lists captured with two blocks."""

    def __init__(self, truncated: dict[str, tuple[int, int]]):
        self.lengths = {path: n for path, (_, n) in truncated.items()}

    def origin(self, name: str) -> str:
        """The captured name standing for ``name`` (block k >= 2 -> block 1)."""
        for path in self.lengths:
            i = blocks.index_in(name, path)
            if i is not None and i >= 2:
                return blocks.with_index(name, path, 1)
        return name

    def _copies(self, name: str) -> list[str]:
        for path, n in self.lengths.items():
            if blocks.index_in(name, path) == 1:
                return [blocks.with_index(name, path, i) for i in range(2, n)]
        return []

    def entries(self, items: list) -> list:
        out = []
        for it in items:
            out.append(it)
            out.extend(it.model_copy(update={"module": m}) for m in self._copies(it.module))
        return out
