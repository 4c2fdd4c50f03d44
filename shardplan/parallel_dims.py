"""The one owner of the parallel dimensions and the device mesh.

``ParallelDims`` is a small immutable value: the size of each parallel
dimension (``layouts.MeshDim``), validated, outer to inner as torchtitan
orders them: ``pp`` (pipeline stages), ``dp_replicate`` (data-parallel
replicas: plain data parallelism, or HSDP's replicate dimension),
``dp_shard`` (FSDP2's shards), ``cp`` (context parallelism: reserved, must
be 1) and ``tp``. Ranks are numbered row-major over that order, so the
ranks of one TP group are neighbours::

    dims = ParallelDims.for_world(world, tp=2).with_mesh("cpu")        # replicas x tp
    average_gradients(sharded.parameters(), dims.group(MeshDim.DP_REPLICATE))

    dims = ParallelDims.for_world(8, tp=2, dp_shard=2).with_mesh("cpu")  # HSDP: 2 x 2 x tp 2
    sharded = shardplan.parallelize(model, mesh=dims.mesh, fsdp=True)

**The mesh.** As torchtitan's, it holds only the dimensions of size > 1,
except two that are always there: ``tp`` (the rewriter's group, even of
one rank) and ``dp_shard`` (FSDP2 shards over it at any size, so
``fsdp=True`` works with one data-parallel rank too). The data-parallel
sub-mesh FSDP2 takes is ``fsdp_mesh``: ``mesh["dp_replicate", "dp_shard"]``
(hybrid sharding) when there are replicas, else ``mesh["dp_shard"]``. No
flattened data-parallel group is built (DeviceMesh's flattening is
private): averaging over every data-parallel rank all-reduces over each
of ``dp_groups`` in turn, and ``dp_rank`` numbers the data-parallel ranks.

``from_mesh(mesh)`` reads a mesh the caller built: its dimension names are
``MeshDim`` names in that order, "tp" among them; a dimension left out has
size 1. A mesh of the single data-parallel dimension "dp" (``("dp", "tp")``,
as shardplan built them before HSDP) still works: its "dp" is FSDP2's
``dp_shard`` when ``from_mesh(mesh, fsdp=True)`` (``parallelize(fsdp=True)``)
and ``dp_replicate`` otherwise; ``data_parallel(dp=...)`` is the same alias
for sizes (the trainer's and the planner's ``--dp``).

No module but this one reads a mesh dimension's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from .errors import ConfigurationError
from .layouts import MeshDim, MeshLayout, Placement, Replicate
from .runtime.comm import Group, TorchGroup

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: the parallel dimensions, outer to inner
ORDER = tuple(MeshDim)
#: the data-parallel dimensions, outer to inner
DATA_PARALLEL = (MeshDim.DP_REPLICATE, MeshDim.DP_SHARD)
#: the dimensions a mesh built by ``with_mesh`` has whatever their size
ALWAYS_IN_MESH = (MeshDim.DP_SHARD, MeshDim.TP)
#: the one data-parallel dimension of a mesh built before HSDP (see the module docstring)
LEGACY_DP = "dp"


def _check_size(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigurationError(f"{name}={v!r} must be a positive int", where="ParallelDims",
                                 fix=f"pass {name} as the number of ranks along it (>= 1)")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Sizes of the parallel dimensions, and (once built or given) their ``DeviceMesh``."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    #: (dimension, its name in ``mesh``) of each dimension the mesh has, outer to inner
    mesh_names: tuple[tuple[MeshDim, str], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        for dim in ORDER:
            _check_size(dim.value, self.size(dim))
        if self.cp != 1:
            raise ConfigurationError(
                f"cp={self.cp}: context parallelism is not yet planned by shardplan",
                where="ParallelDims",
                fix="pass cp=1 (the default); to hold activations on 1/tp of the sequence use "
                    "parallelize(sequence_parallel=True)")

    def size(self, dim: MeshDim) -> int:
        return getattr(self, MeshDim(dim).value)

    @classmethod
    def for_world(cls, world_size: int, *, tp: int | None = None, dp_shard: int | None = None,
                  dp_replicate: int | None = None, pp: int = 1, cp: int = 1) -> ParallelDims:
        """Dims that fill ``world_size`` ranks. The rest goes to ``tp`` when it is left
        out (all three left out: every rank in one TP group), else to the data-parallel
        size left out, ``dp_replicate`` when both are (plain data parallelism; pass
        ``dp_shard`` for FSDP2); a size left out that does not take the rest is 1."""
        sizes = {"tp": tp, "dp_replicate": dp_replicate, "dp_shard": dp_shard}
        for name, v in (*sizes.items(), ("pp", pp), ("cp", cp)):
            if v is not None:
                _check_size(name, v)
        rest = next((name for name, v in sizes.items() if v is None), None)
        fixed = pp * cp * math.prod(v for v in sizes.values() if v is not None)
        given = {name: 1 if v is None else v for name, v in sizes.items()}
        if rest is not None:
            given[rest] = max(1, world_size // fixed)
        dims = cls(pp=pp, dp_replicate=given["dp_replicate"], dp_shard=given["dp_shard"], cp=cp,
                   tp=given["tp"])
        dims.check_world(world_size)
        return dims

    @staticmethod
    def data_parallel(*, dp: int | None = None, dp_replicate: int | None = None,
                      dp_shard: int | None = None, fsdp: bool = False) -> dict:
        """``{"dp_replicate": ..., "dp_shard": ...}`` (None where unset) from the two
        sizes, or from the single ``dp`` of before HSDP: FSDP2's shards with ``fsdp``,
        else replicas."""
        if dp is None:
            return {"dp_replicate": dp_replicate, "dp_shard": dp_shard}
        if dp_replicate is not None or dp_shard is not None:
            raise ConfigurationError(
                f"dp={dp} with dp_replicate={dp_replicate}, dp_shard={dp_shard}",
                where="dp", fix="pass dp (the shards with fsdp, else the replicas) or "
                                "dp_replicate and dp_shard, not both")
        return {"dp_replicate": None, "dp_shard": dp} if fsdp else \
            {"dp_replicate": dp, "dp_shard": None}

    @classmethod
    def from_mesh(cls, mesh, *, fsdp: bool = False) -> ParallelDims:
        """The dims of a ``DeviceMesh`` whose dimension names are ``MeshDim`` names,
        "tp" among them, outer to inner (or the ``("dp", "tp")`` of before HSDP; its "dp"
        is ``dp_shard`` with ``fsdp``, else ``dp_replicate``)."""
        names = tuple(mesh.mesh_dim_names or ())
        dims = [d for d in (_as_dim(n, fsdp) for n in names) if d is not None]
        order = [ORDER.index(d) for d in dims]
        mixed = LEGACY_DP in names and any(d.value in names for d in DATA_PARALLEL)
        if MeshDim.TP.value not in names or len(dims) != len(names) \
                or order != sorted(set(order)) or mixed:
            raise ConfigurationError(
                f"the device mesh has dimensions {list(names) or '(unnamed)'}; shardplan needs "
                f"a 'tp' dimension and knows only {[d.value for d in ORDER]}, in that order "
                f"(or the legacy {LEGACY_DP!r} for a single data-parallel dimension)",
                where="mesh",
                fix='build it with ParallelDims(tp=..., dp_shard=...).with_mesh(device), or '
                    'init_device_mesh(device, (dp_replicate, dp_shard, tp), '
                    'mesh_dim_names=("dp_replicate", "dp_shard", "tp"))')
        sizes = {d.value: s for d, s in zip(dims, mesh.shape)}
        return cls(**sizes, mesh=mesh, mesh_names=tuple(zip(dims, names)))

    @property
    def world_size(self) -> int:
        return math.prod(self.size(d) for d in ORDER)

    @property
    def dp(self) -> int:
        """The data-parallel size: how many different batches a step reads."""
        return self.dp_replicate * self.dp_shard

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            product = " x ".join(f"{d.value}={self.size(d)}" for d in ORDER)
            raise ConfigurationError(
                f"{product} = {self.world_size} ranks, but the world has {world_size}",
                where="ParallelDims",
                fix="launch as many processes as the product (torchrun --nproc-per-node), or "
                    "pass sizes whose product is the world size")

    @staticmethod
    def layout(tp: Placement) -> MeshLayout:
        """The mesh layout of a tensor placed as ``tp`` over the TP group: every
        data-parallel rank holds all of it (FSDP2's shards are its ``DTensor``'s)."""
        return MeshLayout(tuple((d.value, tp if d is MeshDim.TP else Replicate())
                                for d in (*DATA_PARALLEL, MeshDim.TP)))

    def with_mesh(self, device_type: str = "cpu") -> ParallelDims:
        """These dims with their mesh (see the module docstring) over the default process
        group's world."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        if not dist.is_initialized():
            raise ConfigurationError("building a device mesh needs an initialized process group",
                                     fix="call torch.distributed.init_process_group() first "
                                         "(torchrun does it for shardplan.train)")
        self.check_world(dist.get_world_size())
        dims = [d for d in ORDER if self.size(d) > 1 or d in ALWAYS_IN_MESH]
        mesh = init_device_mesh(device_type, tuple(self.size(d) for d in dims),
                                mesh_dim_names=tuple(d.value for d in dims))
        return replace(self, mesh=mesh, mesh_names=tuple((d, d.value) for d in dims))

    def _name(self, dim: MeshDim) -> str | None:
        """``dim``'s name in the mesh; None if the mesh has no such dimension."""
        return next((n for d, n in self.mesh_names if d is dim), None)

    def _need_mesh(self) -> DeviceMesh:
        if self.mesh is None:
            raise ConfigurationError("these ParallelDims have no device mesh",
                                     where="ParallelDims",
                                     fix="call .with_mesh(device_type) or use "
                                         "ParallelDims.from_mesh(mesh)")
        return self.mesh

    def group(self, dim: MeshDim) -> Group:
        """This rank's shardplan ``Group`` along ``dim`` (its ``.pg`` is the
        ``torch.distributed`` process group)."""
        mesh = self._need_mesh()
        dim = MeshDim(dim)
        name = self._name(dim)
        if name is None:
            raise ConfigurationError(
                f"the device mesh has no {dim.value!r} dimension (size {self.size(dim)}), only "
                f"{[n for _, n in self.mesh_names]}", where="ParallelDims",
                fix=f"check the size first (dims.{dim.value} > 1), or build the mesh with it")
        return TorchGroup(mesh.get_group(name))

    @property
    def tp_group(self) -> Group:
        return self.group(MeshDim.TP)

    @property
    def dp_groups(self) -> tuple[Group, ...]:
        """This rank's groups along the data-parallel dimensions of more than one rank,
        outer to inner: all-reduce over each in turn to sum over every data-parallel rank."""
        return tuple(self.group(d) for d in DATA_PARALLEL if self.size(d) > 1)

    @property
    def dp_rank(self) -> int:
        """This rank's place among the ``dp`` data-parallel ranks (replica-major), which
        picks its rows of the global batch."""
        mesh = self._need_mesh()
        rank = 0
        for d in DATA_PARALLEL:
            name = self._name(d)
            rank = rank * self.size(d) + (mesh.get_local_rank(name) if name else 0)
        return rank

    @property
    def fsdp_mesh(self):
        """The data-parallel sub-mesh FSDP2 shards over: ``(dp_replicate, dp_shard)``
        (hybrid sharding: shards over dp_shard, replicas along dp_replicate) when the mesh
        has replicas, else ``dp_shard`` alone."""
        mesh = self._need_mesh()
        shard, replicate = self._name(MeshDim.DP_SHARD), self._name(MeshDim.DP_REPLICATE)
        if shard is None:
            raise ConfigurationError(
                f"fsdp needs a device mesh with a 'dp_shard' dimension (FSDP2's shards), got "
                f"{[n for _, n in self.mesh_names]}", where="parallelize",
                fix="pass mesh=ParallelDims(tp=..., dp_shard=...).with_mesh(device).mesh")
        return mesh[(replicate, shard)] if replicate else mesh[shard]


def _as_dim(name: str, fsdp: bool) -> MeshDim | None:
    """The dimension a mesh's dimension ``name`` is; None for a name shardplan does not know."""
    if name == LEGACY_DP:
        return MeshDim.DP_SHARD if fsdp else MeshDim.DP_REPLICATE
    try:
        return MeshDim(name)
    except ValueError:
        return None
