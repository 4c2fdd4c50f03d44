"""stages: a pipeline's cut by cost, and each stage's memory and the schedule's bubble.

``estimate_pipeline`` cuts the blocks (the model's largest ``nn.ModuleList``)
into ``pp`` x ``virtual_stages`` contiguous stages, the embedding (what runs
before the first block) on the first stage, the head and the loss (what runs
after the last) on the last:

- **cost**: rank 0's rewritten graph runs one microbatch on fake tensors
  (``memory.fake_run``) under ``FlopCounterMode``; each node's FLOPs go to its
  block, or to the part before or after the blocks. A stage's time is taken
  as its forward FLOPs x 3 (backward computes the gradients of inputs and of
  weights, each as many FLOPs as the forward's matmuls), plus one more
  forward for a recomputed block;
- **memory** of a stage, per rank: the parameters its blocks and parts read
  (a weight tied across the first and last stage counts on both, as the
  pipeline keeps a copy on each) with their gradients and optimizer state
  (``memory.elements_state``), and the activations one microbatch saves
  there times the microbatches the schedule keeps in flight (``in_flight``);
- **the cut** (``partition``): dynamic programming over contiguous cuts,
  exact: the largest stage time as small as it can be, among the cuts whose
  every stage fits the memory limit (a rank's limit shared equally by its
  ``virtual_stages`` stages). When none fits, the cut that needs least memory
  is kept and ``PipelineEstimate.overflow`` names the stage over the limit
  and by how much.

The bubble (idle time over compute time, equal forward, input-gradient and
weight-gradient times): GPipe and 1F1B ``(p-1)/m`` (Narayanan et al. 2021),
interleaved 1F1B ``(p-1)/(v*m)`` (ibid.), ZB-V 0 (Qi et al. 2024, "Pipeline
Parallelism with Controllable Memory"). Microbatches in flight, at the peak:
GPipe all m on every stage; 1F1B ``min(m, p - s)`` on stage s; interleaved
1F1B, on rank r, the ``2(p - r - 1) + (v - 1) * p + 1`` warm-up forwards
(at most v * m) given round by round to its v stages (Megatron's schedule,
which torch's ``ScheduleInterleaved1F1B`` runs; p + (p-1)/v microbatches of
a stage's worth on rank 0, Korthikanti et al. 2022); ZB-V ``min(m, p)`` on
each of a rank's two stages (1F1B's memory).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn as nn
from pydantic import BaseModel

from . import blocks
from .memory import AFTER, BEFORE, elements_state, fake_run, stand_in
from .. import arguments
from ..errors import ConfigurationError

#: schedule name -> stages per pp rank (None: ``virtual_stages``, 2 by default)
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": None, "zbv": 2}
#: schedules that need at least as many microbatches as pp ranks
NEED_PP_MICROBATCHES = ("1f1b", "interleaved", "zbv")
#: stages per rank of the interleaved schedule when ``virtual_stages`` is not given
DEFAULT_VIRTUAL = 2


def find_layers(model: nn.Module, layers: str | None = None, *, where: str) -> str:
    """The FQN of ``model``'s block list: ``layers`` if given, else its largest
    ``nn.ModuleList``."""
    lists = {n: m for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)}
    if layers is not None:
        if layers not in lists:
            raise ConfigurationError(
                f"layers={layers!r} is not a non-empty nn.ModuleList of {type(model).__name__}",
                where=where,
                fix=f"name one of {sorted(lists) or 'its nn.ModuleLists (it has none)'}")
        return layers
    if not lists:
        raise ConfigurationError(
            f"{type(model).__name__} has no nn.ModuleList of blocks to cut into stages",
            where=where,
            fix="hold the repeated layers in an nn.ModuleList and pass its name as layers=")
    return max(lists, key=lambda n: len(lists[n]))


def block_count(model: nn.Module, layers: str) -> int:
    """How many blocks the ``nn.ModuleList`` ``layers`` of ``model`` holds."""
    return len(cast(nn.ModuleList, model.get_submodule(layers)))


def check_schedule(schedule: str, virtual_stages: int | None, *, known, where: str) -> int:
    """The stages per rank of ``schedule`` (one of ``known``) with ``virtual_stages``."""
    if schedule not in known:
        raise ConfigurationError(f"unknown schedule {schedule!r}", where=where,
                                 fix=f"pass schedule= one of {list(known)}")
    fixed = SCHEDULES[schedule]
    per_rank = (fixed or DEFAULT_VIRTUAL) if virtual_stages is None else virtual_stages
    if not arguments.is_int(per_rank) or per_rank < 1 or (fixed is not None and per_rank != fixed):
        raise ConfigurationError(
            f"virtual_stages={virtual_stages!r} with schedule={schedule!r}", where=where,
            fix="pass virtual_stages (an int >= 1, stages per rank) only with "
                "schedule='interleaved'")
    return per_rank


def check_microbatches(microbatches, *, pp: int, per_rank: int, schedule: str, rows: set,
                       n_blocks: int | None, layers: str, where: str) -> None:
    """``microbatches`` a positive int dividing the batch (``rows``: the first dimension
    of each input), enough of them for ``schedule``, and no more stages than blocks
    (``n_blocks``; None: not checked, the model is not built yet)."""
    if not arguments.is_int(microbatches) or microbatches < 1:
        raise ConfigurationError(f"microbatches={microbatches!r} must be a positive int",
                                 where=where,
                                 fix="pass the number of microbatches a batch is cut into")
    if len(rows) != 1:
        raise ConfigurationError(
            f"example_inputs of different batch sizes {sorted(rows)}", where=where,
            fix="pass inputs whose first dimension is the batch, the same for all")
    batch = next(iter(rows))
    if batch % microbatches:
        raise ConfigurationError(
            f"microbatches={microbatches} does not divide the batch of {batch} rows",
            where=where, fix="pass a number of microbatches that divides the batch size")
    if schedule in NEED_PP_MICROBATCHES and microbatches < pp:
        raise ConfigurationError(
            f"schedule={schedule!r} needs at least pp={pp} microbatches, got "
            f"{microbatches}", where=where,
            fix=f"pass microbatches >= {pp}, or schedule='gpipe'")
    rounds = max(1, microbatches // pp)
    if per_rank > 1 and microbatches % rounds:
        raise ConfigurationError(
            f"schedule={schedule!r} runs microbatches // pp = {rounds} rounds, and "
            f"microbatches={microbatches} is not a multiple of them", where=where,
            fix=f"pass a multiple of {pp} microbatches")
    if n_blocks is not None and pp * per_rank > n_blocks:
        raise ConfigurationError(
            f"{pp * per_rank} stages (pp={pp} x {per_rank} per rank) but "
            f"{layers!r} has {n_blocks} blocks", where=where,
            fix=f"use at most {n_blocks} stages: fewer pp ranks or virtual_stages")


def check_plan_arguments(model: nn.Module, args: tuple, kwargs: dict, *, pp, schedule,
                         microbatches, virtual_stages, layers) -> tuple[str, int, int]:
    """(block list, stages per rank, microbatches: ``pp`` by default) of ``plan``'s
    pipeline arguments; a ``ConfigurationError`` naming the first bad one."""
    arguments.integer("pp", pp, 1, where="plan")
    layers = find_layers(model, layers, where="plan")
    per_rank = check_schedule(schedule, virtual_stages, known=list(SCHEDULES), where="plan")
    microbatches = pp if microbatches is None else microbatches
    rows = {x.shape[0] for x in [*args, *kwargs.values()]
            if isinstance(x, torch.Tensor) and x.dim()}
    check_microbatches(microbatches, pp=pp, per_rank=per_rank, schedule=schedule, rows=rows,
                       n_blocks=block_count(model, layers), layers=layers, where="plan")
    return layers, per_rank, microbatches


# --------------------------------------------------------------------------- schedules

def rank_of(stage: int, pp: int, schedule: str) -> int:
    """The pp rank that runs ``stage``: ``stage % pp``; ZB-V's V, ranks 0..p-1 and back."""
    if schedule == "zbv":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def in_flight(stage: int, pp: int, per_rank: int, microbatches: int, schedule: str) -> int:
    """Microbatches whose activations ``stage`` holds at its peak (the module docstring)."""
    m = microbatches
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp - stage)
    if schedule == "zbv":
        return min(m, pp)
    rank, chunk = stage % pp, stage // pp
    per_round = m // max(1, m // pp)
    forwards = min(2 * (pp - rank - 1) + (per_rank - 1) * per_round + 1, per_rank * m)
    return sum(1 for i in range(forwards) if (i // per_round) % per_rank == chunk)


def bubble(pp: int, per_rank: int, microbatches: int, schedule: str) -> float:
    """The schedule's idle time over its compute time (the module docstring)."""
    if schedule == "zbv":
        return 0.0
    return (pp - 1) / (per_rank * microbatches)


# --------------------------------------------------------------------------- the cut

def partition(n: int, stages: int, cost: Callable[[int, int, int], float],
              fits: Callable[[int, int, int], bool] | None = None) -> list[int] | None:
    """The first block of each of ``stages`` contiguous non-empty runs of ``n`` blocks
    whose largest ``cost(stage, first, end)`` is the smallest possible among the cuts
    whose every run ``fits(stage, first, end)`` (of equal ones, the earliest cuts); None
    when no cut fits."""
    # best[k][i]: the smallest largest cost of k runs over the first i blocks
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[-1] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == math.inf or (fits is not None and not fits(k - 1, j, i)):
                    continue
                worst = max(best[k - 1][j], cost(k - 1, j, i))
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    if best[stages][n] == math.inf:
        return None
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


# --------------------------------------------------------------------------- the estimate

class StageEstimate(BaseModel):
    """One pipeline stage: its blocks and, per rank, its parameters, time and memory."""

    index: int
    pp_rank: int
    blocks: list[int]  # [first, end) of the block list
    embedding: bool  # holds what runs before the blocks
    head: bool  # holds what runs after them (the head and the loss)
    params: int  # elements per rank
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    flops: int  # forward and backward of one microbatch, per rank
    time_share: float  # of the pipeline's FLOPs
    in_flight: int  # microbatches whose activations it holds at its peak
    activations_per_microbatch: int
    activations: int
    peak: int
    fits: bool | None = None  # its rank's peak within the memory limit


class PipelineEstimate(BaseModel):
    """The stages of a pipeline (``estimate_pipeline``), the schedule's bubble and
    whether each rank's stages fit."""

    pp: int
    schedule: str
    microbatches: int
    virtual_stages: int
    layers: str
    blocks: int
    bubble: float
    memory_limit: int | None = None
    stages: list[StageEstimate]
    #: pp rank -> the sum of its stages' peaks
    rank_peaks: list[int]
    #: the stage over the memory limit and by how much, when no cut fits
    overflow: str | None = None

    @property
    def starts(self) -> list[int]:
        """The first block of each stage."""
        return [s.blocks[0] for s in self.stages]

    @property
    def fits(self) -> bool | None:
        return None if self.memory_limit is None else self.overflow is None


class _Units:
    """Per block, and before / after the blocks: forward FLOPs, saved bytes of one
    microbatch, and the parameters (elements per rank) read."""

    def __init__(self, plan, run, captured, layers: str, n: int, recompute: bool):
        names = [f"{layers}.{i}" for i in range(n)]
        labels = [stand_in(name, captured) for name in names]
        flops = [run.flops.get(label, 0) for label in labels]
        saved = [run.bytes.get(label, 0) for label in labels]
        self.ends = {part: (run.flops.get(part, 0), run.bytes.get(part, 0))
                     for part in (BEFORE, AFTER)}
        owned = [0] * n
        self.outside: dict[str, tuple[int, set]] = {}  # FQN -> (elements, who reads it)
        for p in plan.params:
            numel = math.prod(p.local_shape)
            index = blocks.index_in(p.name, layers)
            if index is not None:
                owned[index] += numel
                continue
            readers = {label for label, fqns in run.reads.items() if p.name in fqns}
            where = {names.index(r) if r in names else r for r in readers} - {None} or {BEFORE}
            self.outside[p.name] = (numel, where)
        self.owned = [0, *itertools.accumulate(owned)]
        self._time = [0, *itertools.accumulate(f * (4 if recompute else 3) for f in flops)]
        self._saved = [0, *itertools.accumulate(saved)]

    def parts(self, k: int, stages: int) -> list[str]:
        return [part for part, on in ((BEFORE, k == 0), (AFTER, k == stages - 1)) if on]

    def time(self, k: int, a: int, b: int, stages: int) -> int:
        return self._time[b] - self._time[a] + sum(3 * self.ends[p][0]
                                                   for p in self.parts(k, stages))

    def saved_bytes(self, k: int, a: int, b: int, stages: int) -> int:
        return self._saved[b] - self._saved[a] + sum(self.ends[p][1]
                                                     for p in self.parts(k, stages))

    def params(self, k: int, a: int, b: int, stages: int) -> int:
        here = set(range(a, b)) | set(self.parts(k, stages))
        return self.owned[b] - self.owned[a] + sum(
            numel for numel, readers in self.outside.values() if readers & here)


class _Stages:
    """Memory of a stage at the chosen schedule and state settings."""

    def __init__(self, units: _Units, *, pp, per_rank, microbatches, schedule, dtype, shard,
                 optimizer):
        self.units, self.stages = units, pp * per_rank
        self.pp, self.per_rank, self.m, self.schedule = pp, per_rank, microbatches, schedule
        self.dtype, self.shard, self.optimizer = dtype, shard, optimizer

    def state(self, k: int, a: int, b: int) -> tuple[int, int, int]:
        return elements_state(self.units.params(k, a, b, self.stages), self.dtype,
                              shard=self.shard, optimizer=self.optimizer)

    def activations(self, k: int, a: int, b: int) -> int:
        flight = in_flight(k, self.pp, self.per_rank, self.m, self.schedule)
        return flight * self.units.saved_bytes(k, a, b, self.stages)

    def memory(self, k: int, a: int, b: int) -> int:
        return sum(self.state(k, a, b)) + self.activations(k, a, b)

    def time(self, k: int, a: int, b: int) -> int:
        return self.units.time(k, a, b, self.stages)


def estimate_pipeline(plan, model: nn.Module, captured, ann, args, kwargs, *, pp: int,
                      schedule: str, microbatches: int, per_rank: int, layers: str,
                      dtype: torch.dtype, shard: int, recompute: bool, optimizer: str | None,
                      memory_limit: int | None) -> PipelineEstimate:
    """The stages of ``plan``'s model cut by cost under ``memory_limit`` bytes per rank
    (see the module docstring); the arguments checked (``check_schedule``,
    ``check_microbatches``)."""
    n = block_count(model, layers)
    names = [f"{layers}.{i}" for i in range(n)]
    one = [_microbatch(a, microbatches) for a in args]
    run = fake_run(model, captured, ann, one, {k: _microbatch(v, microbatches)
                                              for k, v in kwargs.items()},
                   names=names, recomputed=set(names) if recompute else set(), dtype=dtype,
                   split_outside=True)
    units = _Units(plan, run, captured, layers, n, recompute)
    cut = _Stages(units, pp=pp, per_rank=per_rank, microbatches=microbatches,
                  schedule=schedule, dtype=dtype, shard=shard, optimizer=optimizer)
    count = pp * per_rank
    share = None if memory_limit is None else memory_limit / per_rank
    starts = partition(n, count, cut.time, None if share is None else
                       lambda k, a, b: cut.memory(k, a, b) <= share)
    overflow = None
    if starts is None:  # nothing fits: the cut needing least memory, and by how much not
        starts = partition(n, count, cut.memory)
        assert starts is not None and share is not None  # only a limit leaves no cut
        overflow = _overflow(cut, starts, n, share, layers)
    return _estimate(cut, starts, n, memory_limit, overflow, layers)


def _microbatch(x, microbatches: int):
    """The first of ``microbatches`` pieces of a batch input (its first dimension)."""
    if isinstance(x, torch.Tensor) and x.dim():
        return x[: x.shape[0] // microbatches]
    return x


def _ranges(starts: list[int], n: int) -> list[tuple[int, int]]:
    return list(zip(starts, [*starts[1:], n]))


def _overflow(cut: _Stages, starts: list[int], n: int, share: float, layers: str) -> str:
    """What the stage that needs most memory in the least-memory cut needs, over its
    share of the limit."""
    need = [cut.memory(k, a, b) for k, (a, b) in enumerate(_ranges(starts, n))]
    k = max(range(len(need)), key=need.__getitem__)
    a, b = _ranges(starts, n)[k]
    over = need[k] - share
    return (f"no cut of the {n} blocks of {layers!r} into {cut.stages} stages fits "
            f"{_size(share)} per stage: the cut needing least memory puts {_size(need[k])} "
            f"on stage {k} (blocks {a}-{b - 1}), {_size(over)} over")


def _size(n: float) -> str:
    """``1.50 MiB``, ``12.00 KiB`` or ``900 B``."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _estimate(cut: _Stages, starts: list[int], n: int, memory_limit: int | None,
              overflow: str | None, layers: str) -> PipelineEstimate:
    ranges = _ranges(starts, n)
    total = sum(cut.time(k, a, b) for k, (a, b) in enumerate(ranges)) or 1
    rank_peaks = [0] * cut.pp
    stages = []
    for k, (a, b) in enumerate(ranges):
        params, grads, state = cut.state(k, a, b)
        peak = params + grads + state + cut.activations(k, a, b)
        rank = rank_of(k, cut.pp, cut.schedule)
        rank_peaks[rank] += peak
        stages.append(StageEstimate(
            index=k, pp_rank=rank, blocks=[a, b], embedding=k == 0, head=k == len(ranges) - 1,
            params=cut.units.params(k, a, b, cut.stages), param_bytes=params, grad_bytes=grads,
            optimizer_bytes=state, flops=cut.time(k, a, b),
            time_share=cut.time(k, a, b) / total,
            in_flight=in_flight(k, cut.pp, cut.per_rank, cut.m, cut.schedule),
            activations_per_microbatch=cut.units.saved_bytes(k, a, b, cut.stages),
            activations=cut.activations(k, a, b), peak=peak))
    if memory_limit is not None:
        for s in stages:
            s.fits = rank_peaks[s.pp_rank] <= memory_limit
    return PipelineEstimate(
        pp=cut.pp, schedule=cut.schedule, microbatches=cut.m, virtual_stages=cut.per_rank,
        layers=layers, blocks=n, bubble=bubble(cut.pp, cut.per_rank, cut.m, cut.schedule),
        memory_limit=memory_limit, stages=stages, rank_peaks=rank_peaks, overflow=overflow)
