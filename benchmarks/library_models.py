"""Models from pip-installable libraries other than transformers (the ``[libs]`` extra),
tiny with random weights and a fixed seed: x-transformers' decoders (plain, ALiBi,
rotary, grouped-query, GLU) and vision Transformer, curated-transformers' Llama,
GPT-NeoX, Falcon, MPT and BERT. The coverage survey's library rows and
tests/test_libraries.py build them from here.

curated-transformers takes its attention mask as an ``AttentionMask`` object, which
``torch.export`` cannot take as an input: ``MaskedCall`` is the few lines a user
writes around it, taking the mask as a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

VOCAB = 101  # not divisible by 2 or 4: the vocabulary gets padded
HIDDEN, LAYERS, HEADS = 64, 2, 4
BATCH, SEQ = 2, 8
IMAGE, PATCH, CLASSES = 32, 8, 10


@dataclass(frozen=True)
class LibraryModel:
    """One surveyed model: how to build it and call it, and what Megatron would do to it."""

    name: str  # "library:variant"
    package: str  # the module to import (the library is installed when it imports)
    make: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    #: Megatron's collectives outside the layers: a g per vocab-parallel embedding lookup,
    #: an f before a column-parallel output head (2 for a language model, 1 for a ViT or
    #: an encoder that returns its hidden states)
    outside: int

    def build(self) -> nn.Module:
        torch.manual_seed(0)
        return self.make().float().eval()

    def megatron_collectives(self) -> int:
        """Megatron's count for one forward and backward with no loss inside the model:
        4 all-reduces per layer (2 forward, 2 backward), and those outside the layers."""
        return 4 * LAYERS + self.outside


def token_ids(b: int = BATCH, t: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(5))


def images(b: int = BATCH) -> torch.Tensor:
    return torch.randn(b, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(5))


def ids_and_mask() -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
    mask[-1, -2:] = False  # padding in the last sequence
    return token_ids(), mask


# ----------------------------------------------------------------- x-transformers

def x_decoder(**attn) -> Callable[[], nn.Module]:
    def make():
        from x_transformers import Decoder, TransformerWrapper
        return TransformerWrapper(num_tokens=VOCAB, max_seq_len=32, attn_layers=Decoder(
            dim=HIDDEN, depth=LAYERS, heads=HEADS, **attn))
    return make


def x_vit() -> nn.Module:
    from x_transformers import Encoder, ViTransformerWrapper
    return ViTransformerWrapper(image_size=IMAGE, patch_size=PATCH, num_classes=CLASSES,
                                attn_layers=Encoder(dim=HIDDEN, depth=LAYERS, heads=HEADS))


# ----------------------------------------------------------------- curated-transformers

class MaskedCall(nn.Module):
    """A curated-transformers model called with its mask as a tensor; returns the logits
    (a causal LM) or the last hidden states (an encoder)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, piece_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        from curated_transformers.layers import AttentionMask
        out = self.inner(piece_ids, AttentionMask(mask))
        return out.logits if hasattr(out, "logits") else out.last_hidden_layer_state


def curated(model_cls: str, config_cls: str, **config) -> Callable[[], nn.Module]:
    def make():
        import curated_transformers.models as models
        cfg = getattr(models, config_cls)(dtype=torch.float32, hidden_width=HIDDEN,
                                          n_hidden_layers=LAYERS, n_pieces=VOCAB, **config)
        return MaskedCall(getattr(models, model_cls)(cfg))
    return make


X, CURATED = "x_transformers", "curated_transformers"
MODELS = {m.name: m for m in [
    LibraryModel("x-transformers:decoder", X, x_decoder(), lambda: (token_ids(),), 2),
    LibraryModel("x-transformers:decoder-alibi", X, x_decoder(alibi_pos_bias=True),
                 lambda: (token_ids(),), 2),
    LibraryModel("x-transformers:decoder-rotary", X, x_decoder(rotary_pos_emb=True),
                 lambda: (token_ids(),), 2),
    LibraryModel("x-transformers:decoder-gqa", X, x_decoder(attn_kv_heads=2),
                 lambda: (token_ids(),), 2),
    LibraryModel("x-transformers:decoder-glu", X, x_decoder(ff_glu=True),
                 lambda: (token_ids(),), 2),
    LibraryModel("x-transformers:vit", X, x_vit, lambda: (images(),), 1),
    LibraryModel("curated-transformers:llama", CURATED,
                 curated("LlamaCausalLM", "LlamaConfig", intermediate_width=128, n_query_heads=4,
                         n_key_value_heads=2, rotary_embedding_fraction=1.0), ids_and_mask, 2),
    LibraryModel("curated-transformers:gpt-neox", CURATED,
                 curated("GPTNeoXCausalLM", "GPTNeoXConfig", intermediate_width=128,
                         n_attention_heads=4), ids_and_mask, 2),
    LibraryModel("curated-transformers:falcon", CURATED,
                 curated("FalconCausalLM", "FalconConfig", n_query_heads=4, n_key_value_heads=1),
                 ids_and_mask, 2),
    LibraryModel("curated-transformers:mpt", CURATED,
                 curated("MPTCausalLM", "MPTConfig", n_attention_heads=4), ids_and_mask, 2),
    LibraryModel("curated-transformers:bert", CURATED,
                 curated("BERTEncoder", "BERTConfig", embedding_width=HIDDEN,
                         intermediate_width=128, n_attention_heads=4, n_positions=32),
                 ids_and_mask, 1),
]}
