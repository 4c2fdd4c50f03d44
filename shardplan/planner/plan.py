"""plan: the decisions as data.

A ``Plan`` lists every parameter's layout (per mesh dim) and local shape,
every collective (kind, direction, the mesh dim whose ranks it runs over,
bytes, graph node, source line), every decision with the rule that made it,
per-rank memory and warnings. It is built from the annotation's transitions,
the list the rewriter executes, so it cannot disagree with the runtime.

Schema 2 added the mesh: ``Plan.mesh`` (the sizes of its mesh dims; ``tp`` is still
written, for readers of schema 1), ``ParamEntry.mesh_layout`` and
``CollectiveEntry.mesh_dim``. A schema-1 plan reads as a plan of tp alone.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
import math

import torch
import torch.nn as nn
from pydantic import BaseModel, Field, computed_field, field_validator, model_validator

from . import blocks
from .capture import (Captured, capture, has_repeated_blocks, module_of, remember_capture,
                      source_of)
from .annotate import annotate
from .annotation import Annotation
from .transition_derivation import block_of, owner_name
from ..errors import CaptureError
from .inputs import check_dtypes, check_model_arg, example_args
from .kinds import Role
from .memory import MemoryEstimate, check_estimate_arguments, estimate
from ..layouts import MeshDim, MeshLayout, MeshSizes, Replicate, Shard
from ..parallel_dims import ParallelDims
from .rules import RuleSet, load_rules
from .shards import local_shape
from .stages import PipelineEstimate, check_plan_arguments, estimate_pipeline
from .transitions import Purpose, Transition, message

SCHEMA_VERSION = 2


class ParamEntry(BaseModel):
    name: str
    aliases: list[str] = []
    layout: str = Field(description="the placement along tp (mesh_layout's tp entry)")
    mesh_layout: str = Field(description="the placement along each mesh dim the plan decides: "
                                         "tp=S(0) (``MeshLayout.parse`` reads it)")
    global_shape: list[int]
    local_shape: list[int]
    dtype: str
    bytes_per_rank: int
    rule: str

    @model_validator(mode="before")
    @classmethod
    def _schema_1(cls, data):
        """A schema-1 entry has no mesh layout: its layout is the tp placement."""
        if isinstance(data, dict) and "mesh_layout" not in data and "layout" in data:
            return {**data, "mesh_layout": f"{MeshDim.TP}={data['layout']}"}
        return data


class CollectiveEntry(BaseModel):
    kind: str  # the c10d collective: all_reduce | all_gather | reduce_scatter
    direction: str  # forward | backward
    purpose: Purpose
    mesh_dim: MeshDim = MeshDim.TP  # whose ranks it runs over
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


class ChoiceEntry(BaseModel):
    """How the ops one region stopped at run, and what each way costs."""

    nodes: list[str]
    module: str
    source: str | None = None
    chosen: str  # "distributed" | "replicated" | "gathered"
    #: alternative -> {"moved": bytes per step (example inputs), "params": bytes per rank},
    #: of the captured graph
    costs: dict[str, dict[str, int]]


class Memory(BaseModel):
    param_bytes_per_rank: int
    param_bytes_unsharded: int
    #: a training step's per-rank bytes, when ``plan`` was given ``batch`` and ``seq``
    training: MemoryEstimate | None = None


class Plan(BaseModel):
    """What shardplan decided for one model on one mesh (``tp`` ranks, today)."""

    schema_version: int = SCHEMA_VERSION
    model: str
    mesh: dict[MeshDim, int] = Field(description="ranks along each mesh dim, outer to inner: "
                                                 "{\"tp\": 4}")
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
    pipeline: PipelineEstimate | None = Field(
        default=None, description="the pipeline's stages, their memory and the schedule's "
                                  "bubble, when ``plan`` was given ``pp``")
    choices: list[ChoiceEntry] = Field(
        default=[], description="regions reaching a reduction over their split dim or an op "
                                "with no rule for their parts: run it distributed, keep the "
                                "region replicated or gather the shard there, the cheapest kept")

    @model_validator(mode="before")
    @classmethod
    def _schema_1(cls, data):
        """A schema-1 plan says ``tp``: its mesh is tp alone."""
        if isinstance(data, dict) and "mesh" not in data and "tp" in data:
            return {**data, "mesh": {MeshDim.TP.value: data["tp"]}}
        return data

    @field_validator("mesh")
    @classmethod
    def _sizes(cls, mesh):
        return dict(MeshSizes(mesh))  # positive sizes, outer to inner

    @property
    def dims(self) -> MeshSizes:
        """``mesh`` as the planner's value (``plan.dims[MeshDim.TP]``, ``plan.dims.tp``)."""
        return MeshSizes(tuple(self.mesh.items()))

    @computed_field  # type: ignore[prop-decorator]  # pydantic's documented form
    @property
    def tp(self) -> int:
        """The ranks along tp (``mesh["tp"]``)."""
        return self.dims.tp

    def count(self, **match) -> int:
        return sum(1 for c in self.collectives
                   if all(getattr(c, k) == v for k, v in match.items()))

    def param(self, name: str) -> ParamEntry:
        for p in self.params:
            if p.name == name or name in p.aliases:
                return p
        raise KeyError(name)

    # presenters and exports imported when called: they sit above the plan they read
    def report(self, width: int = 100) -> str:
        from ..report.text import render_text
        return render_text(self, width)

    def to_html(self) -> str:
        """The plan as one self-contained HTML page (docs/report.md)."""
        from ..report.html import render_html
        return render_html(self)

    def diff(self, other: Plan) -> str:
        """What changed from this plan to ``other`` (``report.diff.compare_plans`` for data)."""
        from ..report.diff import diff_plans
        return diff_plans(self, other)

    def to_dtensor_plan(self, **kw) -> dict:
        """``{module FQN: ParallelStyle}`` for
        ``torch.distributed.tensor.parallel.parallelize_module``."""
        from ..export import to_dtensor_plan
        return to_dtensor_plan(self, **kw)

    def to_hf_tp_plan(self, **kw) -> dict[str, str]:
        """The Hugging Face ``base_model_tp_plan`` strings for this plan."""
        from ..export import to_hf_tp_plan
        return to_hf_tp_plan(self, **kw)

    def to_json(self, **kw) -> str:
        return self.model_dump_json(indent=2, **kw)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.model_validate_json(text)


def plan(model: nn.Module, tp: int, *, example_inputs=None, rules="megatron",
         strict: bool = False, sequence_parallel: bool = False, batch: int | None = None,
         seq: int | None = None, dp: int | None = None, dp_replicate: int | None = None,
         dp_shard: int | None = None, fsdp: bool = False, recompute: bool = False,
         dtype: torch.dtype | str | None = None, optimizer: str | None = "adamw",
         gpu_memory: int | str | None = None, pp: int | None = None, schedule: str = "1f1b",
         microbatches: int | None = None, virtual_stages: int | None = None,
         layers: str | None = None) -> Plan:
    """The plan for ``model`` at ``tp``, with no process group and no real memory.

    Lists of identical blocks that run one after another are captured with
    three blocks (first, middle, last), and the middle one's decisions stamped
    onto the rest. ``sequence_parallel`` holds the
    activations between regions on 1/tp of the sequence (``annotate``).

    With ``batch`` and ``seq`` (token ids, and targets when the forward takes
    them, of that shape are the example inputs) or ``example_inputs``, and
    any of the training keywords, ``plan.memory.training`` estimates a
    training step's per-rank bytes (``memory.estimate``): ``dp_replicate``
    replicas of ``dp_shard`` FSDP2 shards (HSDP when both are > 1; ``fsdp``
    with dp_shard 1 is FSDP2 over one rank), or the ``dp`` of before HSDP
    (shards with ``fsdp``, else replicas), ``recompute`` per block, parameters and
    activations in ``dtype`` (default: the model's; a dtype or its name), ``optimizer``
    state (``"adamw"``, ``"sgd"`` or None), and whether the peak fits ``gpu_memory``
    (bytes, or a size such as ``"80GB"``). A bad value of any of them raises
    ``ConfigurationError`` (``memory.check_estimate_arguments``) before anything is captured.

    With ``pp``, ``plan.pipeline`` cuts the blocks (``layers``: the largest
    ``nn.ModuleList`` by default) into ``pp`` x ``virtual_stages`` stages by their FLOPs,
    each rank's stages within ``gpu_memory``, and estimates each stage's memory per rank
    for ``schedule`` (``stages.SCHEDULES``) with the batch cut into ``microbatches``
    (``pp`` by default), and the schedule's bubble (``stages.estimate_pipeline``). When no
    cut fits, a warning names the stage over the limit and by how much.
    """
    check_model_arg(model, tp)
    dtype, gpu_memory = check_estimate_arguments(
        batch=batch, seq=seq, examples=example_inputs is not None, dp=dp,
        dp_replicate=dp_replicate, dp_shard=dp_shard, fsdp=fsdp,
        sequence_parallel=sequence_parallel, recompute=recompute, dtype=dtype,
        optimizer=optimizer, gpu_memory=gpu_memory)
    sizes = ParallelDims.data_parallel(dp=dp, dp_replicate=dp_replicate, dp_shard=dp_shard,
                                       fsdp=fsdp)
    dims = ParallelDims(tp=tp, dp_replicate=sizes["dp_replicate"] or 1,
                        dp_shard=sizes["dp_shard"] or 1)
    fsdp = fsdp or dims.dp_shard > 1
    ruleset = load_rules(rules)
    if batch is not None and seq is not None:  # given together (checked above)
        example_inputs = token_batch(model, batch, seq)
    args, kwargs = example_args(model, example_inputs)
    if pp is not None:
        block_list, per_rank, stage_microbatches = check_plan_arguments(
            model, args, kwargs, pp=pp, schedule=schedule, microbatches=microbatches,
            virtual_stages=virtual_stages, layers=layers)
    captured = _capture_stamped(model, args, kwargs)
    check_dtypes(captured.gm)
    ann = annotate(captured.gm, MeshSizes.of(tp=tp), ruleset, strict=strict,
                   sequence_parallel=sequence_parallel, cut_blocks=bool(recompute or fsdp))
    p = build_plan(model, captured, ann, ruleset, args, kwargs)
    remember_capture(p, model, args, kwargs, captured)
    if batch is not None or dims.dp > 1 or fsdp or recompute or gpu_memory is not None:
        p.memory.training = estimate(
            p, model, captured, ann, args, kwargs, dtype=dtype,
            dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, fsdp=fsdp,
            sequence_parallel=sequence_parallel, recompute=recompute, optimizer=optimizer,
            gpu_memory=gpu_memory)
    if pp is not None:
        p.pipeline = estimate_pipeline(
            p, model, captured, ann, args, kwargs, pp=pp, schedule=schedule,
            microbatches=stage_microbatches, per_rank=per_rank, layers=block_list,
            dtype=dtype or next(model.parameters()).dtype,
            shard=dims.dp_shard if fsdp else 1, recompute=recompute, optimizer=optimizer,
            memory_limit=gpu_memory)
        if p.pipeline.overflow:
            p.warnings.append(p.pipeline.overflow)
    return p


def token_batch(model: nn.Module, batch: int, seq: int) -> tuple:
    """(ids,) of shape batch x seq, or (ids, targets) when the forward's second
    parameter is ``targets`` or ``labels``."""
    vocab = max(e.num_embeddings for e in model.modules() if isinstance(e, nn.Embedding))
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    names = list(inspect.signature(model.forward).parameters)
    return (ids, ids.clone()) if names[1:2] in (["targets"], ["labels"]) else (ids,)


def _capture_stamped(model: nn.Module, args, kwargs) -> Captured:
    """A capture with each list of identical blocks cut to three, where stamping the
    middle one onto the rest is exact: the blocks run one after another. Otherwise (a list of
    per-head norms applied side by side, or a forward that needs the whole list) the
    whole model, as ``parallelize`` captures it."""
    try:
        captured = capture(model, args, kwargs, truncate=True)
    except CaptureError:
        if not has_repeated_blocks(model):
            raise
        return capture(model, args, kwargs)
    if all(_chained(captured.gm, path, i) for path in captured.truncated for i in (1, 2)):
        return captured
    return capture(model, args, kwargs)


def _chained(gm, path: str, i: int) -> bool:
    """Does block ``i`` of list ``path`` run on block i-1's result, in the same context?

    Every value block i reads from outside is computed from block i-1, or read
    by block i-1 too (a mask, RoPE tables); and at least one is computed from it.
    """
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    block = {n: blocks.index_in(module_of(n), path) for n in nodes}
    before = {n for n in nodes if block[n] == i - 1}
    after: set = set()  # computed from block i-1
    for n in gm.graph.nodes:
        if n in before or any(a in after for a in n.all_input_nodes):
            after.add(n)
    reads = _reads_from_outside(nodes, block, i)
    return bool(reads & after) and reads <= after | _reads_from_outside(nodes, block, i - 1)


def _reads_from_outside(nodes, block: dict, i: int) -> set:
    """The activations block ``i`` reads that it does not compute."""
    return {a for n in nodes if block[n] == i for a in n.all_input_nodes
            if a.op != "get_attr" and block.get(a) != i}


def build_plan(model: nn.Module, captured: Captured, ann: Annotation, ruleset: RuleSet,
               args, kwargs) -> Plan:
    """A ``Plan`` from an annotation: its collectives are its communicating transitions."""
    tokens = _tokens(args, kwargs)
    layouts = {captured.aliases.get(k, k): v for k, v in ann.params.items()}
    stamp = _Stamp(captured.truncated)
    params = _params(model, captured, layouts, ann, stamp)
    collectives = stamp.entries(_collectives([stamp.bucket(t) for t in ann.transitions], tokens))
    decisions = stamp.entries(_decisions(ann))
    choices = stamp.entries([_choice(c) for c in ann.choices])
    per_rank = sum(p.bytes_per_rank for p in params)
    unsharded = sum(math.prod(p.global_shape) * _itemsize(p.dtype) for p in params)
    return Plan(model=type(model).__name__, mesh=dict(ann.dims), rules=ruleset.name, tokens=tokens,
                params=params, collectives=collectives, decisions=decisions,
                warnings=list(ann.warnings),
                memory=Memory(param_bytes_per_rank=per_rank, param_bytes_unsharded=unsharded),
                repeated={k: list(v) for k, v in captured.truncated.items()},
                sequence_parallel=bool(ann.scattered or ann.deferred), choices=choices)


def _choice(c) -> ChoiceEntry:
    first = c.nodes[0]
    return ChoiceEntry(nodes=[n.name for n in c.nodes], module=module_of(first),
                       source=source_of(first), chosen=c.chosen.value,
                       costs={k.value: {"moved": v.moved, "params": v.params}
                              for k, v in c.costs.items()})


def _tokens(args, kwargs) -> int:
    tensors = [x for x in list(args) + list(kwargs.values()) if isinstance(x, torch.Tensor)]
    ints = [t for t in tensors if not t.is_floating_point()]
    first = next(iter(ints or tensors), None)
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
        elif node in ann.deferred:
            rule = (f"{rule}; reduce-scattered onto the ranks' tokens after its view "
                    f"{ann.deferred[node].name}: S(seq)")
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
        # a parameter's per-token gradient sum belongs to the block reading it (a get_attr
        # has no module), so blocks planned once stamp it onto every block
        at = t.consumers[0][0] if t.purpose in (Purpose.SEQ_GRAD, Purpose.SEQ_GRAD_BUCKET) \
            and t.src.op == "get_attr" else t.src
        # a sequence scatter or gather communicates both ways: one entry per side
        for direction, coll in (("forward", t.forward), ("backward", t.backward)):
            if not coll.communicates:
                continue
            for elements in t.elements:
                out.append(CollectiveEntry(
                    kind=coll.c10d, direction=direction, purpose=t.purpose, mesh_dim=t.mesh_dim,
                    elements=elements, elements_per_token=elements / max(tokens, 1),
                    bytes=elements * size, node=t.src.name, module=module_of(at),
                    source=source_of(at)))
    return out


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype.replace("torch.", ""))).element_size()


def _params(model, captured: Captured, layouts, ann: Annotation, stamp) -> list[ParamEntry]:
    by_canon: dict[str, list[str]] = {}
    for fqn, canon in captured.aliases.items():
        by_canon.setdefault(canon, []).append(fqn)
    entries = []
    for name, p in model.named_parameters():
        lay = layouts.get(stamp.origin(name), Replicate())
        local = local_shape(tuple(p.shape), lay, ann.size)
        entries.append(ParamEntry(
            name=name, aliases=[a for a in by_canon.get(name, []) if a != name],
            layout=str(lay), mesh_layout=str(MeshLayout(((ann.dim.value, lay),))),
            global_shape=list(p.shape), local_shape=list(local),
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
    """Lists captured as three blocks (first, middle, last) stamped onto all N: block 1
    stands for blocks 1..N-2, block 2 for block N-1."""

    def __init__(self, truncated: dict[str, tuple[int, int]]):
        self.lengths = {path: n for path, (_, n) in truncated.items()}

    def origin(self, name: str) -> str:
        """The captured name standing for ``name``."""
        for path, n in self.lengths.items():
            i = blocks.index_in(name, path)
            if i is not None and i >= 1:
                return blocks.with_index(name, path, 2 if i == n - 1 else 1)
        return name

    def _names(self, name: str) -> list[str]:
        """The real names a captured name stands for."""
        for path, n in self.lengths.items():
            i = blocks.index_in(name, path)
            if i == 1:
                return [blocks.with_index(name, path, k) for k in range(1, n - 1)]
            if i == 2:
                return [blocks.with_index(name, path, n - 1)]
        return [name]

    def bucket(self, t: Transition) -> Transition:
        """``t``; a gradient bucket of several blocks (one per step) summing every block's
        members: a captured block's count once per block it stands for."""
        if t.purpose is not Purpose.SEQ_GRAD_BUCKET or len({block_of(owner_name(s))
                                                            for s in t.sources}) < 2:
            return t
        n = sum(math.prod(message(s)) * len(self._names(owner_name(s))) for s in t.sources)
        return replace(t, messages=((n,),))

    def entries(self, items: list) -> list:
        return [it if m == it.module else it.model_copy(update={"module": m})
                for it in items for m in self._names(it.module)]
