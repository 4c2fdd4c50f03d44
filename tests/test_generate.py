"""Generation on sharded models with a K/V cache split by heads: token for token
what Hugging Face's ``generate`` returns on the unsharded model.

Six HF decoder families (GPT-2, Llama with fewer K/V heads than tp, Qwen2,
Mistral, OPT, Gemma with one K/V head) on a left-padded batch, greedy
(and with an eos that ends one sequence early) and seeded sampling, on
simulated ranks at tp 2 and 4 and on real gloo ranks (one launch at tp=2: GPT-2,
Llama, Qwen2, Mistral, OPT; one at tp=4: Llama, OPT). Each case also checks that the decode step's caches are split by
heads (bytes per rank), that one capture serves the prompt and every later
token, and that each later token's collectives are one position wide. The sharded models
are built from captures made once for all ranks (``captured=``), as the other
HF tests do.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import shardplan
from shardplan.generate import generate
from shardplan.kvcache import decode_step
from shardplan.layouts import Shard
from shardplan.planner.capture import capture
from shardplan.planner.rules import load_rules
from shardplan.ranks import SimulatedRanks
from shardplan.runtime.ledger import CommLedger
from shardplan.sharded import ShardedModule, parallel_step

from checks import decode_calls

pytestmark = pytest.mark.timeout(300)

NEW, VOCAB, CACHE = 5, 101, 16  # 5 prompt + 5 new tokens fit a 16-slot cache
WIDTH = 32  # every model's hidden size
SAMPLE = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)


def build(kind: str, kv_heads: int = 2, layers: int = 2):
    """An HF causal LM of ``layers`` layers, width ``WIDTH`` and 4 heads, random weights."""
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    decoder = dict(num_hidden_layers=layers, hidden_size=WIDTH, num_attention_heads=4,
                   intermediate_size=64, max_position_embeddings=64, **common)
    if kind == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=layers, n_embd=WIDTH, n_head=4,
                                                 n_positions=32, **common))
    elif kind == "opt":
        model = tf.OPTForCausalLM(tf.OPTConfig(num_hidden_layers=layers, hidden_size=WIDTH,
                                               num_attention_heads=4, ffn_dim=64,
                                               word_embed_proj_dim=WIDTH,
                                               max_position_embeddings=64, **common))
    else:
        config, cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                       "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                       "mistral": ("MistralConfig", "MistralForCausalLM"),
                       "gemma": ("GemmaConfig", "GemmaForCausalLM")}[kind]
        extra = {"head_dim": 8} if kind == "gemma" else {}
        model = getattr(tf, cls)(getattr(tf, config)(num_key_value_heads=kv_heads, **decoder,
                                                     **extra))
    model.config._attn_implementation = "sdpa"
    return model.eval()


def prompts():
    """Two prompts of 5 and 3 tokens, the shorter left-padded with 0."""
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    return ids, mask


def example(ids, mask):
    """The keyword inputs a padded batch's forward takes."""
    return {"input_ids": ids, "attention_mask": mask, "position_ids": mask}


def runs(model, eos_token_id: int):
    """(greedy, greedy ending at ``eos_token_id``, seeded sample) from a model's ``generate``."""
    ids, mask = prompts()
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    eos = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         eos_token_id=eos_token_id, pad_token_id=7)
    if isinstance(model, ShardedModule):
        sampled = model.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                 generator=torch.Generator().manual_seed(3), **SAMPLE)
    else:  # HF draws from the global RNG
        torch.manual_seed(3)
        sampled = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **SAMPLE)
    return greedy, eos, sampled


@functools.lru_cache(maxsize=None)
def reference(kind: str, kv_heads: int, layers: int = 2):
    """HF's outputs, and the eos used: the second token greedy generates for the first prompt."""
    model = build(kind, kv_heads, layers)
    ids, mask = prompts()
    eos = int(model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)[0, -1])
    expected = runs(model, eos)
    assert expected[1][0, -1] == 7 and eos in expected[1][0, 5:]  # eos, then padding
    return expected, eos


def cache_report(decoder: ShardedModule) -> tuple:
    """(layouts of the caches, the bytes of every cache tensor this rank holds, its own
    and the unsharded step's, distinct graphs of the step)."""
    named = [*decoder._tensors.items(), *decoder.source.named_buffers()]
    held = {id(t): t for k, t in named if "_cache_" in k and not t.is_meta}
    graphs = decoder.graphs
    return ({k: decoder.layouts[k] for k in decoder._tensors if "_cache_" in k},
            sum(t.nbytes for t in held.values()), len(graphs))


def ledgered(generate_greedy) -> list[tuple[str, int]]:
    """(kind, elements) of each collective ``generate_greedy()`` issues on this rank."""
    with CommLedger() as ledger:
        generate_greedy()
    return [(r.kind, r.elements) for r in ledger.records]


def assert_one_token_steps(records: list[tuple[str, int]]) -> None:
    """A greedy generation's collectives: the prompt's call carries every prompt position
    (batch x prompt x width), each later step the same collectives on one position; every
    call ends with the broadcast of its batch of tokens."""
    ids, _ = prompts()
    batch, prompt = ids.shape
    calls = decode_calls(records, batch)
    assert len(calls) == NEW, calls
    prefill, *steps = calls
    assert ("all_reduce", batch * prompt * WIDTH) in prefill, prefill
    one = [(k, e // prompt if e % (batch * prompt) == 0 else e) for k, e in prefill]
    for i, each in enumerate(steps, 1):
        assert each == one, f"decode step {i}: {each}, not the prompt's on one token {one}"


def check(kind: str, kv_heads: int, tp: int, got: list, layers: int = 2) -> None:
    """Every rank generated HF's tokens, held its share of the cache, captured once, and
    communicated one token's width per decode step."""
    expected, _ = reference(kind, kv_heads, layers)
    step = decode_step(build(kind, kv_heads, layers), 2, CACHE)
    full = sum(t.nbytes for name, t in step.named_buffers() if "_cache_" in name)
    heads = step.k_cache_0.shape[1]
    for rank, (outs, records, layouts, local, graphs) in enumerate(got):
        assert_one_token_steps(records)
        for e, g in zip(expected, outs):
            assert torch.equal(e, g), (kind, rank, e, g)
        if heads > 1:  # one K/V head is every rank's
            assert all(isinstance(lay, Shard) and lay.dim == 1 for lay in layouts.values()), layouts
        # each rank its own heads; a head shared by a group of ranks held once per rank
        assert local == full // min(tp, heads), (kind, rank, local, full)
        assert graphs == 1  # one capture: the prompt and each later single token


def sim_generate(ctx, step, captured, eos):
    """This rank's decode step, parallelized on its own (the model is not: the sharded
    model's ``generate`` does the same with the model's shards, see the real test)."""
    step = copy.deepcopy(step)
    decoder = parallel_step(step, ctx.group, load_rules(), captured=copy.deepcopy(captured))
    ids, mask = prompts()
    kw = dict(attention_mask=mask, max_new_tokens=NEW, group=ctx.group, source=step.model,
              step=decoder)
    outs = (generate(step.model, ids, do_sample=False, **kw),
            generate(step.model, ids, do_sample=False, eos_token_id=eos, pad_token_id=7, **kw),
            generate(step.model, ids, generator=torch.Generator().manual_seed(3), **SAMPLE, **kw))
    records = ledgered(lambda: generate(step.model, ids, do_sample=False, **kw))
    return outs, records, *cache_report(decoder)


# GPT-2 runs on real ranks below and in test_kvcache's collective sizes
CASES = [("llama", 2, 4), ("qwen2", 2, 2), ("mistral", 2, 2), ("opt", 4, 4), ("gemma", 1, 4)]


@pytest.mark.parametrize("kind,kv_heads,tp", CASES, ids=[f"{k}-tp{t}" for k, _, t in CASES])
def test_cached_generate_matches_hf_on_simulated_ranks(kind, kv_heads, tp):
    step = decode_step(build(kind, kv_heads), 2, CACHE)
    captured = capture(step, step.example(2), {})
    _, eos = reference(kind, kv_heads)
    got = SimulatedRanks(tp).run(sim_generate, step, captured, eos)
    check(kind, kv_heads, tp, got)


def real_generate(ctx, cases: list, eos: dict):
    """Each case's model parallelized as users do, its three generations and cache report."""
    out = []
    for kind, kv_heads, layers in cases:
        sharded = shardplan.parallelize(build(kind, kv_heads, layers), group=ctx.group,
                                        example_inputs=example(*prompts()))
        outs = runs(sharded, eos[kind])
        ids, mask = prompts()
        records = ledgered(lambda: sharded.generate(ids, attention_mask=mask,
                                                    max_new_tokens=NEW, do_sample=False))
        out.append((outs, records, *cache_report(sharded.decode_step(2, CACHE))))
    return out


def real_check(real_ranks, tp: int, cases: list) -> None:
    eos = {case[0]: reference(*case)[1] for case in cases}
    got = real_ranks(tp).run(real_generate, cases, eos)
    for i, (kind, kv_heads, layers) in enumerate(cases):
        check(kind, kv_heads, tp, [rank[i] for rank in got], layers)


@pytest.mark.real
def test_cached_generate_matches_hf_on_real_ranks(real_ranks):
    """One launch at tp=2: GPT-2, Llama with one K/V head, and (one layer each) Qwen2,
    Mistral and OPT, parallelized as users do."""
    real_check(real_ranks, 2, [("gpt2", 4, 2), ("llama", 1, 2), ("qwen2", 2, 1),
                               ("mistral", 2, 1), ("opt", 4, 1)])


@pytest.mark.real
@pytest.mark.timeout(240)
def test_cached_generate_matches_hf_on_real_ranks_tp4(real_ranks):
    """One launch at tp=4: a 1-layer Llama with 2 K/V heads, so each K/V head (and its cache)
    is held by a group of 2 ranks, and a 1-layer OPT (4 heads, one a rank); greedy, greedy
    to an eos and seeded sampling on a left-padded batch."""
    real_check(real_ranks, 4, [("llama", 2, 1), ("opt", 4, 1)])


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])  # llama: RoPE buffers unsaved
def test_cli_generates_from_a_checkpoint(tmp_path, capsys, preset):
    import safetensors.torch
    from shardplan import cli
    from shardplan.models import build as build_preset
    torch.manual_seed(4)
    model = build_preset(preset).eval()
    safetensors.torch.save_model(model, tmp_path / "model.safetensors")
    expected = generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    assert cli.main(["generate", preset, "--tp", "2", "--prompt", "1, 2, 3",
                     "--max-new-tokens", "4", "--checkpoint", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [str(int(t)) for t in expected[0]]


# --------------------------------------------------------------------------- bad arguments

@functools.lru_cache(maxsize=None)
def tiny():
    """gpt-tiny with one layer (vocabulary 96): generation without any capture."""
    from shardplan.models import build as build_preset
    torch.manual_seed(0)
    return build_preset("gpt-tiny", n_layer=1).eval()


PROMPT = torch.tensor([[1, 2, 3], [4, 5, 6]])
BAD = {  # argument -> values generate refuses (each with the others valid)
    "max_new_tokens": [-1, 2.0, True, "4", None],
    "do_sample": [1, "yes", None],
    "temperature": [0, -0.5, float("nan"), float("inf"), True, "1"],
    "top_k": [-1, 2.5, True, "5"],
    "top_p": [0, -0.1, 1.5, float("nan"), True, "0.9"],
    "eos_token_id": [-1, 96, 1.0, True, [3, 96], [None]],
    "pad_token_id": [-1, 96, 0.5, False],
    "generator": [0, "seed"],
}


@pytest.mark.parametrize("name,value", [pytest.param(k, v, id=f"{k}={v!r}")
                                        for k, vs in BAD.items() for v in vs])
def test_generate_refuses_a_bad_argument(name, value):
    with pytest.raises(shardplan.ConfigurationError) as info:
        generate(tiny(), PROMPT, **{"max_new_tokens": 2, "do_sample": True, name: value})
    msg = str(info.value)
    shown = f"{name}[{len(value) - 1}]={value[-1]!r}" if isinstance(value, list) else \
        f"{name}={value!r}"  # a list: its bad (last) element
    assert shown in msg and info.value.fix and "where: generate" in msg, msg


@pytest.mark.parametrize("ids,words", [
    (torch.tensor([1, 2, 3]), ["input_ids must be", "[3]"]),
    (torch.zeros(2, 0, dtype=torch.long), ["input_ids must be", "[2, 0]"]),
    (torch.zeros(2, 3), ["input_ids is torch.float32"]),
    (torch.ones(2, 3, dtype=torch.bool), ["input_ids is torch.bool"]),
    ([[1, 2, 3]], ["input_ids is list"]),
    (torch.tensor([[1, 96, 2]]), ["id 96", "[0, 96)"]),
    (torch.tensor([[1, -3, 2]]), ["id -3", "[0, 96)"]),
], ids=["1-D", "empty prompt", "float", "bool", "list", "id too large", "id negative"])
def test_generate_refuses_bad_input_ids(ids, words):
    with pytest.raises(shardplan.ConfigurationError) as info:
        generate(tiny(), ids, max_new_tokens=2)
    assert all(w in str(info.value) for w in words) and info.value.fix, str(info.value)


def test_generate_refuses_a_mask_of_another_shape():
    with pytest.raises(shardplan.ConfigurationError, match=r"attention_mask is \[2, 2\], "
                                                           r"input_ids \[2, 3\]"):
        generate(tiny(), PROMPT, max_new_tokens=2, attention_mask=torch.ones(2, 2))


def test_edge_values_generate():
    """Each edge of an allowed range generates: no new tokens is the prompt; top_k=1, and
    temperature near 0, sample the greedy tokens; top_p=1 and top_k=0 filter nothing
    (the same draws as no filtering); temperature 0 is greedy when not sampling; an eos
    list and a pad id at the vocabulary's last id."""
    model = tiny()
    greedy = generate(model, PROMPT, max_new_tokens=4)
    assert torch.equal(generate(model, PROMPT, max_new_tokens=0), PROMPT)
    assert torch.equal(generate(model, PROMPT, max_new_tokens=4, temperature=0), greedy)

    def sampled(**kw):
        return generate(model, PROMPT, max_new_tokens=4, do_sample=True,
                        generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(sampled(top_k=1), greedy)
    assert torch.equal(sampled(temperature=1e-6), greedy)
    plain = sampled()
    assert not torch.equal(plain, greedy)  # the draws differ from greedy: the next lines test
    assert torch.equal(sampled(top_p=1.0), plain) and torch.equal(sampled(top_k=0), plain)
    assert torch.equal(sampled(top_p=1.0, top_k=96), plain)
    first = int(greedy[0, 3])  # prompt 0 ends at its first generated token
    ended = generate(model, PROMPT, max_new_tokens=4, eos_token_id=[95, first], pad_token_id=95)
    assert torch.equal(ended[0, 3:], torch.tensor([first, 95, 95, 95]))
