"""A plain GPT-2 style decoder (in the spirit of nanoGPT), single device."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._checks import counts, divides, require


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True
    fused_qkv: bool = True
    tie_weights: bool = True
    mlp_ratio: int = 4

    def __post_init__(self):
        counts(self, ("vocab_size", "block_size", "n_head", "n_embd", "mlp_ratio"), ("n_layer",))
        divides(self, "n_embd", "n_head")
        require(self, 0 <= self.dropout < 1, f"dropout={self.dropout} is not in [0, 1)",
                "pass a dropout probability in [0, 1), e.g. 0.1")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with fused or separate q/k/v projections."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.fused_qkv = config.fused_qkv
        C, bias = config.n_embd, config.bias
        if self.fused_qkv:
            self.c_attn = nn.Linear(C, 3 * C, bias=bias)
        else:
            self.q_proj = nn.Linear(C, C, bias=bias)
            self.k_proj = nn.Linear(C, C, bias=bias)
            self.v_proj = nn.Linear(C, C, bias=bias)
        self.c_proj = nn.Linear(C, C, bias=bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        B, T, C = x.size()
        if self.fused_qkv:
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        hd = C // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hd).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear -> GELU -> Linear -> dropout."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT language model: forward(idx, targets=None) -> (logits, loss)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Megatron init: N(0, 0.02), residual output projections N(0, 0.02/sqrt(2L)).

        Nothing to fill on ``meta`` (shapes only), so nothing is done there.
        """
        if self.transformer.wte.weight.is_meta:
            return
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.transformer.h:
            nn.init.normal_(block.attn.c_proj.weight, std=std)
            nn.init.normal_(block.mlp.c_proj.weight, std=std)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence length {t} exceeds block_size {self.config.block_size}"
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss
