"""The K/V-cache decode path of ``ShardedModule.generate``: one token per step after the
prompt, caches split by heads, the bundled models, and the fallback for models
without a decode step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from shardplan import ConfigurationError
from shardplan.generate import generate
from shardplan.kvcache import decode_step
from shardplan.layouts import Shard
from shardplan.models import build
from shardplan.planner.capture import capture
from shardplan.planner.rules import load_rules
from shardplan.ranks import SimulatedRanks
from shardplan.runtime.ledger import CommLedger
from shardplan.sharded import ShardedModule

from checks import decode_calls
from test_generate import CACHE, NEW, SAMPLE, cache_report, example, prompts
from test_generate import build as build_hf

pytestmark = pytest.mark.timeout(300)


def sharded_with_decoder(ctx, model, args, kwargs, captured, step_captured, **kw):
    sharded = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(), example=(args, kwargs),
                            gather_output=kw.pop("gather_output", True), strict=False,
                            captured=copy.deepcopy(captured))
    sharded.decode_step(2, CACHE, captured=copy.deepcopy(step_captured))
    return sharded


def sim_ledger(ctx, model, captured, step_captured):
    ids, mask = prompts()
    sharded = sharded_with_decoder(ctx, model, (), example(ids, mask), captured, step_captured)
    with CommLedger() as ledger:
        out = sharded.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    return out, [(r.kind, r.elements) for r in ledger.records]


def test_decode_steps_communicate_one_token():
    """HF GPT-2 at tp=2: the prompt's collectives carry batch x prompt x hidden elements,
    every later step's batch x 1 x hidden (the logits: only the last position's)."""
    model = build_hf("gpt2", 4)
    ids, mask = prompts()
    step = decode_step(model, 2, CACHE)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    batch, prompt, hidden, vocab = 2, ids.shape[1], 32, 102  # 101 padded to tp
    got = SimulatedRanks(2).run(sim_ledger, model, capture(model, (), example(ids, mask)),
                                capture(step, step.example(2), {}))
    for out, records in got:
        assert torch.equal(out, expected)
        calls = decode_calls(records, batch)  # one model call, then its tokens' broadcast
        assert len(calls) == NEW
        prefill, *steps = calls
        assert prefill[-1] == ("all_gather", batch * vocab)
        assert {k for k, _ in prefill[:-1]} == {"all_reduce"} and len(prefill) > 4
        assert {e for _, e in prefill[:-1]} == {batch * prompt * hidden}
        for each in steps:  # the prompt's collectives, on one token
            assert each == [(k, batch * hidden) for k, _ in prefill[:-1]] + [prefill[-1]]


def sim_bundled(ctx, model, ids, captured, step_captured, padded, mask):
    sharded = sharded_with_decoder(ctx, model, (ids,), {}, captured, step_captured)
    greedy = sharded.generate(padded, attention_mask=mask, max_new_tokens=NEW)
    sampled = sharded.generate(ids, max_new_tokens=NEW,
                               generator=torch.Generator().manual_seed(3), **SAMPLE)
    split = sharded_with_decoder(ctx, model, (ids,), {}, captured, step_captured,
                                 gather_output=False)
    with pytest.raises(ConfigurationError, match="takes no attention_mask"):  # no cache: no mask
        sharded.generate(padded, attention_mask=mask, max_new_tokens=1, kv_cache=False)
    decoder = sharded.decode_step(2, CACHE)
    caches, local, _ = cache_report(decoder)
    return (greedy, sampled, split.generate(ids, max_new_tokens=NEW),
            split.generate(ids, max_new_tokens=NEW, kv_cache=False), caches, local)


@pytest.mark.parametrize("preset,cfg,tp", [("gpt-tiny", dict(vocab_size=97), 2),
                                           ("llama-tiny", dict(n_kv_heads=2), 4)])
def test_bundled_cached_generate_matches_unsharded(preset, cfg, tp):
    """Greedy on a left-padded batch = each prompt alone, unpadded; seeded sampling = the
    unsharded model's; each rank holds 1/tp of the cache (K/V heads < tp: its group's);
    with the logits split by vocabulary, both paths gather them per step."""
    torch.manual_seed(0)
    model = build(preset, **cfg).eval()
    ids = torch.randint(1, 90, (2, 4), generator=torch.Generator().manual_seed(2))
    padded, mask = ids.clone(), torch.ones_like(ids)
    padded[1, :2], mask[1, :2] = 0, 0
    alone = [generate(model, padded[i:i + 1, 4 - int(mask[i].sum()):], max_new_tokens=NEW)
             for i in range(2)]
    sampled = generate(model, ids, max_new_tokens=NEW,
                       generator=torch.Generator().manual_seed(3), **SAMPLE)
    greedy = generate(model, ids, max_new_tokens=NEW)
    step = decode_step(model, 2, CACHE)
    full = sum(t.nbytes for k, t in step.named_buffers() if "_cache_" in k)
    heads = step.k_cache_0.shape[1]
    got = SimulatedRanks(tp).run(sim_bundled, model, ids, capture(model, (ids,), {}),
                                 capture(step, step.example(2), {}), padded, mask)
    for out, sample, split, recomputed, caches, local in got:
        for i in range(2):
            assert torch.equal(out[i, 4 - int(mask[i].sum()):], alone[i][0])
        assert torch.equal(sample, sampled) and torch.equal(split, greedy)
        assert torch.equal(recomputed, greedy)  # logits split by vocabulary, gathered per step
        assert all(isinstance(lay, Shard) and lay.dim == 1 for lay in caches.values()), caches
        assert local == full // min(tp, heads)


class Bag(nn.Module):
    """A language model with no attention at all: it has no decode step."""

    def __init__(self):
        super().__init__()
        self.embed, self.up = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.head = nn.Linear(64, 64)

    def forward(self, ids):
        return self.head(torch.relu(self.up(self.embed(ids).cumsum(1))))


def sim_fallback(ctx, model, ids):
    sharded = ShardedModule(copy.deepcopy(model), ctx.group, load_rules(), example=((ids,), {}),
                            gather_output=True, strict=False)
    return sharded.generate(ids, max_new_tokens=NEW), sharded.layouts["up.weight"]


def test_model_without_decode_step_recomputes_the_prefix_with_a_warning():
    torch.manual_seed(0)
    model = Bag().eval()
    ids = torch.randint(0, 64, (2, 3), generator=torch.Generator().manual_seed(2))
    expected = generate(model, ids, max_new_tokens=NEW)
    with pytest.warns(UserWarning, match="prefix is recomputed for every token: Bag does not"):
        got = SimulatedRanks(2).run(sim_fallback, model, ids)  # (warnings are process-wide)
    for out, layout in got:
        assert torch.equal(out, expected) and isinstance(layout, Shard)
