"""The models whose plans and communication are pinned by ``tests/golden/``.

``python -m tests.golden_cases`` rewrites the golden files; only do that when a
change of plan is intended, and say why in the commit.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

GOLDEN = Path(__file__).parent / "golden"
CASES = [("gpt-tiny", 2), ("gpt-tiny", 4), ("llama-tiny", 2), ("llama-tiny", 4),
         ("hf-gpt2", 2), ("hf-llama", 2), ("hf-llama", 4), ("hf-bert", 2)]


def model_and_inputs(name: str):
    """A fresh model (seeded) and the keyword inputs its plan is made with."""
    if name.startswith("hf-"):
        from tests import hf_cases
        return hf_cases.build(name[3:]), hf_cases.inputs()
    from shardplan.models import build
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))
    key = "idx" if name.startswith("gpt") else "tokens"
    return build(name), {key: ids, "targets": ids}


def ledger_of(name: str, tp: int) -> dict:
    """Collectives one forward and backward records on rank 0 of simulated ranks."""
    import shardplan
    from shardplan.ranks import SimulatedRanks
    from shardplan.runtime.ledger import CommLedger

    model, kw = model_and_inputs(name)

    def rank(ctx):
        import copy
        sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=kw)
        with CommLedger() as ledger:
            out = sharded(**kw)
            (out.loss if hasattr(out, "loss") else out[1]).backward()
        return {f"{k}|{d}|{n}": v for (k, d, n), v in sorted(ledger.summary().items())}

    with SimulatedRanks(tp) as ranks:
        per_rank = ranks.run(rank)
    return per_rank[0]


def plan_json(name: str, tp: int) -> dict:
    import shardplan
    model, kw = model_and_inputs(name)
    return json.loads(shardplan.plan(model, tp, example_inputs=kw).to_json())


def main() -> None:
    GOLDEN.mkdir(exist_ok=True)
    for name, tp in CASES:
        data = {"plan": plan_json(name, tp), "ledger": ledger_of(name, tp)}
        (GOLDEN / f"{name}-tp{tp}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print("wrote", name, tp)


if __name__ == "__main__":
    main()
