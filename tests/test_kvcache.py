"""Incremental decoding with a K/V cache split by heads: the tokens of full-prefix
``generate``, one token per step, each rank holding 1/tp of the cache."""

from __future__ import annotations

import copy

import pytest
import torch

from shardplan import ConfigurationError
from shardplan.generate import generate
from shardplan.kvcache import GPTDecodeStep, decode
from shardplan.models import build
from shardplan.planner.capture import capture
from shardplan.planner.rules import load_rules
from shardplan.ranks import SimulatedRanks
from shardplan.runtime.ledger import CommLedger
from shardplan.sharded import ShardedModule

pytestmark = pytest.mark.timeout(180)

NEW, MAX_LEN, TP = 5, 12, 2


def setup():
    """gpt-tiny, two prompts of 3 tokens, and their full-prefix greedy continuation."""
    torch.manual_seed(0)
    model = build("gpt-tiny", vocab_size=97).eval()
    ids = torch.randint(0, 90, (2, 3), generator=torch.Generator().manual_seed(2))
    return model, ids, generate(model, ids, max_new_tokens=NEW)


def step_example():
    return (torch.zeros(2, 1, dtype=torch.long), torch.tensor([0]))


def cache_bytes(tensors: dict) -> int:
    return sum(t.nbytes for name, t in tensors.items() if "_cache_" in name)


def test_unsharded_decode_matches_generate():
    model, ids, expected = setup()
    step = GPTDecodeStep(model, batch=2, max_len=MAX_LEN)
    assert torch.equal(decode(step, ids, max_new_tokens=NEW), expected)
    assert torch.equal(decode(step, ids, max_new_tokens=NEW), expected)  # a used cache
    with pytest.raises(ConfigurationError, match="cache of 2 sequences of 12 positions"):
        decode(step, ids, max_new_tokens=MAX_LEN)
    with pytest.raises(ConfigurationError, match="1 prompts"):
        decode(step, ids[:1], max_new_tokens=NEW)


def sim_decode(ctx, model, captured, ids):
    step = GPTDecodeStep(copy.deepcopy(model), batch=2, max_len=MAX_LEN)
    sharded = ShardedModule(step, ctx.group, load_rules(), example=(step_example(), {}),
                            gather_output=True, strict=False, captured=copy.deepcopy(captured))
    with CommLedger() as ledger:
        out = decode(sharded, ids, max_new_tokens=NEW, group=ctx.group)
    return (out, len(sharded._graphs), [(r.kind, r.elements) for r in ledger.records],
            cache_bytes(sharded._tensors))


def test_sharded_decode_prefills_then_runs_one_token_per_step_on_its_heads():
    model, ids, expected = setup()
    captured = capture(GPTDecodeStep(model, batch=2, max_len=MAX_LEN), step_example(), {})
    full = cache_bytes(dict(GPTDecodeStep(model, 2, MAX_LEN).named_buffers()))
    batch, width, vocab = 2, model.config.n_embd, 98  # 97 padded to a multiple of tp

    def call(tokens: int) -> list:
        """The collectives of one call on ``tokens`` tokens per sequence."""
        return ([("all_reduce", batch * tokens * width), ("all_reduce", tokens * width)]
                + [("all_reduce", batch * tokens * width)] * 2 * model.config.n_layer
                + [("all_gather", batch * tokens * vocab)])  # wte, wpe, attn/mlp, logits

    for out, graphs, collectives, local in SimulatedRanks(TP).run(sim_decode, model, captured,
                                                                  ids):
        assert torch.equal(out, expected)
        assert graphs == 2  # the prefill's, and one for every decode position
        model_calls = [c for c in collectives if c[0] != "broadcast"]
        assert model_calls == call(ids.shape[1]) + call(1) * (NEW - 1)
        assert [c for c in collectives if c[0] == "broadcast"] == [("broadcast", batch)] * NEW
        assert local * TP == full
