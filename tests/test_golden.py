"""The redesigned pipeline keeps its decisions: plans and communication pinned.

``tests/golden/`` holds, per model and tp, the plan JSON and the collectives
one forward+backward records on rank 0, as the first round's pipeline made
them. What is compared is the content a user relies on (every parameter's
layout and local shape, every collective, the warnings, the memory), so a
schema change of the JSON does not hide a change of plan.
"""

from __future__ import annotations

import json

import pytest

from tests.golden_cases import CASES, GOLDEN, ledger_of, plan_json

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _content(plan: dict) -> dict:
    return {
        "params": sorted((p["name"], p["layout"], tuple(p["local_shape"])) for p in plan["params"]),
        "collectives": sorted((c["kind"], c["direction"], c["purpose"], c["elements"], c["module"])
                              for c in plan["collectives"]),
        "warnings": sorted(plan["warnings"]),
        "memory": plan["memory"]["param_bytes_per_rank"],
    }


def _golden(name, tp) -> dict:
    return json.loads((GOLDEN / f"{name}-tp{tp}.json").read_text())


@pytest.mark.parametrize("name,tp", CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_plan_is_unchanged(name, tp):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    got, want = _content(plan_json(name, tp)), _content(_golden(name, tp)["plan"])
    assert got["params"] == want["params"]
    assert got["collectives"] == want["collectives"]
    assert got == want
    assert any("S(" in layout for _, layout, _ in got["params"]), "the golden model was sharded"


@pytest.mark.parametrize("name,tp", [c for c in CASES if c[1] == 2], ids=lambda c: str(c))
def test_ledger_is_unchanged(name, tp):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    assert ledger_of(name, tp) == _golden(name, tp)["ledger"]
