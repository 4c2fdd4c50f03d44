"""ParallelDims: validation, the mesh it builds, meshes it reads, and the groups it hands out.

Meshes are built on torch's in-process fake process group (one process that
plays rank r of a world of n: collectives do nothing, group sizes and ranks
are real), so an 8-rank mesh is checked without spawning 8 processes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardplan import ConfigurationError
from shardplan.layouts import MeshDim, MeshLayout, Replicate, Shard
from shardplan.parallel_dims import ParallelDims


@contextlib.contextmanager
def fake_world(rank: int, size: int):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sizes(dims) -> tuple[int, ...]:
    return dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp


@pytest.mark.parametrize("kwargs", [{"tp": 0}, {"dp_shard": -1}, {"dp_replicate": 2.0},
                                    {"pp": True}, {"tp": "2"}, {"cp": 0}])
def test_sizes_must_be_positive_ints(kwargs):
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ConfigurationError, match=f"{name}={value!r} must be a positive int"):
        ParallelDims(**kwargs)
    with pytest.raises(ConfigurationError, match="must be a positive int"):
        ParallelDims.for_world(8, **kwargs)


def test_context_parallelism_is_reserved():
    with pytest.raises(ConfigurationError, match="cp=2: context parallelism is not yet planned") \
            as e:
        ParallelDims(cp=2, tp=2)
    assert "cp=1" in e.value.fix
    with pytest.raises(ConfigurationError, match="context parallelism"):
        ParallelDims.for_world(4, tp=2, cp=2)


@pytest.mark.parametrize("world,kwargs,want", [
    (8, {}, (1, 1, 1, 1, 8)),                                  # every rank one TP group
    (8, {"tp": 2}, (1, 4, 1, 1, 2)),                           # the rest: replicas
    (8, {"dp_replicate": 4}, (1, 4, 1, 1, 2)),                 # the rest: tp
    (8, {"dp_shard": 4}, (1, 1, 4, 1, 2)),
    (8, {"tp": 2, "dp_shard": 2}, (1, 2, 2, 1, 2)),            # HSDP: the rest replicas
    (8, {"tp": 2, "dp_replicate": 2}, (1, 2, 2, 1, 2)),        # HSDP: the rest shards
    (8, {"tp": 1, "dp_replicate": 2, "dp_shard": 4}, (1, 2, 4, 1, 1)),
    (8, {"tp": 2, "pp": 2}, (2, 2, 1, 1, 2)),
    (1, {}, (1, 1, 1, 1, 1)),
])
def test_for_world_fills_the_missing_size(world, kwargs, want):
    dims = ParallelDims.for_world(world, **kwargs)
    assert _sizes(dims) == want and dims.world_size == world
    assert dims.dp == want[1] * want[2]


@pytest.mark.parametrize("world,kwargs,product", [
    (8, {"tp": 3}, "pp=1 x dp_replicate=2 x dp_shard=1 x cp=1 x tp=3 = 6"),
    (8, {"tp": 2, "dp_shard": 2, "dp_replicate": 1}, "dp_replicate=1 x dp_shard=2 x cp=1 x tp=2 = 4"),
    (4, {"tp": 8}, "tp=8 = 8"),
    (6, {"dp_shard": 4}, "dp_shard=4 x cp=1 x tp=1 = 4"),
])
def test_dims_that_do_not_fill_the_world(world, kwargs, product):
    with pytest.raises(ConfigurationError, match=f"the world has {world}") as e:
        ParallelDims.for_world(world, **kwargs)
    assert product in str(e.value) and "nproc-per-node" in e.value.fix


@pytest.mark.parametrize("kwargs,want", [
    ({"dp": 4}, {"dp_replicate": 4, "dp_shard": None}),
    ({"dp": 4, "fsdp": True}, {"dp_replicate": None, "dp_shard": 4}),
    ({"dp_replicate": 2, "dp_shard": 2}, {"dp_replicate": 2, "dp_shard": 2}),
    ({}, {"dp_replicate": None, "dp_shard": None}),
])
def test_the_dp_alias(kwargs, want):
    assert ParallelDims.data_parallel(**kwargs) == want


def test_the_dp_alias_with_the_sizes_is_refused():
    with pytest.raises(ConfigurationError, match="dp=2 with dp_replicate=None, dp_shard=2") as e:
        ParallelDims.data_parallel(dp=2, dp_shard=2)
    assert "not both" in e.value.fix


@pytest.mark.parametrize("rank", [0, 3, 5, 7])
def test_mesh_is_replicas_shards_tp_outer_to_inner(rank):
    """rank = (replica * dp_shard + shard) * tp + tp_rank, as torchtitan lays it out."""
    with fake_world(rank, 8):
        dims = ParallelDims.for_world(8, tp=2, dp_shard=2).with_mesh("cpu")
        assert dims.mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
        assert tuple(dims.mesh.shape) == (2, 2, 2)
        tp, (rep, shard) = dims.tp_group, dims.dp_groups
        assert (rep.size, shard.size, tp.size) == (2, 2, 2)
        replica, rest = divmod(rank, 4)
        assert (rep.rank, shard.rank, tp.rank) == (replica, rest // 2, rest % 2)
        assert dims.dp_rank == rank // 2
        assert dist.get_process_group_ranks(tp.pg) == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert dist.get_process_group_ranks(shard.pg) == [replica * 4 + rank % 2,
                                                          replica * 4 + rank % 2 + 2]
        assert dist.get_process_group_ranks(rep.pg) == [rank % 4, rank % 4 + 4]
        assert dims.fsdp_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
        assert ParallelDims.from_mesh(dims.mesh) == dims


def test_mesh_leaves_out_dims_of_one_rank_but_dp_shard_and_tp():
    """As torchtitan: only dims > 1, but tp (the rewriter's group) and dp_shard (FSDP2's)."""
    with fake_world(1, 4):
        dims = ParallelDims.for_world(4, tp=2).with_mesh("cpu")
        assert dims.mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
        assert tuple(dims.mesh.shape) == (2, 1, 2)
        assert [g.size for g in dims.dp_groups] == [2]  # the replicas; one shard is no group
        fsdp = ParallelDims.for_world(4, tp=4).with_mesh("cpu")
        assert fsdp.mesh.mesh_dim_names == ("dp_shard", "tp") and fsdp.dp_groups == ()
        assert fsdp.fsdp_mesh.mesh_dim_names == ("dp_shard",) and fsdp.dp_rank == 0
        with pytest.raises(ConfigurationError, match="no 'dp_replicate' dimension \\(size 1\\)"):
            fsdp.group(MeshDim.DP_REPLICATE)


def test_with_mesh_checks_the_world():
    with fake_world(0, 4), pytest.raises(ConfigurationError, match="the world has 4"):
        ParallelDims(tp=2).with_mesh("cpu")


def test_with_mesh_needs_a_process_group():
    with pytest.raises(ConfigurationError, match="initialized process group"):
        ParallelDims(tp=1).with_mesh("cpu")


def test_groups_need_a_mesh():
    with pytest.raises(ConfigurationError, match="no device mesh"):
        ParallelDims(tp=2).tp_group


def test_from_mesh_with_only_tp():
    with fake_world(1, 4):
        dims = ParallelDims.from_mesh(init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)))
        assert _sizes(dims) == (1, 1, 1, 1, 4) and (dims.tp_group.size, dims.tp_group.rank) == (4, 1)
        assert dims.dp_groups == () and dims.dp_rank == 0
        with pytest.raises(ConfigurationError, match="fsdp needs a device mesh with a 'dp_shard'"):
            dims.fsdp_mesh


@pytest.mark.parametrize("fsdp,dim", [(False, MeshDim.DP_REPLICATE), (True, MeshDim.DP_SHARD)])
def test_a_legacy_dp_mesh(fsdp, dim):
    """A ("dp", "tp") mesh of before HSDP: "dp" is the replicas, or FSDP2's shards."""
    with fake_world(5, 8):
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        dims = ParallelDims.from_mesh(mesh, fsdp=fsdp)
        assert dims.size(dim) == 4 and dims.tp == 2 and dims.dp == 4
        assert dims.group(dim).size == 4 and dims.group(dim).rank == 2 and dims.dp_rank == 2
        if fsdp:
            assert dims.fsdp_mesh.mesh_dim_names == ("dp",)


@pytest.mark.parametrize("shape,names", [
    ((4,), None), ((4,), ("dp",)),                             # no tp
    ((2, 2), ("data", "tp")),                                  # a name shardplan does not know
    ((2, 2), ("tp", "pp")), ((2, 2, 1), ("dp_shard", "dp_replicate", "tp")),  # out of order
    ((2, 2, 1), ("dp", "dp_shard", "tp")),                     # the legacy dp and a new one
])
def test_from_mesh_refuses_other_dims(shape, names):
    with fake_world(0, 4):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        with pytest.raises(ConfigurationError, match="needs a 'tp' dimension and knows only") \
                as e:
            ParallelDims.from_mesh(mesh)
        assert "mesh_dim_names" in e.value.fix


def test_from_mesh_refuses_context_parallelism():
    with fake_world(0, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
        with pytest.raises(ConfigurationError, match="cp=2: context parallelism"):
            ParallelDims.from_mesh(mesh)


def test_parallelize_refuses_a_mesh_without_tp():
    import torch.nn as nn

    import shardplan
    with fake_world(0, 2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(ConfigurationError, match="needs a 'tp' dimension"):
            shardplan.parallelize(nn.Linear(4, 4), mesh=mesh, check_model=False)


def test_parallelize_refuses_shards_without_fsdp():
    import torch.nn as nn

    import shardplan
    with fake_world(0, 4):
        mesh = ParallelDims(dp_shard=2, tp=2).with_mesh("cpu").mesh
        with pytest.raises(ConfigurationError, match="dp_shard=2 .* but fsdp is off") as e:
            shardplan.parallelize(nn.Linear(4, 4), mesh=mesh, check_model=False)
    assert "fsdp=True" in e.value.fix


def test_layout_of_a_tp_placement():
    """Every data-parallel rank holds a tensor's TP shard whole (FSDP2's shards are its
    DTensor's, not its spec's)."""
    assert ParallelDims.layout(Shard(0)) == MeshLayout.of(dp_replicate=Replicate(),
                                                          dp_shard=Replicate(), tp=Shard(0))
    assert str(ParallelDims.layout(Replicate())) == "dp_replicate=R,dp_shard=R,tp=R"
