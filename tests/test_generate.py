"""Generation on sharded models: token for token what the unsharded model generates.

HF GPT-2 (vocabulary 101, padded) and HF Llama with one K/V head (held by
groups of ranks) against HF's own ``generate``, on a left-padded batch,
greedy (with an eos that ends one sequence early) and seeded sampling; the
bundled GPT and Llama against ``generate`` of the unsharded model. The
sharded model is parallelized with the call signature generation uses, so
each rank captures once.
"""

from __future__ import annotations

import copy
import functools

import pytest
import safetensors.torch
import torch

import hf_cases
import shardplan
from shardplan import ConfigurationError
from shardplan.generate import generate
from shardplan.models import build
from shardplan.planner.capture import capture
from shardplan.planner.rules import load_rules
from shardplan.ranks import SimulatedRanks
from shardplan.runtime.ledger import CommLedger
from shardplan.sharded import ShardedModule

pytestmark = pytest.mark.timeout(180)

NEW = 5
SAMPLE = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)


def hf_model(kind: str):
    return hf_cases.build(kind, kv_heads=1)


def prompts():
    """Two prompts of 5 and 3 tokens, the shorter left-padded with 0."""
    ids = torch.randint(1, hf_cases.VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    return ids, mask


def example(ids, mask):
    """The keyword inputs generation calls an HF model with on a padded batch."""
    return {"input_ids": ids, "attention_mask": mask, "position_ids": mask}


def hf_runs(sharded, eos_token_id: int):
    """(greedy, greedy ending at ``eos_token_id``, seeded sample) from a model with ``generate``."""
    ids, mask = prompts()
    greedy = sharded.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    eos = sharded.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                           eos_token_id=eos_token_id, pad_token_id=7)
    if isinstance(sharded, ShardedModule):
        sampled = sharded.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                   generator=torch.Generator().manual_seed(3), **SAMPLE)
    else:  # HF draws from the global RNG
        torch.manual_seed(3)
        sampled = sharded.generate(ids, attention_mask=mask, max_new_tokens=NEW, **SAMPLE)
    return greedy, eos, sampled


@functools.lru_cache(maxsize=None)
def reference(kind: str):
    """HF's outputs, and the eos used: the second token greedy generates for the first prompt."""
    model = hf_model(kind)
    ids, mask = prompts()
    eos = int(model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)[0, -1])
    return hf_runs(model, eos), eos


def real_hf(ctx, kind: str, eos: int):
    ids, mask = prompts()
    sharded = shardplan.parallelize(hf_model(kind), group=ctx.group,
                                    example_inputs=example(ids, mask))
    return hf_runs(sharded, eos)


@pytest.mark.real
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_generate_on_real_ranks_matches_hf(real_ranks, kind):
    expected, eos = reference(kind)
    assert expected[1][0, -1] == 7  # eos ended the first sequence; the rest is padding
    for rank, got in enumerate(real_ranks(2).run(real_hf, kind, eos)):
        for e, g in zip(expected, got):
            assert torch.equal(e, g), (rank, e, g)


def sim_hf(ctx, model, captured, eos):
    ids, mask = prompts()
    sharded = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(),
                            example=((), example(ids, mask)), gather_output=True, strict=False,
                            captured=copy.deepcopy(captured))
    return hf_runs(sharded, eos)


def test_llama_generate_at_tp4_simulated_matches_hf():
    model = hf_model("llama")
    captured = capture(model, (), example(*prompts()))
    expected, eos = reference("llama")
    for rank, got in enumerate(SimulatedRanks(4).run(sim_hf, model, captured, eos)):
        for e, g in zip(expected, got):
            assert torch.equal(e, g), (rank, e, g)


def sim_bundled(ctx, model, ids, captured):
    sharded = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(), example=((ids,), {}),
                            gather_output=True, strict=False, captured=copy.deepcopy(captured))
    with CommLedger() as ledger:
        greedy = sharded.generate(ids, max_new_tokens=NEW)
    # per token: the model's own collectives, and one broadcast of the batch's next ids
    assert [r.elements for r in ledger.filter(kind="broadcast")] == [2] * NEW
    sampled = sharded.generate(ids, max_new_tokens=NEW,
                               generator=torch.Generator().manual_seed(3), **SAMPLE)
    with pytest.raises(ConfigurationError, match="attention_mask"):
        sharded.generate(ids, max_new_tokens=1, attention_mask=torch.tensor([[0, 1, 1]] * 2))
    split = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(), example=((ids,), {}),
                          gather_output=False, strict=False, captured=copy.deepcopy(captured))
    return greedy, sampled, split.generate(ids, max_new_tokens=NEW)  # logits gathered per step


@pytest.mark.parametrize("preset,cfg", [("gpt-tiny", dict(vocab_size=97)), ("llama-tiny", {})])
def test_bundled_generate_matches_unsharded(preset, cfg):
    torch.manual_seed(0)
    model = build(preset, **cfg).eval()
    ids = torch.randint(0, 90, (2, 3), generator=torch.Generator().manual_seed(2))
    greedy = generate(model, ids, max_new_tokens=NEW)
    sampled = generate(model, ids, max_new_tokens=NEW,
                       generator=torch.Generator().manual_seed(3), **SAMPLE)
    assert greedy.shape == (2, 3 + NEW)
    captured = capture(model, (ids,), {})
    for got in SimulatedRanks(2).run(sim_bundled, model, ids, captured):
        assert torch.equal(got[0], greedy) and torch.equal(got[1], sampled), (got, greedy, sampled)
        assert torch.equal(got[2], greedy)


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])  # llama: RoPE buffers unsaved
def test_cli_generates_from_a_checkpoint(tmp_path, capsys, preset):
    from shardplan import cli
    torch.manual_seed(4)
    model = build(preset).eval()
    safetensors.torch.save_model(model, tmp_path / "model.safetensors")
    expected = generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    assert cli.main(["generate", preset, "--tp", "2", "--prompt", "1, 2, 3",
                     "--max-new-tokens", "4", "--checkpoint", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [str(int(t)) for t in expected[0]]
