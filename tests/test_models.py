"""Tests for the bundled plain single-device models."""

import math
import os

import pytest
import torch
from shardplan.errors import ConfigurationError
from torch.export import Dim, export

from shardplan.models import GPT, PRESETS, GPTConfig, Llama, LlamaConfig, build


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _num_params(model):
    return sum(p.numel() for p in model.parameters())


def _seq_len(model):
    return model.config.block_size if isinstance(model, GPT) else model.config.max_seq_len


def _overfit(model, steps=8, lr=1e-2):
    torch.manual_seed(0)
    V = model.config.vocab_size
    x, y = torch.randint(0, V, (4, 16)), torch.randint(0, V, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fused_qkv", [True, False])
@pytest.mark.parametrize("tie_weights", [True, False])
def test_gpt_overfits(fused_qkv, tie_weights):
    torch.manual_seed(0)
    model = build("gpt-tiny", fused_qkv=fused_qkv, tie_weights=tie_weights, dropout=0.1)
    losses = _overfit(model)
    assert losses[0] == pytest.approx(math.log(96), rel=0.1)
    assert losses[-1] < 0.7 * losses[0], losses


def test_llama_overfits():
    torch.manual_seed(0)
    losses = _overfit(build("llama-tiny"))
    assert losses[0] == pytest.approx(math.log(128), rel=0.1)
    assert losses[-1] < 0.7 * losses[0], losses


def test_fused_and_separate_qkv_module_names():
    fused = dict(build("gpt-tiny").named_parameters())
    separate = dict(build("gpt-tiny", fused_qkv=False).named_parameters())
    assert "transformer.h.0.attn.c_attn.weight" in fused
    assert {"transformer.h.0.attn.q_proj.weight", "transformer.h.0.attn.k_proj.weight",
            "transformer.h.0.attn.v_proj.weight"} <= set(separate)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_on_meta(name):
    model = build(name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())


def test_meta_build_allocates_nothing():
    build("llama-70b", device="meta")  # warm up imports and allocator
    before = _rss_bytes()
    model = build("llama-70b", device="meta")
    assert _rss_bytes() - before < 200 * 2**20
    assert _num_params(model) > 70e9


def test_exact_parameter_counts():
    assert _num_params(build("gpt-small", device="meta")) == 124_439_808
    assert _num_params(build("llama-7b", device="meta")) == 6_738_415_616


def test_tied_head_shares_one_parameter():
    model = build("gpt-tiny")
    assert model.lm_head.weight is model.transformer.wte.weight
    untied = build("gpt-tiny", tie_weights=False)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert _num_params(untied) == _num_params(model) + 96 * 32


def test_unknown_preset():
    with pytest.raises(ConfigurationError, match="gpt-tiny"):
        build("gpt-huge")


def test_config_validation():
    with pytest.raises(ConfigurationError, match="n_heads=4 is not divisible by n_kv_heads=3"):
        LlamaConfig(vocab_size=8, dim=64, n_layers=1, n_heads=4, n_kv_heads=3, ffn_hidden=8)
    with pytest.raises(ConfigurationError, match="n_embd=32 is not divisible by n_head=3"):
        GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=3, n_embd=32)
    assert LlamaConfig(vocab_size=8, dim=64, n_layers=1, n_heads=4, ffn_hidden=8).n_kv_heads == 4


def test_init_std():
    torch.manual_seed(0)
    L = 4
    gpt = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=L, n_head=4, n_embd=256))
    llama = Llama(LlamaConfig(vocab_size=512, dim=256, n_layers=L, n_heads=4, n_kv_heads=2, ffn_hidden=512))
    out_std = 0.02 / math.sqrt(2 * L)
    for model, out_names in [(gpt, ("attn.c_proj", "mlp.c_proj")), (llama, ("attention.wo", "feed_forward.w2"))]:
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                assert torch.all(p == 0), name
            elif p.dim() == 1:
                assert torch.all(p == 1), name
            else:
                expected = out_std if any(o in name for o in out_names) else 0.02
                assert p.std().item() == pytest.approx(expected, rel=0.1), name
                assert abs(p.mean().item()) < 0.1 * expected, name


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_export_dynamic_batch_and_seq(name):
    torch.manual_seed(0)
    model = build(name).eval()
    V = model.config.vocab_size
    idx = torch.randint(0, V, (2, 16))
    ep = export(model, (idx,), dynamic_shapes=({0: Dim("batch"), 1: Dim("seq", max=_seq_len(model))},),
                strict=False)
    for shape in [(2, 16), (3, 7), (1, _seq_len(model))]:
        x = torch.randint(0, V, shape)
        torch.testing.assert_close(ep.module()(x)[0], model(x)[0], rtol=0, atol=0)
