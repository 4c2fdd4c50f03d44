"""Pipeline parallelism over the mesh's "pp" dimension, on ``torch.distributed.pipelining``,
with tensor parallelism inside each stage over its "tp" dimension.

``pipeline_parallel(model, example_inputs, dims=..., microbatches=M)`` cuts
``model`` into stages at block boundaries, keeps this rank's stages and runs
them with one of torch's schedules::

    dims = ParallelDims(pp=2, tp=2).with_mesh("cpu")
    pipe = pipeline_parallel(model, x, dims=dims, microbatches=4, schedule="1f1b")
    opt = torch.optim.AdamW(pipe.parameters())
    loss = pipe.step(x, y)      # the batch's loss on the last stage's ranks, else None

The cut:

1. the blocks are the elements of the model's largest ``nn.ModuleList`` (its
   layers; ``layers=`` names another); the embedding stays on the first
   stage, the head on the last, with the loss the schedule computes there
   (``loss_fn(output, targets)``, by default the cross-entropy of the logits);
2. the blocks are divided into contiguous runs, one per stage, by the
   planner (``shardplan.plan(..., pp=)``, ``planner.stages``): by the FLOPs
   of each block, the embedding's and the head's and loss's, from a
   fake-tensor run of the captured graph, runs chosen so that the largest
   stage time is as small as it can be, every rank within ``memory_limit``
   when given (parameters, gradients, AdamW state and the activations of the
   microbatches the schedule keeps in flight); stages may hold different
   numbers of blocks. ``Pipeline.estimate`` keeps the planner's stages;
3. torch's tracer (``torch.distributed.pipelining.pipeline`` with a
   ``SplitPoint.BEGINNING`` at each stage's first block) exports the model
   on one microbatch and splits the graph there; each rank builds
   ``PipelineStage``s for its stages: stage ``s`` lives on pp rank
   ``s % pp`` (with ``virtual_stages`` v > 1, the interleaved schedule's
   v stages per rank).

**Tensor parallelism inside the stages** (``dims.tp`` > 1): the traced model
runs one microbatch in this process, recording what each of this rank's
stages takes and returns; each stage module is then planned and sharded by
``shardplan.parallelize`` over this rank's tp group on those inputs, exactly
as a whole model is (the embedding vocab-parallel on the first stage, the
attention and MLP split column/row inside every stage, as the planner
decides), with ``gather_output=True``: a stage sends and receives whole
activations, and the last stage returns whole logits, on which the
schedule's ``loss_fn`` runs on every tp rank (a vocab-parallel loss on the
last stage is the next step). The ``PipelineStage`` is built by hand over
the pp group with the recorded shapes. The pp group of a rank joins the
ranks of the same tp rank, so stage ``s`` and ``s + 1`` exchange the
activations of matching tp ranks.

Parameters used on several stages (an embedding tied to the head) are kept
on each of them by the tracer; ``step`` sums their gradients over the pp
group, so every copy gets the whole gradient and stays equal to the others.
With tensor parallelism the sum is of this rank's shards: every stage that
holds the parameter must split it alike (checked when the pipeline is built;
else ``ConfigurationError``). The tracer exports one microbatch shape: every
``step`` takes a batch of the example's shape. Data parallelism beside the
pipeline is not yet supported.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import (
    PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, SplitPoint, pipeline)

from ..api import parallelize
from ..errors import ConfigurationError
from ..layouts import MeshDim
from ..parallel_dims import ParallelDims
from ..planner.plan import plan
from ..planner.stages import PipelineEstimate, check_microbatches, check_schedule, find_layers
from ..runtime.comm import Group
from ..sharded import ShardedModule
from ..torch_compat import pytree

#: schedule name -> (torch schedule class, whether it runs several stages per rank)
SCHEDULES = {
    "gpipe": (ScheduleGPipe, False),
    "1f1b": (Schedule1F1B, False),
    "interleaved": (ScheduleInterleaved1F1B, True),
}
_WHERE = "pipeline_parallel"


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` (..., vocab) against ``targets`` (...)."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def check_config(model: nn.Module, inputs: tuple, dims: ParallelDims, microbatches: int,
                 schedule: str, virtual_stages: int | None, layers: str) -> int:
    """Validate the arguments of ``pipeline_parallel``; the number of stages per rank."""
    per_rank = check_schedule(schedule, virtual_stages, known=list(SCHEDULES), where=_WHERE)
    if dims.pp < 2:
        raise ConfigurationError(
            f"{dims}: pipeline_parallel needs pp >= 2 stages", where=_WHERE,
            fix="pass dims=ParallelDims(pp=..., tp=...).with_mesh(device) with pp >= 2, or "
                "shardplan.parallelize for tensor parallelism alone")
    if dims.dp > 1:
        raise ConfigurationError(
            f"{dims}: pipeline_parallel does not yet run data parallelism beside the "
            f"pipeline (dp_replicate={dims.dp_replicate}, dp_shard={dims.dp_shard})",
            where=_WHERE, fix="pass dims=ParallelDims(pp=..., tp=...) whose pp x tp is the "
                              "world size")
    check_microbatches(microbatches, pp=dims.pp, per_rank=per_rank, schedule=schedule,
                       rows={t.shape[0] for t in inputs},
                       n_blocks=len(model.get_submodule(layers)), layers=layers, where=_WHERE)
    return per_rank


def stage_plan(model: nn.Module, inputs: tuple, dims: ParallelDims, microbatches: int,
               schedule: str, per_rank: int, layers: str,
               memory_limit: int | str | None) -> PipelineEstimate:
    """The planner's cut of ``model`` into stages by FLOPs, within ``memory_limit`` bytes
    per rank (AdamW state), and each stage's estimate; ``ConfigurationError`` naming the
    stage over the limit when no cut fits."""
    est = plan(model, dims.tp, example_inputs=inputs, pp=dims.pp, schedule=schedule,
               microbatches=microbatches, virtual_stages=per_rank, layers=layers,
               gpu_memory=memory_limit).pipeline
    if est.overflow:
        raise ConfigurationError(
            est.overflow, where=_WHERE,
            fix="use more stages (pp, virtual_stages), fewer microbatches in flight "
                "(schedule='1f1b'), tensor parallelism inside the stages, or a larger "
                "memory_limit")
    return est


class Shared:
    """A parameter of the model on several stages: its FQNs, the stages that hold it, and
    the shape and dtype of the tensor each of them holds on this rank (its tp shard)."""

    def __init__(self, aliases: tuple[str, ...], stages: tuple[int, ...], shape: torch.Size,
                 dtype: torch.dtype):
        self.aliases, self.stages, self.shape, self.dtype = aliases, stages, shape, dtype


class Pipeline:
    """This rank's pipeline stages and the torch schedule that runs them."""

    def __init__(self, modules: dict[int, nn.Module], schedule, dims: ParallelDims,
                 estimate: PipelineEstimate, shared: list[Shared], batch_shapes: list[tuple]):
        #: stage index -> this rank's stage module (parameters under the model's FQNs; a
        #: ``ShardedModule`` of it with tp > 1)
        self.modules = modules
        #: the torch schedule object
        self.schedule = schedule
        #: the planner's stages: their blocks, parameters, FLOPs and memory per rank
        self.estimate = estimate
        #: the first block of each stage
        self.starts = estimate.starts
        self.dims = dims
        self._shared, self._batch_shapes = shared, batch_shapes
        self._group = dims.group(MeshDim.PP).pg
        self._num_stages = len(self.starts)

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.modules

    @property
    def holds_last_stage(self) -> bool:
        return self._num_stages - 1 in self.modules

    def named_parameters(self):
        """(FQN in the model, parameter) of this rank's stages, each parameter once."""
        seen = set()
        for module in self.modules.values():
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def parameters(self):
        return (p for _, p in self.named_parameters())

    @property
    def pp_group(self) -> Group:
        """This rank's group along "pp": the ranks of its tp rank, one per pp rank."""
        return self.dims.group(MeshDim.PP)

    def copies(self) -> set[int]:
        """The ids of this rank's parameters that are copies of a parameter an earlier
        stage holds too (a tied embedding on the last stage): after ``step`` they equal
        that stage's, so a global gradient norm leaves them out and counts it once."""
        out = set()
        for shared in self._shared:
            for s, module in self.modules.items():
                if s != min(shared.stages):
                    out |= {id(p) for n, p in _stage_parameters(module).items()
                            if n in shared.aliases}
        return out

    def step(self, inputs, targets: torch.Tensor, broadcast_loss: bool = False):
        """One forward and backward of the batch through the schedule, leaving the
        gradients of the batch's mean loss on this rank's parameters (zero them before
        each step: the gradients of shared parameters are summed over stages). Returns
        the loss on the last stage's rank (on every rank with ``broadcast_loss``), else
        None."""
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        shapes = [tuple(t.shape) for t in inputs]
        if shapes != self._batch_shapes or targets.shape[0] != shapes[0][0]:
            raise ConfigurationError(
                f"step() inputs of shapes {shapes} and targets of {tuple(targets.shape)}, but "
                f"the pipeline was built for inputs {self._batch_shapes}", where="Pipeline.step",
                fix="pass batches of the example's shape (the tracer exports one shape)")
        losses: list[torch.Tensor] = []
        self.schedule.step(*(inputs if self.holds_first_stage else ()),
                           target=targets if self.holds_last_stage else None, losses=losses)
        self._sum_shared_grads()
        loss = torch.stack(losses).mean().detach() if losses else None
        if broadcast_loss:
            loss = torch.zeros(()) if loss is None else loss
            dist.broadcast(loss, group=self._group, group_src=(self._num_stages - 1) % self.dims.pp)
        return loss

    def _sum_shared_grads(self) -> None:
        """Sum the gradient of each parameter held by several stages over the pp group (a
        rank without it adds zeros); every copy gets the sum."""
        for shared in self._shared:
            held = list({id(p): p for module in self.modules.values()
                         for n, p in _stage_parameters(module).items()
                         if n in shared.aliases}.values())
            grads = [p.grad for p in held if p.grad is not None]
            grad = torch.stack(grads).sum(0) if grads else \
                torch.zeros(shared.shape, dtype=shared.dtype)
            dist.all_reduce(grad, group=self._group)
            for p in held:
                p.grad = grad.clone()


def pipeline_parallel(model: nn.Module, example_inputs, *, dims: ParallelDims,
                      microbatches: int, schedule: str = "1f1b",
                      virtual_stages: int | None = None, layers: str | None = None,
                      loss_fn: Callable = lm_loss,
                      memory_limit: int | str | None = None) -> Pipeline:
    """Cut ``model`` into ``dims.pp`` x ``virtual_stages`` stages at block boundaries
    and build this rank's (see the module docstring). ``example_inputs``: the
    positional inputs of one batch (a tensor or a tuple), the shape every ``step``
    takes; ``microbatches``: how many pieces a batch is cut into; ``schedule``: one of
    ``SCHEDULES``; ``loss_fn(output, targets)``: the loss of one microbatch (its mean),
    computed on the last stage; ``memory_limit``: bytes (or a size, "80GB") one rank may
    hold, with AdamW state (``stage_plan``). ``model`` is not changed."""
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    layers = find_layers(model, layers, where=_WHERE)
    per_rank = check_config(model, inputs, dims, microbatches, schedule, virtual_stages, layers)
    num_stages = dims.pp * per_rank
    estimate = stage_plan(model, inputs, dims, microbatches, schedule, per_rank, layers,
                          memory_limit)
    starts = estimate.starts
    group = dims.group(MeshDim.PP).pg
    pp_rank = dist.get_rank(group)
    pipe = _trace(copy.deepcopy(model), inputs, microbatches, layers, starts)
    mine = list(range(pp_rank, num_stages, dims.pp))
    for s in mine:
        _tie_within(pipe.get_stage_module(s), model)
    device = torch.device(dims.mesh.device_type)
    if dims.tp > 1:
        stages = _sharded_stages(pipe, mine, _microbatch(inputs, microbatches),
                                 dims.group(MeshDim.TP), group, device)
    else:
        stages = [pipe.build_stage(s, device, group=group) for s in mine]
    modules = {stage.stage_index: stage.submod for stage in stages}
    cls, multi = SCHEDULES[schedule]
    runner = cls(stages if multi else stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    shared = _shared_parameters(model, pipe, num_stages, modules, group)
    return Pipeline(modules, runner, dims, estimate, shared, [tuple(t.shape) for t in inputs])


def _microbatch(inputs: tuple, microbatches: int) -> tuple:
    """The first microbatch of ``inputs``."""
    return tuple(t[: t.shape[0] // microbatches] for t in inputs)


def _sharded_stages(pipe, mine: list[int], example: tuple, tp_group: Group, group,
                    device: torch.device) -> list[PipelineStage]:
    """A ``PipelineStage`` over the pp process group ``group`` for each stage in ``mine``,
    its module planned and sharded by ``parallelize`` over ``tp_group`` on the inputs the
    stage gets from ``example`` (one microbatch), its output gathered whole."""
    seen = _stage_io(pipe, mine, example)
    stages = []
    for s in mine:
        args, out = seen[s]
        sharded = parallelize(pipe.get_stage_module(s), group=tp_group, example_inputs=args,
                              gather_output=True)
        stages.append(PipelineStage(sharded, s, pipe.num_stages, device, input_args=args,
                                    output_args=out, group=group))
    return stages


def _stage_io(pipe, stages: list[int], example: tuple) -> dict[int, tuple[tuple, Any]]:
    """Stage index -> (its positional inputs, its output) when ``pipe`` runs ``example``
    in this process (``_example``)."""
    seen: dict[int, tuple[tuple, Any]] = {}

    def record(s: int):
        def hook(module, args, output):
            seen[s] = (pytree.tree_map(_example, args), pytree.tree_map(_example, output))
        return hook

    handles = [pipe.get_stage_module(s).register_forward_hook(record(s)) for s in stages]
    try:
        with torch.no_grad():
            pipe(*example)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _example(x):
    """A recorded stage input or output as the schedule sees it in training: detached,
    requiring a gradient if it is floating point."""
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().requires_grad_(x.is_floating_point())


def _trace(model: nn.Module, inputs: tuple, microbatches: int, layers: str, starts: list[int]):
    """torch's ``Pipe`` of ``model`` split before each stage's first block, exported on
    one microbatch of ``inputs``."""
    spec = {f"{layers}.{b}": SplitPoint.BEGINNING for b in starts[1:]}
    return pipeline(model, _microbatch(inputs, microbatches), split_spec=spec)


def _aliases(model: nn.Module) -> list[tuple[str, ...]]:
    """The FQNs of each parameter of ``model``, one tuple per parameter."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [tuple(n) for n in names.values()]


def _tie_within(stage: nn.Module, model: nn.Module) -> None:
    """Make the FQNs of one parameter of ``model`` that a stage holds as separate copies
    name one parameter there again."""
    held = dict(stage.named_parameters(remove_duplicate=False))
    for aliases in _aliases(model):
        mine = [n for n in aliases if n in held]
        for name in mine[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(stage.get_submodule(owner), leaf, held[mine[0]])


def _stage_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """FQN (each alias of a tied one) -> parameter of a stage module: its tp shard where
    the module is a ``ShardedModule``."""
    if isinstance(module, ShardedModule):
        return {n: t for n, t in module.rank_tensors.items() if isinstance(t, nn.Parameter)}
    return dict(module.named_parameters(remove_duplicate=False))


def _layout_of(module: nn.Module, fqn: str) -> str:
    """How a stage module splits its parameter ``fqn`` over the tp group."""
    return str(module.layouts[fqn]) if isinstance(module, ShardedModule) else "R"


def _shared_parameters(model: nn.Module, pipe, num_stages: int, modules: dict[int, nn.Module],
                       group) -> list[Shared]:
    """The parameters of ``model`` that more than one stage of ``pipe`` holds, each with
    the shape of its shard on this rank. Every stage holding one must split it alike
    (the gradients of its shards are summed over the pp group), else
    ``ConfigurationError``."""
    holders = [{n for n, _ in pipe.get_stage_module(s).named_parameters(
        remove_duplicate=False)} for s in range(num_stages)]
    held_by = {aliases: tuple(s for s in range(num_stages) if holders[s] & set(aliases))
               for aliases in _aliases(model)}
    shared = [aliases for aliases, stages in held_by.items() if len(stages) > 1]
    mine = [{s: _shard_form(module, aliases) for s, module in modules.items()
             if set(aliases) & set(_stage_parameters(module))} for aliases in shared]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return [Shared(aliases, held_by[aliases],
                   *one_form(aliases, {s: form for rank_forms in everyone
                                       for s, form in rank_forms[i].items()}))
            for i, aliases in enumerate(shared)]


def one_form(aliases: tuple[str, ...], forms: dict[int, tuple[str, tuple, torch.dtype]]
             ) -> tuple[torch.Size, torch.dtype]:
    """The local (shape, dtype) of a parameter shared by stages, from each holding stage's
    (layout, local shape, dtype); ``ConfigurationError`` unless they all agree."""
    if len(set(forms.values())) > 1:
        listed = "; ".join(f"stage {s}: {lay} {list(shape)}"
                           for s, (lay, shape, _) in sorted(forms.items()))
        raise ConfigurationError(
            f"the parameter shared by {', '.join(aliases)} is split differently on the "
            f"stages that hold it ({listed}): their gradients cannot be summed shard by "
            f"shard", where="pipeline_parallel",
            fix="untie the weight, or keep the modules that read it in one stage")
    _, shape, dtype = next(iter(forms.values()))
    return torch.Size(shape), dtype


def _shard_form(module: nn.Module, aliases: tuple[str, ...]) -> tuple[str, tuple, torch.dtype]:
    """(layout, local shape, dtype) of the parameter a stage module holds under one of
    ``aliases``."""
    params = _stage_parameters(module)
    fqn = next(n for n in aliases if n in params)
    return _layout_of(module, fqn), tuple(params[fqn].shape), params[fqn].dtype
