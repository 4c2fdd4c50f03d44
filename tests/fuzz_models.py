"""Random small Transformer-like models for the planner fuzzer (tests/test_fuzz.py).

A model is described by a ``ModelCfg`` (plain frozen dataclasses, so a failing
example prints as a config you can paste) and built by ``build_model``:

    token embedding (or float inputs) -> blocks -> norm -> head [-> loss]

Each block mixes an attention (fused / separate / per-head interleaved qkv,
MHA or GQA, bias on/off, SDPA or manual or einsum attention, causal / bool /
additive / input masks, ``nn.MultiheadAttention``) and an MLP (GELU, ReLU,
SiLU, SwiGLU, fused SwiGLU), LayerNorm / RMSNorm / a hand-written RMSNorm,
pre or post norm, with or without residuals. *Twists* put unusual ops on
activations at named sites inside and outside the tensor-parallel regions:

=========  =========================  ===========================================
site       shape                      where
=========  =========================  ===========================================
qkv        [B, T, (H + 2 KV) hd]      fused projection output, before the split
q          [B, T, H hd]               the query before the head split
heads      [B, H, T, hd]              the query after the head split
scores     [B, H, T, T]               attention scores (manual/einsum kernels)
probs      [B, H, T, T]               attention probabilities
merged     [B, T, H hd]               heads merged back, before the out projection
ffn        [B, T, F]                  MLP hidden, before the down projection
stream     [B, T, D]                  the residual stream (outside every region)
=========  =========================  ===========================================

``TWISTS`` lists every op with what it needs of its site.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class AttnCfg:
    heads: int
    kv_heads: int
    head_dim: int
    qkv: str = "separate"  # separate | fused | interleaved (per head [q k v]) | torch_mha
    bias: bool = False
    kernel: str = "sdpa"  # sdpa | manual | einsum
    mask: str = "causal"  # none | causal | bool | additive | input (padding mask argument)
    repeat: str = "expand"  # how GQA repeats kv heads: expand | repeat_interleave | index
    head_view: str = "sizes"  # sizes: view(B, T, H, hd) | minus1: view(B, T, H, -1) | unflatten
    merge: str = "reshape"  # reshape | view_minus1 | flatten


@dataclass(frozen=True)
class MlpCfg:
    hidden: int
    act: str = "gelu"  # gelu | relu | silu | gelu_tanh | swiglu | swiglu_fused | moe (Experts)
    bias: bool = True


@dataclass(frozen=True)
class BlockCfg:
    attn: AttnCfg | None
    mlp: MlpCfg | None
    norm: str = "layer"  # layer | rms | manual_rms | none
    order: str = "pre"  # pre | post
    residual: bool = True
    twists: tuple[tuple[str, str], ...] = ()  # (site, op)


@dataclass(frozen=True)
class ModelCfg:
    dim: int
    blocks: tuple[BlockCfg, ...]
    inputs: str = "tokens"  # tokens | floats
    vocab: int = 32  # tokens: the vocabulary; floats: the head's output size
    pos_embedding: bool = False
    final_norm: str = "layer"  # layer | rms | none
    tie: bool = False  # head shares the token embedding
    head_bias: bool = False
    loss: bool = False  # tokens: the model takes targets and returns (logits, loss)
    # put an op (x * 1.0) after the embedding and after every attention/MLP, so that no
    # linear reads their output directly (see test_fuzz.KNOWN_BUGS)
    guard_handoffs: bool = False
    batch: int = 2
    seq: int = 5
    seed: int = 0

    @property
    def needs_mask_input(self) -> bool:
        return any(b.attn is not None and b.attn.mask == "input" for b in self.blocks)


# --------------------------------------------------------------------------- twists


@dataclass(frozen=True)
class Twist:
    """An op put on an activation ``x`` at a site; returns a tensor of x's shape."""

    fn: object
    static_last: bool = False  # needs a literal (not batch/sequence) last dim
    even_last: bool = False  # needs an even last dim
    four_d: bool = False  # needs [B, H, T, *] (a head dim at 1)
    params: str = ""  # what the twist module holds: scale | norm | head | mix | perm | ...
    local: bool = True  # local under Megatron's sharding at every site (should never fall back)
    only: tuple[str, ...] = ()  # the sites it fits, if not every site


def _pairs_view(x):
    """An in-graph view with -1: [..., n] -> [..., n/2, 2], weighted, and back."""
    y = x.view(*x.shape[:-1], -1, 2) * torch.tensor([1.0, -0.5], dtype=x.dtype, device=x.device)
    return y.view(*x.shape[:-1], -1)


def _rotate_pairs(x):
    """Interleaved RoPE-style rotation: (a, b) -> (-b, a) over pairs of the last dim."""
    y = x.view(*x.shape[:-1], -1, 2)
    return torch.stack([-y[..., 1], y[..., 0]], -1).flatten(-2)


def _rope(m, x):
    """Rotate-half RoPE on [B, H, T, hd] with cos/sin tables sliced to the sequence."""
    t = x.shape[2]
    a, b = x.chunk(2, dim=-1)
    return x * m.cos[:t] + torch.cat([-b, a], dim=-1) * m.sin[:t]


def _head_iota(x):
    h = x.shape[1]
    return torch.arange(1, h + 1, dtype=x.dtype, device=x.device).view(h, 1, 1)


TWISTS: dict[str, Twist] = {
    # elementwise and casts: local everywhere
    "tanh": Twist(lambda m, x: torch.tanh(x) + x),
    "where": Twist(lambda m, x: torch.where(x > 0, x, 0.1 * x)),
    "masked_fill": Twist(lambda m, x: x.masked_fill(x > 1, 1.0)),
    "cast_double": Twist(lambda m, x: (x.double() * 1.5).float()),
    "cast_roundtrip": Twist(lambda m, x: x.to(torch.float64).to(x.dtype)),
    "dropout": Twist(lambda m, x: F.dropout(x, 0.25, training=m.training)),
    "scale_by_size": Twist(lambda m, x: x / math.sqrt(x.shape[-1]), static_last=True),
    # reductions over the last dim (the hidden dim at q/merged/ffn/stream/qkv sites)
    "cumsum": Twist(lambda m, x: x.cumsum(-1) * 0.3, local=False),
    "sort": Twist(lambda m, x: x.sort(-1).values, local=False),
    "topk": Twist(lambda m, x: x + x.topk(1, -1).values, local=False),
    "softmax": Twist(lambda m, x: x.softmax(-1), local=False),
    "log_softmax": Twist(lambda m, x: F.log_softmax(x, -1), local=False),
    "center": Twist(lambda m, x: x - x.mean(-1, keepdim=True), local=False),
    "sum_scale": Twist(lambda m, x: x * x.sum(-1, keepdim=True), local=False),
    "amax": Twist(lambda m, x: x - x.amax(-1, keepdim=True), local=False),
    "var": Twist(lambda m, x: x / (x.var(-1, keepdim=True) + 1).sqrt(), local=False),
    "std": Twist(lambda m, x: x / (x.std(-1, keepdim=True) + 1), local=False),
    "layer_norm": Twist(lambda m, x: F.layer_norm(x, (x.shape[-1],)), static_last=True,
                        local=False),
    "normalize": Twist(lambda m, x: F.normalize(x, dim=-1), local=False),
    # a norm over two trailing dims, a max whose gradient is shared by ties, GroupNorm
    "layer_norm_2d": Twist(lambda m, x: F.layer_norm(x.unflatten(-1, (2, -1)), (
        2, x.shape[-1] // 2)).flatten(-2), static_last=True, even_last=True, local=False),
    "amax_ties": Twist(lambda m, x: (lambda y: y * y.amax(-1, keepdim=True))(x.clamp(max=0.1)),
                       local=False),
    "group_norm": Twist(lambda m, x: F.group_norm(x.transpose(1, 2), 2).transpose(1, 2),
                        static_last=True, even_last=True, local=False,
                        only=("qkv", "q", "merged", "ffn", "stream")),
    "norm_module": Twist(lambda m, x: m.norm(x), static_last=True, params="norm", local=False),
    "sum_all": Twist(lambda m, x: x * x.sum().tanh(), local=False),
    # an RMSNorm written out over the last dim (OLMo2's q/k norm): distributed where split
    "dist_rms": Twist(lambda m, x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
                      * m.scale, static_last=True, params="scale", local=False),
    # reductions over another dim
    "seq_mean": Twist(lambda m, x: x - x.mean(-2, keepdim=True)),
    "head_mean": Twist(lambda m, x: x - x.mean(1, keepdim=True), four_d=True, local=False),
    # moves and copies of the last dim
    "transpose": Twist(lambda m, x: x.transpose(-1, -2).contiguous().transpose(-1, -2)),
    "permute": Twist(lambda m, x: x.permute(*range(x.dim() - 1, -1, -1)).permute(
        *range(x.dim() - 1, -1, -1))),
    "chunk_swap": Twist(lambda m, x: torch.cat(x.chunk(2, -1)[::-1], -1),
                        static_last=True, even_last=True, local=False),
    "chunk_mix": Twist(lambda m, x: (lambda a, b: torch.cat([a * b, a - b], -1))(*x.chunk(2, -1)),
                       static_last=True, even_last=True, local=False),
    "slice_halves": Twist(lambda m, x: torch.cat(
        [x[..., : x.shape[-1] // 2] * 2, x[..., x.shape[-1] // 2:]], -1),
        static_last=True, even_last=True, local=False),
    "slice_first": Twist(lambda m, x: torch.cat([x[..., :1] * 3, x[..., 1:]], -1),
                         static_last=True, local=False),
    "strided": Twist(lambda m, x: torch.cat([x[..., ::2], x[..., 1::2]], -1),
                     static_last=True, even_last=True, local=False),
    "pairs_view": Twist(lambda m, x: _pairs_view(x), static_last=True, even_last=True, local=False),
    "rotate_pairs": Twist(lambda m, x: _rotate_pairs(x), static_last=True, even_last=True,
                          local=False),
    "flip": Twist(lambda m, x: x.flip(-1), local=False),
    "roll": Twist(lambda m, x: x.roll(1, -1), local=False),
    "glu": Twist(lambda m, x: torch.cat([F.glu(x, -1), F.glu(x, -1) * 2], -1),
                 static_last=True, even_last=True, local=False),
    "index_perm": Twist(lambda m, x: x[..., m.perm], static_last=True, params="perm", local=False),
    "expand_sum": Twist(lambda m, x: (x.unsqueeze(-2).expand(*x.shape[:-1], 2, x.shape[-1])
                                      * m.pair).sum(-2), static_last=True, params="pair"),
    # constants and parameters over the last dim
    "iota": Twist(lambda m, x: x + torch.arange(x.shape[-1], dtype=x.dtype, device=x.device)
                  / x.shape[-1], static_last=True),
    "param_scale": Twist(lambda m, x: x * m.scale, static_last=True, params="scale"),
    "matmul_mix": Twist(lambda m, x: x @ m.mix, static_last=True, params="mix", local=False),
    "einsum_mix": Twist(lambda m, x: torch.einsum("...i,ij->...j", x, m.mix), static_last=True,
                        params="mix", local=False),
    # per-head constants ([B, H, T, *] sites): sliced to this rank's heads
    "head_param": Twist(lambda m, x: x * m.head[:, None, None], four_d=True, params="head"),
    "head_buffer": Twist(lambda m, x: x * m.head_buf, four_d=True, params="head_buf"),
    "head_slopes": Twist(lambda m, x: x + _head_iota(x) / x.shape[1], four_d=True),
    "head_einsum": Twist(lambda m, x: x * torch.einsum("bhtd,hd->bht", x, m.head_mat)[..., None],
                         four_d=True, params="head_mat", only=("heads",)),
    # rotary embedding on the head dim ([B, H, T, hd] with an even hd)
    "rope": Twist(_rope, four_d=True, static_last=True, even_last=True, params="rope",
                  only=("heads",)),
}

SITES_3D = ("qkv", "q", "merged", "ffn", "stream")
SITES_4D = ("heads", "scores", "probs")
STATIC_LAST = {"qkv": True, "q": True, "merged": True, "ffn": True, "stream": True,
               "heads": True, "scores": False, "probs": False}


def twist_fits(op: str, site: str, last: int | None) -> bool:
    """Can ``op`` go at ``site`` whose last dim has size ``last`` (None: symbolic)?"""
    t = TWISTS[op]
    if t.only and site not in t.only:
        return False
    if t.four_d and site not in SITES_4D:
        return False
    if (t.static_last or t.even_last) and not STATIC_LAST[site]:
        return False
    if t.even_last and (last is None or last % 2):
        return False
    return True


class TwistModule(nn.Module):
    def __init__(self, op: str, last: int | None, heads: int, head_dim: int = 0):
        super().__init__()
        self.op = op
        need = TWISTS[op].params
        if need == "scale":
            self.scale = nn.Parameter(torch.rand(last) + 0.5)
        elif need == "norm":
            self.norm = nn.RMSNorm(last)
            nn.init.uniform_(self.norm.weight, 0.5, 1.5)
        elif need == "mix":
            self.mix = nn.Parameter(torch.randn(last, last) / math.sqrt(last))
        elif need == "perm":
            self.register_buffer("perm", torch.randperm(last))
        elif need == "pair":
            self.register_buffer("pair", torch.tensor([[1.0], [-0.5]]))
        elif need == "head":
            self.head = nn.Parameter(torch.rand(heads) + 0.5)
        elif need == "head_buf":
            self.register_buffer("head_buf", torch.linspace(0.5, 1.5, heads).view(heads, 1, 1))
        elif need == "head_mat":
            self.head_mat = nn.Parameter(torch.randn(heads, head_dim) / math.sqrt(head_dim))
        elif need == "rope":
            freqs = torch.outer(torch.arange(16.0), 1.0 / 100 ** (torch.arange(0, last, 2) / last))
            angles = torch.cat([freqs, freqs], dim=-1)
            self.register_buffer("cos", angles.cos())
            self.register_buffer("sin", angles.sin())

    def forward(self, x):
        return TWISTS[self.op].fn(self, x)


class Sites(nn.Module):
    """The twists of one block, applied by site name."""

    def __init__(self, twists, sizes: dict[str, int | None], heads: int, head_dim: int):
        super().__init__()
        self.by_site: dict[str, list[str]] = {}
        self.mods = nn.ModuleDict()
        for i, (site, op) in enumerate(twists):
            name = f"{site}_{i}_{op}"
            self.mods[name] = TwistModule(op, sizes.get(site), heads, head_dim)
            self.by_site.setdefault(site, []).append(name)

    def at(self, site: str, x):
        for name in self.by_site.get(site, ()):
            x = self.mods[name](x)
        return x


# --------------------------------------------------------------------------- blocks


class ManualRMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind == "layer":
        norm = nn.LayerNorm(dim)
        nn.init.uniform_(norm.weight, 0.5, 1.5)
        nn.init.uniform_(norm.bias, -0.5, 0.5)
        return norm
    if kind == "rms":
        norm = nn.RMSNorm(dim)
        nn.init.uniform_(norm.weight, 0.5, 1.5)
        return norm
    if kind == "manual_rms":
        return ManualRMSNorm(dim)
    return nn.Identity()


class Attention(nn.Module):
    def __init__(self, dim: int, c: AttnCfg, sites: Sites):
        super().__init__()
        self.c, self.sites = c, sites
        H, KV, hd = c.heads, c.kv_heads, c.head_dim
        if c.qkv == "fused":
            self.wqkv = nn.Linear(dim, (H + 2 * KV) * hd, bias=c.bias)
        elif c.qkv == "interleaved":
            self.wqkv = nn.Linear(dim, 3 * H * hd, bias=c.bias)
        elif c.qkv == "separate":
            self.wq = nn.Linear(dim, H * hd, bias=c.bias)
            self.wk = nn.Linear(dim, KV * hd, bias=c.bias)
            self.wv = nn.Linear(dim, KV * hd, bias=c.bias)
        if c.qkv == "torch_mha":
            self.mha = nn.MultiheadAttention(dim, H, bias=c.bias, batch_first=True)
        else:
            self.wo = nn.Linear(H * hd, dim, bias=c.bias)

    def _heads(self, t, B, T, n):
        hd = self.c.head_dim
        if self.c.head_view == "minus1":
            t = t.view(B, T, n, -1)
        elif self.c.head_view == "unflatten":
            t = t.unflatten(-1, (n, hd))
        else:
            t = t.view(B, T, n, hd)
        return t.transpose(1, 2)

    def _repeat(self, t):
        c = self.c
        rep = c.heads // c.kv_heads
        if rep == 1:
            return t
        B, KV, T, hd = t.shape
        if c.repeat == "repeat_interleave":
            return t.repeat_interleave(rep, dim=1)
        if c.repeat == "index":
            idx = torch.arange(c.heads, device=t.device) // rep
            return t[:, idx]
        return t[:, :, None].expand(B, KV, rep, T, hd).reshape(B, KV * rep, T, hd)

    def _mask(self, B, T, x, pad):
        """(kind, mask) for the attention, built in the graph."""
        c = self.c
        if c.mask == "none":
            return None
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if c.mask in ("causal", "bool"):
            return causal
        if c.mask == "additive":
            return torch.zeros(T, T, dtype=x.dtype, device=x.device).masked_fill(~causal, -1e9)
        # input: a [B, T] padding mask (1 = keep), combined with causality
        keep = pad[:, None, None, :].bool() & causal
        return torch.zeros(B, 1, T, T, dtype=x.dtype, device=x.device).masked_fill(~keep, -1e9)

    def forward(self, x, pad=None):
        c, s = self.c, self.sites
        B, T, _ = x.shape
        H, KV, hd = c.heads, c.kv_heads, c.head_dim
        mask = self._mask(B, T, x, pad)
        if c.qkv == "torch_mha":
            if mask is not None and mask.dtype == torch.bool:
                mask = ~mask  # nn.MultiheadAttention: True = not allowed
            if mask is not None and mask.dim() == 4:
                mask = mask.expand(B, H, T, T).reshape(B * H, T, T)
            y, _ = self.mha(x, x, x, attn_mask=mask, need_weights=False)
            return s.at("merged", y)
        if c.qkv == "fused":
            qkv = s.at("qkv", self.wqkv(x))
            q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
        elif c.qkv == "interleaved":
            qkv = s.at("qkv", self.wqkv(x)).view(B, T, H, 3 * hd)
            q, k, v = (t.reshape(B, T, H * hd) for t in qkv.split(hd, dim=-1))
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = s.at("q", q)
        q, k, v = self._heads(q, B, T, H), self._heads(k, B, T, KV), self._heads(v, B, T, KV)
        q = s.at("heads", q)
        k, v = self._repeat(k), self._repeat(v)
        if c.kernel == "sdpa" and "scores" not in s.by_site and "probs" not in s.by_site:
            causal = c.mask == "causal"
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else mask,
                                               is_causal=causal)
        else:
            if c.kernel == "einsum":
                scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(hd)
            else:
                scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
            scores = s.at("scores", scores)
            if mask is not None and mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, float("-inf"))
            elif mask is not None:
                scores = scores + mask
            probs = s.at("probs", scores.softmax(-1))
            y = torch.einsum("bhqk,bhkd->bhqd", probs, v) if c.kernel == "einsum" else probs @ v
        y = y.transpose(1, 2)
        if c.merge == "view_minus1":
            y = y.contiguous().view(B, T, -1)
        elif c.merge == "flatten":
            y = y.flatten(2)
        else:
            y = y.reshape(B, T, H * hd)
        return self.wo(s.at("merged", y))


class Mlp(nn.Module):
    def __init__(self, dim: int, c: MlpCfg, sites: Sites):
        super().__init__()
        self.c, self.sites = c, sites
        if c.act == "swiglu":
            self.gate = nn.Linear(dim, c.hidden, bias=c.bias)
            self.up = nn.Linear(dim, c.hidden, bias=c.bias)
        elif c.act == "swiglu_fused":
            self.gate_up = nn.Linear(dim, 2 * c.hidden, bias=c.bias)
        else:
            self.up = nn.Linear(dim, c.hidden, bias=c.bias)
        self.down = nn.Linear(c.hidden, dim, bias=c.bias)

    def forward(self, x):
        act = self.c.act
        if act == "swiglu":
            h = F.silu(self.gate(x)) * self.up(x)
        elif act == "swiglu_fused":
            g, u = self.gate_up(x).chunk(2, dim=-1)
            h = F.silu(g) * u
        else:
            h = self.up(x)
            h = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu,
                 "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act](h)
        return self.down(self.sites.at("ffn", h))


class Experts(nn.Module):
    """Mixture of experts, HF's weight layout: ``w_up`` (experts, 2 hidden, dim) is each
    expert's fused gate | up, ``w_down`` (experts, dim, hidden) its down projection, both
    read transposed; a router's top-2 weights (zero for the other experts) combine the
    experts' outputs. Every expert runs on every token (no bias: ``MlpCfg.bias`` unused)."""

    EXPERTS = 4

    def __init__(self, dim: int, c: MlpCfg):
        super().__init__()
        e, h = self.EXPERTS, c.hidden
        self.router = nn.Parameter(torch.randn(e, dim) / math.sqrt(dim))
        self.w_up = nn.Parameter(torch.randn(e, 2 * h, dim) / math.sqrt(dim))
        self.w_down = nn.Parameter(torch.randn(e, dim, h) / math.sqrt(h))

    def forward(self, x):
        B, T, D = x.shape
        probs = F.linear(x, self.router).softmax(-1)  # [B, T, E]
        top, idx = probs.topk(2, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, idx, top)
        gate, up = (x.reshape(1, -1, D) @ self.w_up.transpose(1, 2)).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ self.w_down.transpose(1, 2)  # [E, B*T, D]
        y = y * weights.reshape(-1, self.EXPERTS).t().unsqueeze(-1)
        return y.sum(0).view(B, T, D)


def _guard(x):
    return x * 1.0


class Block(nn.Module):
    def __init__(self, dim: int, c: BlockCfg, guard: bool = False):
        super().__init__()
        self.c = c
        self.guard = _guard if guard else (lambda x: x)
        a = c.attn
        sizes = {"stream": dim, "ffn": c.mlp.hidden if c.mlp else None}
        if a is not None:
            sizes.update(qkv=(a.heads + 2 * a.kv_heads) * a.head_dim if a.qkv == "fused"
                         else 3 * a.heads * a.head_dim,
                         q=a.heads * a.head_dim, heads=a.head_dim, scores=None, probs=None,
                         merged=a.heads * a.head_dim if a.qkv != "torch_mha" else dim)
        self.sites = Sites(c.twists, sizes, a.heads if a else 1, a.head_dim if a else 0)
        self.attn = Attention(dim, a, self.sites) if a else None
        self.mlp = (Experts(dim, c.mlp) if c.mlp.act == "moe" else Mlp(dim, c.mlp, self.sites)) \
            if c.mlp else None
        self.norm1, self.norm2 = make_norm(c.norm, dim), make_norm(c.norm, dim)

    def _sub(self, f, norm, x, *extra):
        if self.c.order == "pre":
            y = self.guard(f(norm(x), *extra))
            return x + y if self.c.residual else y
        y = self.guard(f(x, *extra))
        return norm(x + y if self.c.residual else y)

    def forward(self, x, pad=None):
        if self.attn is not None:
            x = self._sub(self.attn, self.norm1, x, pad)
        x = self.sites.at("stream", x)
        if self.mlp is not None:
            x = self._sub(self.mlp, self.norm2, x)
        return x


class FuzzModel(nn.Module):
    def __init__(self, c: ModelCfg):
        super().__init__()
        self.c = c
        if c.inputs == "tokens":
            self.embed = nn.Embedding(c.vocab, c.dim)
        if c.pos_embedding:
            self.pos = nn.Embedding(16, c.dim)
        self.blocks = nn.ModuleList(Block(c.dim, b, c.guard_handoffs) for b in c.blocks)
        self.norm = make_norm(c.final_norm, c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=c.head_bias)
        if c.tie and c.inputs == "tokens":
            self.head.weight = self.embed.weight

    def forward(self, x, pad=None, targets=None):
        T = x.shape[1]
        if self.c.inputs == "tokens":
            x = self.embed(x)
            if self.c.guard_handoffs:
                x = _guard(x)
        if self.c.pos_embedding:
            x = x + self.pos(torch.arange(T, device=x.device))
        for b in self.blocks:
            x = b(x, pad)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(c: ModelCfg) -> nn.Module:
    torch.manual_seed(c.seed)
    return FuzzModel(c).eval()


def example_inputs(c: ModelCfg) -> dict:
    """The keyword inputs a ``ModelCfg``'s model is called with."""
    g = torch.Generator().manual_seed(c.seed + 1)
    if c.inputs == "tokens":
        x = torch.randint(0, c.vocab, (c.batch, c.seq), generator=g)
    else:
        x = torch.randn(c.batch, c.seq, c.dim, generator=g)
    out = {"x": x}
    if c.needs_mask_input:
        pad = (torch.rand(c.batch, c.seq, generator=g) > 0.3).long()
        pad[:, 0] = 1  # every query sees at least one key
        out["pad"] = pad
    if c.loss and c.inputs == "tokens":
        out["targets"] = torch.randint(0, c.vocab, (c.batch, c.seq), generator=g)
    return out


def kv_groups(a: AttnCfg, tp: int) -> bool:
    """K/V heads held by groups of ranks (Megatron's GQA with fewer K/V heads than tp):
    separate K and V projections whose head count is at least 2 and divides tp."""
    return a.qkv == "separate" and 2 <= a.kv_heads < tp and tp % a.kv_heads == 0


def divides(c: ModelCfg, tp: int) -> bool:
    """Does every size the Megatron rules split divide by ``tp`` (K/V heads: or form
    replica groups, ``kv_groups``)?"""
    for b in c.blocks:
        if b.attn is not None and (b.attn.heads % tp or (b.attn.kv_heads % tp
                                                         and not kv_groups(b.attn, tp))):
            return False
        if b.mlp is not None and b.mlp.hidden % tp:
            return False
    return True


_PARAM_TWISTS = ("scale", "norm", "mix", "head", "head_mat")  # twist modules with parameters


def megatron_block_count(c: ModelCfg, tp: int, head_sharded: bool) -> dict:
    """The collectives Megatron-LM issues for the blocks of a ``ModelCfg`` model at
    ``tp`` > 1 (every region sharded), from the description alone:

    - ``forward``: one all-reduce (g) of B*T*D per region (attention, MLP), issued
      inside the block: ``{(kind, elements): n}`` of the forward records whose site
      is under ``blocks.``;
    - ``backward``: every backward collective: one all-reduce (f) of B*T*D per
      region whose input needs a gradient (not the raw float input of a model
      whose first region reads it before any parameter), one for the LM head's f
      when the head is vocabulary-parallel, and for K/V heads held by replica
      groups the K and V weight (and bias) gradients' all-reduces.
    """
    from collections import Counter

    btd = c.batch * c.seq * c.dim
    fwd, bwd = Counter(), Counter()
    grad = c.inputs == "tokens" or c.pos_embedding  # does the residual stream need a grad
    for b in c.blocks:
        subs = [("attn", b.attn), ("stream", None), ("mlp", b.mlp)]
        for kind, cfg in subs:
            if kind == "stream":
                grad = grad or any(site == "stream" and TWISTS[op].params in _PARAM_TWISTS
                                   for site, op in b.twists)
                continue
            if cfg is None:
                continue
            region_input_grad = grad or (b.order == "pre" and b.norm != "none")
            fwd[("all_reduce", btd)] += 1
            if region_input_grad:
                bwd[("all_reduce", btd)] += 1
            if kind == "mlp" and cfg.act == "moe":  # the routing weights' gradient
                bwd[("all_reduce", Experts.EXPERTS * c.batch * c.seq)] += 1
            if kind == "attn" and kv_groups(cfg, tp):
                weight = cfg.kv_heads * cfg.head_dim * c.dim
                bwd[("all_reduce", weight)] += 2
                if cfg.bias:
                    bwd[("all_reduce", cfg.kv_heads * cfg.head_dim)] += 2
            grad = True  # the region's output depends on its parameters
    if head_sharded:
        bwd[("all_reduce", btd)] += 1
    return {"forward": fwd, "backward": bwd}
