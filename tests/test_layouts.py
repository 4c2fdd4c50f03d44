"""The layout codec: text and JSON forms of placements and mesh layouts, and their errors."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch

from shardplan import LayoutError
from shardplan.errors import ConfigurationError
from shardplan.layouts import (MeshDim, MeshLayout, MeshSizes, ParallelSpec, Partial, Placement,
                               Replicate, Shard, set_spec, spec_of)

# every field combination of a shard: dim (negative too), blocks, padding, replicas
SHARDS = [Shard(dim, blocks, padded, replicas)
          for dim, blocks, padded, replicas in itertools.product(
              (0, 2, -1), (None, (32,), (3072, 1024, 1024)), (None, 128), (1, 2))]
# a dim merging a batch of any size with 4 heads (or a 4 + 8 blocked period, by pairs of ranks)
PERIODIC = [Shard(0, period=4), Shard(-1, (4, 8), None, 2, 12)]
# blocks each with its own count of ranks (a fused multi-query QKV)
PER_BLOCK = [Shard(0, (64, 16, 16), None, (1, 4, 4)), Shard(-1, (64, 32, 32), None, (1, 2, 2))]
PLACEMENTS = [Replicate(), Partial(), *SHARDS, *PERIODIC, *PER_BLOCK]


@pytest.mark.parametrize("p", PLACEMENTS, ids=str)
def test_text_round_trip(p):
    assert Placement.parse(str(p)) == p


@pytest.mark.parametrize("p", PLACEMENTS, ids=str)
def test_json_round_trip(p):
    assert Placement.from_json(p.to_json()) == p


def test_text_forms():
    """The written forms are the ones plans and reports have always shown."""
    assert [str(p) for p in (Replicate(), Partial(), Shard(0), Shard(-1, None, 50264))] == \
        ["R", "P", "S(0)", "S(-1|pad50264)"]
    assert str(Shard(0, (32, 32, 32), 128, 2)) == "S(0|32+32+32|pad128|x2)"
    assert Placement.parse(" S(1|x2|pad8) ") == Shard(1, None, 8, 2)  # fields in any order
    assert str(Shard(0, period=4)) == "S(0|per4)"


@pytest.mark.parametrize("text", ["", "Q(1)", "S()", "S(a)", "S(0", "S(0|)", "S(0|pad)",
                                  "S(0|x0)", "S(0|0+1)", "S(0|1|2)", "S(0|x2|x2)", "RR",
                                  "S(0|32+)", "S(1.5)"])
def test_malformed_text_is_a_layout_error(text):
    with pytest.raises(LayoutError, match="not a layout"):
        Placement.parse(text)


@pytest.mark.parametrize("d", [{}, {"type": "shard"}, {"type": "shard", "dim": "x"},
                               {"type": "column"}, ["shard", 0], None])
def test_malformed_json_is_a_layout_error(d):
    with pytest.raises(LayoutError, match="not a layout"):
        Placement.from_json(d)


def test_per_block_replicas_slice_and_unshard():
    """``x1+2+2`` at tp 4: rank r holds query row r and K/V row r // 2; every copy
    unshards to the full tensor (a hand count), and equal counts are the plain form."""
    lay = Placement.parse("S(0|4+2+2|x1+2+2)")
    assert lay == Shard(0, (4, 2, 2), None, (1, 2, 2)) and lay.local_size(8, 4) == 3
    t = torch.arange(8)
    parts = [lay.slice(t, r, 4) for r in range(4)]
    assert [p.tolist() for p in parts] == [[0, 4, 6], [1, 4, 6], [2, 5, 7], [3, 5, 7]]
    assert all(torch.equal(lay.unshard(parts, 8, j), t) for j in range(2))
    assert Shard(0, (4, 4), None, (2, 2)) == Shard(0, (4, 4), None, 2)
    for bad in ((1, 2), (0, 1, 1)):  # one count per block, each positive
        with pytest.raises(LayoutError, match="invalid replicas"):
            Shard(0, (4, 2, 2), None, bad)


def test_invalid_shard_fields():
    with pytest.raises(LayoutError, match="invalid padded"):
        Shard(0, None, 0)
    with pytest.raises(LayoutError, match="invalid blocks"):
        Shard(0, ())
    assert Shard(0, [4, 4]) == Shard(0, (4, 4))  # blocks are kept as a tuple (hashable)
    with pytest.raises(LayoutError, match="invalid period"):
        Shard(0, (4, 4), period=4)  # the blocks are one period
    with pytest.raises(LayoutError, match="invalid period"):
        Shard(0, None, 8, period=8)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_period_holds_this_ranks_heads_of_every_batch_row(tp):
    """``S(0|per4)`` of ``[B*4, T]`` (attention's heads merged into the batch) is, on rank r,
    the r-th slice of the 4 heads of each of the B rows; ``unshard`` puts them back."""
    b, heads, t = 3, 4, 5
    full = torch.randn(b * heads, t)
    lay, n = Shard(0, period=heads), heads // tp
    parts = [lay.slice(full, r, tp) for r in range(tp)]
    for r, part in enumerate(parts):
        want = full.view(b, heads, t)[:, r * n:(r + 1) * n].reshape(b * n, t)
        assert torch.equal(part, want)
        assert lay.local_size(b * heads, tp) == part.shape[0]
    assert torch.equal(lay.unshard(parts, b * heads), full)


@pytest.mark.parametrize("layout", [MeshLayout.of(tp=p) for p in PLACEMENTS[:4]]
                         + [MeshLayout.of(dp=Replicate(), tp=s) for s in SHARDS[::5]]
                         + [MeshLayout.of(dp=Shard(0), tp=Partial())], ids=str)
def test_mesh_layout_text_round_trip(layout):
    assert MeshLayout.parse(str(layout)) == layout


def test_mesh_layout_by_name_and_order():
    lay = MeshLayout.parse("dp=R,tp=S(0|8+8)")
    assert lay.names == ("dp", "tp")  # outer to inner, as written
    assert lay["tp"] == Shard(0, (8, 8)) and lay["dp"] == Replicate()
    assert lay.get("cp") is None and lay.get("cp", Replicate()) == Replicate()
    with pytest.raises(KeyError):
        lay["pp"]
    assert MeshLayout.parse("tp=R,dp=R") != MeshLayout.parse("dp=R,tp=R")


@pytest.mark.parametrize("text", ["", "tp", "tp=Q", "dp=R,dp=R", "1x=R", "tp=R;dp=R"])
def test_malformed_mesh_layout_is_a_layout_error(text):
    with pytest.raises(LayoutError):
        MeshLayout.parse(text)


def test_mesh_sizes_by_dim_outer_to_inner():
    sizes = MeshSizes.of(tp=4, dp_shard=2)  # given inner first
    assert list(sizes) == [MeshDim.DP_SHARD, MeshDim.TP] and str(sizes) == "dp_shard=2,tp=4"
    assert sizes[MeshDim.TP] == sizes["tp"] == sizes.tp == 4 and sizes[MeshDim.DP_SHARD] == 2
    assert sizes.get(MeshDim.PP, 1) == 1 and MeshDim.PP not in sizes
    with pytest.raises(KeyError):
        sizes[MeshDim.CP]
    assert sizes == MeshSizes({MeshDim.DP_SHARD: 2, MeshDim.TP: 4}) == {"dp_shard": 2, "tp": 4}
    assert sizes != MeshSizes.of(tp=4) and hash(sizes) == hash(MeshSizes.of(dp_shard=2, tp=4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        sizes.sizes = ()  # immutable


@pytest.mark.parametrize("sizes,what", [({"tp": 0}, "mesh dimension tp of size 0"),
                                        ({"tp": 2.0}, "mesh dimension tp of size 2.0"),
                                        ({"tp": True}, "mesh dimension tp of size True"),
                                        ({"dp": 2}, "no mesh dimension named 'dp'"),
                                        ((("tp", 2), (MeshDim.TP, 4)), "is given twice")])
def test_bad_mesh_sizes_are_a_configuration_error(sizes, what):
    with pytest.raises(ConfigurationError, match=re.escape(what)) as e:
        MeshSizes(sizes)
    assert e.value.fix


def test_spec_travels_on_the_tensor():
    p = torch.nn.Parameter(torch.zeros(2, 3))
    assert spec_of(p) is None
    spec = ParallelSpec(MeshLayout.of(dp=Replicate(), tp=Shard(0)), (4, 3))
    assert set_spec(p, spec) is p and spec_of(p) == spec
