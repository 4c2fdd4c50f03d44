"""``parallelize``: a model and a process group (or mesh) -> its ``ShardedModule``.

The package's other entry points live beside the stages they drive: ``plan`` in
``planner/plan.py`` and ``verify`` in ``verify.py`` (all three exported by ``shardplan``)."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from .runtime.consistency import assert_same_across
from .errors import ConfigurationError
from .planner.inputs import check_model_arg, example_args
from .planner.rules import load_rules
from .parallel.fsdp import fsdp_options
from .parallel_dims import ParallelDims
from .planner.recompute import block_names
from .runtime.comm import Group, as_group
from .sharded import ShardedModule


def parallelize(model: nn.Module, tp: int | None = None, *, group=None, mesh=None,
                example_inputs=None, rules="megatron", gather_output: bool = True,
                strict: bool = False, check_model: bool = True,
                recompute=False, sequence_parallel: bool = False,
                compile=False, fsdp=False) -> ShardedModule:
    """Megatron tensor parallelism for ``model`` over a process group.

    Returns a module with the same call signature holding only this rank's
    shards; ``.plan`` says what was decided. ``group`` is a
    ``torch.distributed`` process group (default: the world) or a shardplan
    ``Group``; with ``mesh`` (a ``DeviceMesh`` with a "tp" dimension, e.g.
    ``ParallelDims(tp=2, dp_replicate=2).with_mesh("cpu").mesh``; see
    ``parallel_dims``), its "tp" dimension.
    ``check_model`` first compares a checksum of every parameter across the
    ranks (one small broadcast and all-reduce): shards of different models
    would train silently wrong. ``recompute`` recomputes activations in
    backward per block instead of keeping them: ``True`` for every element of
    every ``nn.ModuleList`` (the layers), or module names / glob patterns.
    ``sequence_parallel`` holds the activations between the parallel regions
    (norms, dropouts, residual adds) on 1/tp of the sequence per rank: the
    regions' all-reduces become reduce-scatters and all-gathers; the sequence
    length must divide by tp.
    ``compile`` runs each rewritten graph under ``torch.compile`` with
    ``fullgraph=True`` (``True``: inductor; or a backend name such as
    ``"aot_eager"``): each block (torchtitan's per-block compile) when
    ``recompute`` or ``fsdp`` cut the graph into blocks, else the whole graph;
    it needs a ``torch.distributed`` process group. The plan is the same either
    way; ``sharded.compiled_units`` lists what was compiled.

    ``fsdp``: also shard over the mesh's "dp_shard" dimension with FSDP2
    (``fully_shard`` per block, every element of every ``nn.ModuleList``, then
    the root): ``True`` or a dict of ``fully_shard`` options (``mp_policy``,
    ``reshard_after_forward``, ``offload_policy``). With a "dp_replicate"
    dimension too it is FSDP2's hybrid sharding (HSDP): shards over
    dp_shard, replicas of them along dp_replicate (``ParallelDims.fsdp_mesh``).
    The parameters are then FSDP2's ``DTensor`` shards of this rank's TP
    shards; the TP layout stays in each one's ``ParallelSpec``
    (``layouts.spec_of``). A ``("dp", "tp")`` mesh's "dp" is dp_shard here.
    """
    check_model_arg(model)
    dims = None if mesh is None else ParallelDims.from_mesh(mesh, fsdp=_fsdp_on(fsdp))
    grp = _group(group, dims)
    if tp is not None and tp != grp.size:
        raise ConfigurationError(
            f"tp={tp} but the process group has {grp.size} ranks",
            fix="pass tp equal to the group size, or a group (or mesh) of tp ranks")
    _check_devices(model)
    if compile and not grp.traceable:
        raise ConfigurationError(
            f"compile={compile!r} needs a torch.distributed process group; "
            f"{type(grp).__name__} collectives cannot be traced",
            fix="run on real ranks (torchrun, or shardplan.ranks.RealRanks), or pass compile=False")
    if check_model:
        assert_same_across(grp, dict(model.named_parameters()),
                           what=f"{type(model).__name__} is not the same model on every rank",
                           fix="build the model identically on every rank (same seed or the same "
                               "checkpoint) before parallelize, or pass check_model=False")
    fsdp_blocks, options, fsdp_mesh = _fsdp_plan(model, fsdp, dims, recompute)
    example = example_args(model, example_inputs)
    sharded = ShardedModule(model, grp, load_rules(rules), example=example,
                            gather_output=gather_output, strict=strict, recompute=recompute,
                            sequence_parallel=sequence_parallel, compile=compile,
                            fsdp_blocks=fsdp_blocks)
    if fsdp_blocks:
        sharded.shard_data_parallel(fsdp_mesh, options)
    return sharded


def _fsdp_on(fsdp) -> bool:
    return fsdp is not False and fsdp is not None


def _fsdp_plan(model: nn.Module, fsdp, dims: ParallelDims | None,
               recompute) -> tuple[list[str], dict, object]:
    """(the blocks FSDP2 shards, its options, the mesh it shards over); nothing for
    ``fsdp=False``."""
    if not _fsdp_on(fsdp):
        if dims is not None and dims.dp_shard > 1:
            raise ConfigurationError(
                f"the device mesh has dp_shard={dims.dp_shard} (FSDP2's shards) but fsdp is "
                "off", where="parallelize",
                fix="pass fsdp=True, or build the mesh with dp_replicate for plain data "
                    "parallelism")
        return [], {}, None
    options = fsdp_options(fsdp)
    if dims is None:
        raise ConfigurationError(
            "fsdp needs a device mesh with 'dp_shard' and 'tp' dimensions, got no mesh",
            where="parallelize",
            fix="pass mesh=ParallelDims(tp=..., dp_shard=...).with_mesh(device).mesh")
    mesh = dims.fsdp_mesh
    dims.check_world(dist.get_world_size())
    if recompute not in (False, True):
        raise ConfigurationError(
            f"fsdp with recompute={recompute!r}: FSDP2 shards every block, and recomputation "
            "can only follow the same blocks", where="parallelize",
            fix="pass recompute=True (every block) or False")
    return block_names(model, True), options, mesh


def _check_devices(model: nn.Module) -> None:
    """Every tensor on one device; but a model whose parameters all wait on meta for a
    checkpoint (``checkpoint.parameters_on_meta``) may hold real buffers."""
    params = list(model.named_parameters())
    waiting = bool(params) and all(t.is_meta for _, t in params)
    devices = {}
    for name, t in [*([] if waiting else params), *model.named_buffers()]:
        if not (waiting and t.is_meta):
            devices.setdefault(t.device, name)
    if len(devices) > 1:
        listed = ", ".join(f"{n} on {d}" for d, n in devices.items())
        raise ConfigurationError(
            f"{type(model).__name__} has tensors on several devices ({listed})",
            where=type(model).__name__,
            fix="move the whole model to one device (model.to(device)) before parallelize")


def _group(group, dims: ParallelDims | None) -> Group:
    if dims is not None:
        if group is not None:
            raise ConfigurationError("both group and mesh were given",
                                     fix="pass one: the mesh's 'tp' dimension is the group")
        return dims.tp_group
    return as_group(group)
