"""The one owner of the parallel dimensions and the device mesh.

``ParallelDims(tp=2, dp=2)`` is a small immutable value: the size of each
parallel dimension, validated. Its mesh puts the dimensions outer to inner
as torchtitan does, data-parallel outside and tensor-parallel inside, so the
ranks of one TP group are neighbours (rank = dp_rank * tp + tp_rank)::

    dims = ParallelDims.for_world(world, tp=2).with_mesh("cpu")   # ("dp", "tp") mesh
    sharded = shardplan.parallelize(model, mesh=dims.mesh)
    average_gradients(sharded.parameters(), dims.dp_group)

or from a mesh the caller built (its dim names must include "tp"; a "dp"
dim, if present, is the data-parallel one): ``ParallelDims.from_mesh(mesh)``.

Only the dimensions shardplan implements are here. FSDP2's sharded data
parallelism, pipeline and context parallelism will each add a field and a
mesh dimension when they are built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .errors import ConfigurationError
from .layouts import MeshLayout, Placement, Replicate
from .runtime.comm import Group, TorchGroup

#: the mesh dimensions, outer to inner
MESH_DIMS = ("dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel dimensions, and (once built or given) their ``DeviceMesh``."""

    tp: int = 1
    dp: int = 1
    mesh: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in MESH_DIMS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigurationError(f"{name}={v!r} must be a positive int",
                                         where="ParallelDims",
                                         fix=f"pass {name} as the number of ranks along it (>= 1)")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int | None = None,
                  dp: int | None = None) -> ParallelDims:
        """Dims that fill ``world_size`` ranks; a size left out takes the rest
        (both left out: every rank in one TP group)."""
        if tp is None and dp is None:
            tp = world_size
        for name, v in (("tp", tp), ("dp", dp)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigurationError(f"{name}={v!r} must be a positive int",
                                         where="ParallelDims",
                                         fix=f"pass {name} as the number of ranks along it")
        dims = cls(tp=tp if tp is not None else max(1, world_size // dp),
                   dp=dp if dp is not None else max(1, world_size // tp))
        dims.check_world(world_size)
        return dims

    @classmethod
    def from_mesh(cls, mesh) -> ParallelDims:
        """The dims of a ``DeviceMesh`` whose dimension names include "tp" (and maybe "dp")."""
        names = tuple(mesh.mesh_dim_names or ())
        extra = sorted(set(names) - set(MESH_DIMS))
        if "tp" not in names or extra:
            raise ConfigurationError(
                f"the device mesh has dimensions {list(names) or '(unnamed)'}; shardplan needs "
                f"a 'tp' dimension and knows only {list(MESH_DIMS)}", where="mesh",
                fix='build it with init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp")) '
                    'or ParallelDims(tp=..., dp=...).with_mesh(device)')
        sizes = dict(zip(names, mesh.shape))
        return cls(tp=sizes["tp"], dp=sizes.get("dp", 1), mesh=mesh)

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, n) for n in MESH_DIMS)

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ConfigurationError(
                f"dp={self.dp} x tp={self.tp} = {self.world_size} ranks, but the world has "
                f"{world_size}", where="ParallelDims",
                fix="launch dp * tp processes (torchrun --nproc-per-node), or pass a tp and dp "
                    "whose product is the world size")

    @staticmethod
    def layout(tp: Placement) -> MeshLayout:
        """The mesh layout of a tensor placed as ``tp`` over the TP group: data-parallel
        replicas each hold all of it."""
        return MeshLayout(tuple((n, tp if n == "tp" else Replicate()) for n in MESH_DIMS))

    def with_mesh(self, device_type: str = "cpu") -> ParallelDims:
        """These dims with their ("dp", "tp") mesh over the default process group's world."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        if not dist.is_initialized():
            raise ConfigurationError("building a device mesh needs an initialized process group",
                                     fix="call torch.distributed.init_process_group() first "
                                         "(torchrun does it for shardplan.train)")
        self.check_world(dist.get_world_size())
        mesh = init_device_mesh(device_type, tuple(getattr(self, n) for n in MESH_DIMS),
                                mesh_dim_names=MESH_DIMS)
        return replace(self, mesh=mesh)

    def group(self, name: str) -> Group:
        """This rank's shardplan ``Group`` along mesh dimension ``name`` (its ``.pg`` is
        the ``torch.distributed`` process group)."""
        if self.mesh is None:
            raise ConfigurationError("these ParallelDims have no device mesh",
                                     where="ParallelDims", fix="call .with_mesh(device_type) "
                                                               "or use ParallelDims.from_mesh(mesh)")
        if name not in (self.mesh.mesh_dim_names or ()):
            raise ConfigurationError(f"the device mesh has no {name!r} dimension",
                                     where="ParallelDims",
                                     fix=f"use one of {list(self.mesh.mesh_dim_names)}, or build "
                                         "the mesh with .with_mesh(device_type)")
        return TorchGroup(self.mesh.get_group(name))

    @property
    def tp_group(self) -> Group:
        return self.group("tp")

    @property
    def dp_group(self) -> Group:
        return self.group("dp")
