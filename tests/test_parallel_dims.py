"""ParallelDims: validation, the ("dp", "tp") mesh it builds, and the groups it hands out.

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
from shardplan.layouts import MeshLayout, Replicate, Shard
from shardplan.parallel_dims import ParallelDims


@contextlib.contextmanager
def fake_world(rank: int, size: int):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kwargs", [{"tp": 0}, {"dp": -1}, {"tp": 2.0}, {"tp": True},
                                    {"tp": "2"}])
def test_sizes_must_be_positive_ints(kwargs):
    with pytest.raises(ConfigurationError, match="must be a positive int"):
        ParallelDims(**kwargs)


@pytest.mark.parametrize("world,tp,dp,want", [(8, None, None, (8, 1)), (8, 2, None, (2, 4)),
                                              (8, None, 4, (2, 4)), (6, 3, 2, (3, 2)),
                                              (1, None, None, (1, 1))])
def test_for_world_fills_the_missing_size(world, tp, dp, want):
    dims = ParallelDims.for_world(world, tp=tp, dp=dp)
    assert (dims.tp, dims.dp) == want and dims.world_size == world


@pytest.mark.parametrize("world,tp,dp", [(8, 3, None), (8, 2, 2), (4, 8, None), (6, None, 4)])
def test_dims_that_do_not_fill_the_world(world, tp, dp):
    with pytest.raises(ConfigurationError, match=f"the world has {world}") as e:
        ParallelDims.for_world(world, tp=tp, dp=dp)
    assert "nproc-per-node" in e.value.fix


@pytest.mark.parametrize("rank", [0, 3, 5, 7])
def test_mesh_is_dp_outer_tp_inner(rank):
    """rank = dp_rank * tp + tp_rank, as torchtitan lays it out; groups of the right sizes."""
    with fake_world(rank, 8):
        dims = ParallelDims.for_world(8, tp=2).with_mesh("cpu")
        assert dims.mesh.mesh_dim_names == ("dp", "tp") and tuple(dims.mesh.shape) == (4, 2)
        tp, dp = dims.tp_group, dims.dp_group
        assert (tp.size, dp.size) == (2, 4)
        assert (dp.rank, tp.rank) == divmod(rank, 2)
        assert dist.get_process_group_ranks(tp.pg) == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert dist.get_process_group_ranks(dp.pg) == [rank % 2 + 2 * i for i in range(4)]
        assert ParallelDims.from_mesh(dims.mesh) == dims


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
        assert (dims.tp, dims.dp, dims.tp_group.size, dims.tp_group.rank) == (4, 1, 4, 1)
        with pytest.raises(ConfigurationError, match="no 'dp' dimension"):
            dims.dp_group


@pytest.mark.parametrize("names", [None, ("dp",), ("tp", "pp")])
def test_from_mesh_refuses_other_dims(names):
    with fake_world(0, 4):
        shape = (4,) if names is None or len(names) == 1 else (2, 2)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        with pytest.raises(ConfigurationError, match="needs a 'tp' dimension") as e:
            ParallelDims.from_mesh(mesh)
        assert "mesh_dim_names" in e.value.fix


def test_parallelize_refuses_a_mesh_without_tp():
    import torch.nn as nn

    import shardplan
    with fake_world(0, 2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(ConfigurationError, match="needs a 'tp' dimension"):
            shardplan.parallelize(nn.Linear(4, 4), mesh=mesh, check_model=False)


def test_layout_of_a_tp_placement():
    """Data-parallel replicas hold every tensor whole."""
    assert ParallelDims.layout(Shard(0)) == MeshLayout.of(dp=Replicate(), tp=Shard(0))
    assert str(ParallelDims.layout(Replicate())) == "dp=R,tp=R"
