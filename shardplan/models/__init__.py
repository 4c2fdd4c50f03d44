"""Bundled plain single-device models and named presets."""

import contextlib
import dataclasses
import difflib

import torch
import torch.nn as nn

from ..errors import ConfigurationError
from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "PRESETS", "build"]

_FAMILIES = {"gpt": GPT, "llama": Llama}

PRESETS = {
    "gpt-tiny": ("gpt", GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=32)),
    "gpt-small": ("gpt", GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)),
    "gpt-medium": ("gpt", GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024)),
    "gpt-8.3b": ("gpt", GPTConfig(vocab_size=51200, block_size=1024, n_layer=72, n_head=32, n_embd=3072)),
    "llama-tiny": ("llama", LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                        ffn_hidden=160, max_seq_len=64)),
    "llama-7b": ("llama", LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                                      ffn_hidden=11008)),
    "llama-70b": ("llama", LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                                       ffn_hidden=28672, max_seq_len=8192, rope_theta=500000.0)),
    "llama-405b": ("llama", LlamaConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                                        ffn_hidden=53248, rope_theta=500000.0)),
}


def _unknown_preset(name: str):
    raise ConfigurationError(f"unknown model preset {name!r}",
                             fix=f"use one of: {', '.join(sorted(PRESETS))}")


def build(name: str, device=None, **overrides) -> nn.Module:
    """Build preset `name` with optional config overrides; device="meta" allocates nothing."""
    if name not in PRESETS:
        _unknown_preset(name)
    family, config = PRESETS[name]
    fields = [f.name for f in dataclasses.fields(config)]
    for key in overrides:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigurationError(
                f"{type(config).__name__} of preset {name!r} has no field {key!r}",
                where=name, fix=f"{hint}its fields: {', '.join(fields)}")
    config = dataclasses.replace(config, **overrides)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return _FAMILIES[family](config)
