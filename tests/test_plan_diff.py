"""Comparing two plans: tp=2 vs tp=4, a model change, warnings, no change at all, and a
plan written before the mesh dims (schema 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardplan
from shardplan.cli import main
from shardplan.layouts import MeshDim
from shardplan.report.diff import compare_plans, diff_plans
from shardplan.models import build
from tests.golden_cases import plan_json

# the plan part of tests/golden/gpt-tiny-tp2.json as schema 1 wrote it (``tp``, no mesh dims)
SCHEMA_1 = Path(__file__).parent / "fixtures" / "plan-schema1-gpt-tiny-tp2.json"


@pytest.fixture(scope="module")
def tiny():
    idx = torch.zeros(2, 8, dtype=torch.long, device="meta")
    return {
        "tp2": shardplan.plan(build("gpt-tiny", device="meta"), 2),
        "tp4": shardplan.plan(build("gpt-tiny", device="meta"), 4),
        "unfused97": shardplan.plan(build("gpt-tiny", fused_qkv=False, vocab_size=97, device="meta"), 2,
                                    example_inputs=(idx, idx)),
    }


def test_same_plan_has_no_differences(tiny):
    d = compare_plans(tiny["tp2"], tiny["tp2"])
    assert d.empty and not d.params and not d.changed_collectives
    assert "no differences" in diff_plans(tiny["tp2"], tiny["tp2"])
    same = shardplan.Plan.from_json(tiny["tp2"].to_json())  # a plan read back from JSON
    assert compare_plans(tiny["tp2"], same).empty


def test_tp2_vs_tp4_changes_local_shapes_and_memory(tiny):
    a, b = tiny["tp2"], tiny["tp4"]
    d = compare_plans(a, b)
    assert d.tp == (2, 4) and not d.roles and not d.warnings_added
    changed = {p.name: p for p in d.params}
    assert all(p.kind == "changed" for p in changed.values())
    w = changed["transformer.h.1.attn.c_attn.weight"]
    assert (w.layout_a, w.local_a, w.layout_b, w.local_b) == ("S(0|32+32+32)", (48, 32), "S(0|32+32+32)", (24, 32))
    assert changed["transformer.h.0.mlp.c_proj.weight"].local_b == (32, 32)
    assert "transformer.h.0.ln_1.weight" not in changed  # replicated: unchanged
    assert d.memory_a[0] == a.memory.param_bytes_per_rank and d.memory_b[0] == b.memory.param_bytes_per_rank
    assert d.memory_a[1] == d.memory_b[1]
    # Megatron's all-reduces carry full activations: the same at any tp
    assert not d.changed_collectives
    text = d.render()
    assert "tp: 2 -> 4" in text
    assert "communication per step: unchanged (11 collectives" in text
    # the two blocks changed alike: listed once with their range
    line = next(x for x in text.splitlines() if "attn.c_attn.weight" in x)
    assert "transformer.h.*.attn.c_attn.weight" in line and "[0-1, 2 blocks]" in line
    assert "(48, 32)" in line and "(24, 32)" in line
    assert "-45.3%" in text


def test_model_change_adds_and_removes_parameters_roles_and_collectives(tiny):
    a, b = tiny["tp2"], tiny["unfused97"]
    d = compare_plans(a, b)
    kinds = {p.name: p.kind for p in d.params}
    assert kinds["transformer.h.0.attn.c_attn.weight"] == "removed"
    assert kinds["transformer.h.1.attn.q_proj.bias"] == "added"
    assert kinds["transformer.wte.weight"] == "changed"  # padded vocabulary
    roles = {r.module: (r.roles_a, r.roles_b) for r in d.roles}
    assert roles["transformer.h.0.attn.c_attn"] == (("column",), ())
    assert roles["transformer.h.1.attn.v_proj"] == ((), ("column",))
    assert roles[""] == ((), ("vocab_loss",))
    coll = {(c.purpose, c.direction): c for c in d.changed_collectives}
    loss = coll[("vocab_loss", "forward")]
    assert (loss.count_a, loss.count_b, loss.bytes_a) == (0, 3, 0) and loss.bytes_b > 0
    assert ("gather_output", "forward") in coll  # 96 -> 97 classes gathered
    assert ("f", "backward") not in coll
    text = diff_plans(a, b)
    assert "+ forward  all_reduce vocab_loss       0 -> 3" in text
    assert "S(0) (48, 32) -> S(0|pad98) (49, 32)" in text and "global (96, 32) -> (97, 32)" in text
    for section in ("removed:", "added:", "decisions (roles per module):"):
        assert section in text
    assert "transformer.h.*.attn.q_proj.weight" in text


def test_warnings_added_and_removed(tiny):
    a = tiny["tp2"].model_copy(update={"warnings": ["old one", "kept"]})
    b = tiny["tp2"].model_copy(update={"warnings": ["kept", "new one"]})
    d = compare_plans(a, b)
    assert d.warnings_added == ["new one"] and d.warnings_removed == ["old one"]
    assert not d.empty
    text = d.render()
    assert "  + new one" in text and "  - old one" in text and "kept" not in text


def test_blocks_that_changed_differently_are_listed_apart(tiny):
    a = tiny["tp2"]
    params = [p.model_copy(update={"layout": "R", "local_shape": p.global_shape})
              if p.name == "transformer.h.1.mlp.c_fc.weight" else p for p in a.params]
    b = a.model_copy(update={"params": params})
    text = diff_plans(a, b)
    assert "transformer.h.1.mlp.c_fc.weight  S(0) (64, 32) -> R (128, 32)" in text
    assert "transformer.h.*" not in text


def test_a_schema_1_plan_reads_as_a_plan_of_tp_alone():
    raw = json.loads(SCHEMA_1.read_text())
    assert raw["schema_version"] == 1 and raw["tp"] == 2 and "mesh" not in raw
    assert not any("mesh_layout" in p for p in raw["params"])
    assert not any("mesh_dim" in c for c in raw["collectives"])
    old = shardplan.Plan.from_json(SCHEMA_1.read_text())
    assert old.mesh == {MeshDim.TP: 2} and old.tp == 2 and old.dims.tp == 2
    assert [p.mesh_layout for p in old.params] == [f"tp={p['layout']}" for p in raw["params"]]
    assert any(p.mesh_layout.startswith("tp=S(") for p in old.params)
    assert {c.mesh_dim for c in old.collectives} == {MeshDim.TP}
    assert json.loads(old.to_json())["mesh"] == {"tp": 2}  # written back as schema 2's fields


def test_diff_of_a_schema_1_plan_and_todays_plan_of_the_same_model(tmp_path, capsys):
    """The golden model planned today (schema 2) against its schema-1 plan: the same plan."""
    new = tmp_path / "new.json"
    new.write_text(json.dumps(plan_json("gpt-tiny", 2)))
    assert json.loads(new.read_text())["schema_version"] == 2
    old = shardplan.Plan.from_json(SCHEMA_1.read_text())
    d = compare_plans(old, shardplan.Plan.from_json(new.read_text()))
    assert d.empty and d.tp == (2, 2) and d.collectives  # compared, and equal
    assert main(["diff", str(SCHEMA_1), str(new)]) == 0
    out = capsys.readouterr().out
    assert "GPT at tp=2" in out and "no differences" in out
    four = tmp_path / "four.json"
    four.write_text(json.dumps(plan_json("gpt-tiny", 4)))
    assert main(["diff", str(SCHEMA_1), str(four)]) == 0
    out = capsys.readouterr().out
    assert "tp: 2 -> 4" in out and "(48, 32)" in out and "(24, 32)" in out
