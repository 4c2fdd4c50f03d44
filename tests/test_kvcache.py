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
    with pytest.raises(ConfigurationError, match="cache of 12 positions"):
        decode(step, ids, max_new_tokens=MAX_LEN)


def sim_decode(ctx, model, captured, ids):
    step = GPTDecodeStep(copy.deepcopy(model), batch=2, max_len=MAX_LEN)
    sharded = ShardedModule(step, ctx.group, load_rules(), example=(step_example(), {}),
                            gather_output=True, strict=False, captured=copy.deepcopy(captured))
    with CommLedger() as ledger:
        out = decode(sharded, ids, max_new_tokens=NEW, group=ctx.group)
    return (out, len(sharded._graphs), [(r.kind, r.elements) for r in ledger.records],
            cache_bytes(sharded._tensors))


def test_sharded_decode_runs_one_token_per_step_on_its_heads():
    model, ids, expected = setup()
    captured = capture(GPTDecodeStep(model, batch=2, max_len=MAX_LEN), step_example(), {})
    full = cache_bytes(dict(GPTDecodeStep(model, 2, MAX_LEN).named_buffers()))
    batch, width, vocab = 2, model.config.n_embd, 98  # 97 padded to a multiple of tp
    one_token = ([("all_reduce", batch * 1 * width), ("all_reduce", 1 * width)]  # wte, wpe
                 + [("all_reduce", batch * 1 * width)] * 2 * model.config.n_layer  # attn, mlp
                 + [("all_gather", batch * 1 * vocab)])  # the logits
    steps = ids.shape[1] + NEW - 1
    for out, graphs, collectives, local in SimulatedRanks(TP).run(sim_decode, model, captured, ids):
        assert torch.equal(out, expected)
        assert graphs == 1  # one capture serves every position
        model_steps = [c for c in collectives if c[0] != "broadcast"]
        assert model_steps == one_token * steps  # the same one-token sizes at every step
        assert [c for c in collectives if c[0] == "broadcast"] == [("broadcast", batch)] * NEW
        assert local * TP == full
