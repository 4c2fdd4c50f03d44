"""``shardplan demo``: the main job in one command, on a laptop's CPU.

    shardplan demo                       # tp=2, two gloo processes, ~1-2 minutes
    shardplan demo --tp 2 --dp 2 --size tiny --steps 60 --out /tmp/demo

1. plans the bundled GPT (byte tokens, sized for text) and prints the memory
   and communication summary of the layout report;
2. starts ``tp * dp`` gloo worker processes (``RealRanks``) and trains the
   sharded model on the public-domain corpus bundled in ``shardplan.data``
   (AdamW, weight decay 0.01, gradient clipping at 1.0, warm-up then cosine),
   with a progress line;
3. trains the unsharded model on the same batches in this process and
   compares the two loss curves step by step;
4. writes ``loss.png``, ``plan.json``, ``summary.md`` and ``summary.json``
   into the output folder.

Exit status 0 when the curves agree within fp32 tolerance, 1 when not.

With ``--dp`` > 1, rank ``r`` is tensor-parallel rank ``r % tp`` of data-
parallel replica ``r // tp``; each replica takes its slice of the global batch
and gradients (and the logged loss) are averaged over the replicas before
clipping and the optimizer step, so the run is the unsharded run on the whole
batch. Nothing here needs matplotlib or tqdm: the progress line and the PNG
(``write_png``, ``plot_curves``) are written by hand.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import struct
import sys
import time
import zlib
from dataclasses import asdict, dataclass

import torch

#: model sizes: the bundled GPT with byte tokens (vocabulary 256)
SIZES = {
    "tiny": dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64),
    "small": dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128),
}
CORPUS = "corpus.txt"  # in the shardplan.data package
PLOT_SIZE = (800, 480)
#: two fp32 runs of the same math, summed in different orders, agree this well
#: (per step: |sharded - unsharded| <= ATOL + RTOL * |unsharded|)
ATOL, RTOL = 1e-3, 1e-4


@dataclass
class DemoConfig:
    tp: int = 2
    dp: int = 1
    steps: int = 120
    size: str = "small"
    out: str = "shardplan-demo"
    seed: int = 0
    batch: int = 16  # global: split over the dp replicas
    lr: float = 3e-3
    weight_decay: float = 0.01
    clip: float = 1.0

    @property
    def block(self) -> int:
        return SIZES[self.size]["block_size"]

    @property
    def warmup(self) -> int:
        return max(1, self.steps // 10)


# -- data -----------------------------------------------------------------

def load_corpus() -> torch.Tensor:
    """The bundled corpus as byte tokens (uint8)."""
    from importlib import resources
    raw = resources.files("shardplan.data").joinpath(CORPUS).read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def get_batch(data: torch.Tensor, step: int, cfg: DemoConfig):
    """Step ``step``'s global batch ``(x, y)``: random windows, the same on every rank."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - cfg.block - 1, (cfg.batch,), generator=g).tolist()
    x = torch.stack([data[i:i + cfg.block] for i in starts]).long()
    y = torch.stack([data[i + 1:i + 1 + cfg.block] for i in starts]).long()
    return x, y


# -- the model and one training step (shared by both runs) ----------------

def build_model(cfg: DemoConfig):
    from .models import build
    torch.manual_seed(cfg.seed)
    return build("gpt-tiny", **SIZES[cfg.size])


def make_optimizer(model, cfg: DemoConfig) -> torch.optim.Optimizer:
    """AdamW; matrices decay, biases and norms do not (as in nanoGPT/Megatron)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": other, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, cfg: DemoConfig) -> float:
    """Linear warm-up to ``cfg.lr``, then cosine down to a tenth of it (step from 0)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def tp_clip_grad_norm_(model, max_norm: float, group) -> torch.Tensor:
    """Clip a tensor-parallel model's gradients by their global norm.

    Each gradient element is counted once over the group: split parameters
    contribute their shard on every rank, replicated ones only on rank 0
    (and a shard held by ``replicas`` ranks only on the first of them).
    One all-reduce. Returns the norm before clipping (the same on every rank).
    """
    from .layouts import Replicate, Shard
    grads, mine = [], []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        lay = model.layouts.get(name, Replicate())
        copies = lay.replicas if isinstance(lay, Shard) else group.size
        if group.rank % copies == 0:
            mine.append(p.grad.detach().double().square().sum())
    sq = torch.stack(mine).sum() if mine else torch.zeros((), dtype=torch.float64)
    total = group.all_reduce(sq.reshape(1), site="demo: grad norm").sqrt().float()[0]
    _scale(grads, max_norm, total)
    return total


def _clip_grad_norm_(model, max_norm: float) -> torch.Tensor:
    """The unsharded twin of ``tp_clip_grad_norm_`` (same fp64 sum, same scaling)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.stack([g.detach().double().square().sum() for g in grads]).sum().sqrt().float()
    _scale(grads, max_norm, total)
    return total


def _scale(grads, max_norm: float, total: torch.Tensor) -> None:
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


def train_step(model, opt, x, y, step: int, cfg: DemoConfig, clip, average=None):
    """Forward, backward, (average over dp), clip, AdamW step; (loss, grad norm)."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    _, loss = model(x, y)
    loss.backward()
    loss = loss.detach()
    if average is not None:
        loss = average(loss)
    norm = clip(model, cfg.clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss), float(norm)


# -- on each rank (top-level: RealRanks pickles them by name) -------------

_RANK: dict = {}  # this worker's model, optimizer and groups, between runs


def _rank_setup(ctx, cfg: DemoConfig, data: torch.Tensor) -> dict:
    import torch.distributed as dist
    import shardplan
    from .runtime.comm import TorchGroup
    _RANK.clear()
    tp_rank, dp_rank = ctx.rank % cfg.tp, ctx.rank // cfg.tp
    if cfg.dp == 1:
        tp_group, dp_group = ctx.group, None
    else:  # every rank creates every group, in the same order
        tp_group = dp_group = None
        for d in range(cfg.dp):
            pg = dist.new_group([d * cfg.tp + t for t in range(cfg.tp)])
            if d == dp_rank:
                tp_group = TorchGroup(pg)
        for t in range(cfg.tp):
            pg = dist.new_group([d * cfg.tp + t for d in range(cfg.dp)])
            if t == tp_rank:
                dp_group = TorchGroup(pg)
    model = build_model(cfg)
    x, y = _local(get_batch(data, 0, cfg), dp_rank, cfg)
    sharded = shardplan.parallelize(model, group=tp_group, example_inputs=(x, y))
    _RANK.update(model=sharded, opt=make_optimizer(sharded, cfg), cfg=cfg, data=data,
                 tp_group=tp_group, dp_group=dp_group, dp_rank=dp_rank)
    return {"tp_rank": tp_group.rank, "dp_rank": dp_rank,
            "local_params": sum(p.numel() for p in sharded.parameters())}


def _rank_steps(ctx, start: int, n: int) -> list[tuple[float, float]]:
    s = _RANK
    cfg, model, tp_group, dp_group = s["cfg"], s["model"], s["tp_group"], s["dp_group"]
    average = None if dp_group is None else (lambda loss: _dp_average(model, loss, dp_group))
    out = []
    for step in range(start, start + n):
        x, y = _local(get_batch(s["data"], step, cfg), s["dp_rank"], cfg)
        out.append(train_step(model, s["opt"], x, y, step, cfg,
                              lambda m, c: tp_clip_grad_norm_(m, c, tp_group), average))
    return out


def _rank_close(ctx) -> None:
    _RANK.clear()


def _local(batch, dp_rank: int, cfg: DemoConfig):
    """This data-parallel replica's rows of the global batch."""
    rows = cfg.batch // cfg.dp
    return tuple(t[dp_rank * rows:(dp_rank + 1) * rows] for t in batch)


def _dp_average(model, loss: torch.Tensor, group) -> torch.Tensor:
    """Average every gradient and the loss over the dp group: one all-reduce."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss.reshape(1).to(grads[0].dtype)])
    flat = group.all_reduce(flat, site="demo: dp gradient average") / group.size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat[-1]


# -- progress line ----------------------------------------------------------

class Progress:
    """One line redrawn with ``\\r`` on a terminal; a line every ~10% otherwise."""

    def __init__(self, total: int, label: str, stream=None, width: int = 24):
        self.total, self.label, self.width = total, label, width
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = max(1, total // 10)

    def update(self, done: int, loss: float, tok_s: float) -> None:
        text = (f"{self.label} {done:>{len(str(self.total))}}/{self.total} "
                f"loss {loss:7.4f}  {tok_s:8,.0f} tok/s")
        if self.tty:
            fill = self.width * done // self.total
            bar = "#" * fill + "." * (self.width - fill)
            self.stream.write(f"\r{self.label} [{bar}] {text[len(self.label) + 1:]}\x1b[K")
            self.stream.flush()
        elif done == 1 or done % self.every == 0 or done == self.total:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# -- the demo -------------------------------------------------------------

def _plan_summary(plan) -> str:
    """The report's header, memory and communication; the per-parameter table counted."""
    text = plan.report()
    head = text.split("\nparameters (layout:")[0].rstrip()
    kinds: dict[str, int] = {}
    for p in plan.params:
        kind = "replicated" if p.layout == "R" else "split"
        kinds[kind] = kinds.get(kind, 0) + 1
    listed = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), reverse=True))
    return f"{head}\nparameter tensors: {listed} (every layout in plan.json)"


def _train_sharded(cfg: DemoConfig, data: torch.Tensor, ranks) -> tuple[list, float]:
    ranks.run(_rank_setup, cfg, data)
    bar = Progress(cfg.steps, f"tp={cfg.tp} dp={cfg.dp}")
    curve, t_train = [], 0.0
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        curve.append(ranks.run(_rank_steps, step, 1)[0][0])
        t_train += time.perf_counter() - t0
        bar.update(step + 1, curve[-1][0], (step + 1) * cfg.batch * cfg.block / t_train)
    bar.close()
    ranks.run(_rank_close)
    return curve, t_train


def _train_unsharded(cfg: DemoConfig, data: torch.Tensor, model) -> tuple[list, float]:
    opt = make_optimizer(model, cfg)
    bar = Progress(cfg.steps, "unsharded")
    curve, t_train = [], 0.0
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        x, y = get_batch(data, step, cfg)
        curve.append(train_step(model, opt, x, y, step, cfg, _clip_grad_norm_))
        t_train += time.perf_counter() - t0
        bar.update(step + 1, curve[-1][0], (step + 1) * cfg.batch * cfg.block / t_train)
    bar.close()
    return curve, t_train


def check(cfg: DemoConfig) -> None:
    from .errors import ConfigurationError
    if cfg.size not in SIZES:
        raise ConfigurationError(f"unknown size {cfg.size!r}", fix=f"use one of {', '.join(SIZES)}")
    if cfg.tp < 1 or cfg.dp < 1 or cfg.steps < 1:
        raise ConfigurationError(f"--tp, --dp and --steps must be positive, got "
                                 f"tp={cfg.tp} dp={cfg.dp} steps={cfg.steps}")
    if cfg.batch % cfg.dp:
        raise ConfigurationError(f"the batch of {cfg.batch} sequences does not split over dp={cfg.dp}",
                                 fix="pick --dp dividing --batch")
    heads = SIZES[cfg.size]["n_head"]
    if heads % cfg.tp:
        raise ConfigurationError(f"tp={cfg.tp} does not divide the {heads} attention heads "
                                 f"of size {cfg.size!r}", fix="use --tp 1, 2 or 4")


def run(cfg: DemoConfig) -> int:
    """The whole demo; returns the exit status (0: the curves agree)."""
    import shardplan
    from .ranks import RealRanks
    check(cfg)
    t_start = time.perf_counter()
    data = load_corpus()
    model = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    example = _local(get_batch(data, 0, cfg), 0, cfg)
    plan = shardplan.plan(model, cfg.tp, example_inputs=example)
    print(f"shardplan demo: GPT {cfg.size} ({n_params / 1e6:.2f} M parameters, "
          f"{SIZES[cfg.size]['n_layer']} layers, n_embd {SIZES[cfg.size]['n_embd']}, "
          f"byte tokens), {len(data) / 1024:.0f} KiB of text, "
          f"{cfg.steps} steps of {cfg.batch} x {cfg.block} tokens\n")
    print(_plan_summary(plan))
    world = cfg.tp * cfg.dp
    print(f"\nstarting {world} gloo processes (tp={cfg.tp} x dp={cfg.dp}) ...", flush=True)
    t0 = time.perf_counter()
    with RealRanks(world) as ranks:
        ranks.start()
        spawn = time.perf_counter() - t0
        sharded, t_sharded = _train_sharded(cfg, data, ranks)
    unsharded, t_unsharded = _train_unsharded(cfg, data, model)
    a = [loss for loss, _ in sharded]
    b = [loss for loss, _ in unsharded]
    diffs = [abs(u - v) for u, v in zip(a, b)]
    bad = [i for i, (u, v) in enumerate(zip(a, b)) if abs(u - v) > ATOL + RTOL * abs(v)
           or not math.isfinite(u)]
    ok = not bad
    tokens = cfg.batch * cfg.block
    os.makedirs(cfg.out, exist_ok=True)
    files = {name: os.path.join(cfg.out, name)
             for name in ("loss.png", "plan.json", "summary.json", "summary.md")}
    width, height = PLOT_SIZE
    title = (f"shardplan demo: GPT {cfg.size}, tp={cfg.tp} dp={cfg.dp} vs unsharded, "
             f"max |Δloss| {max(diffs):.1e}")
    plot_curves(files["loss.png"], [(f"unsharded", b, (240, 150, 40), 5),
                                    (f"tp={cfg.tp} dp={cfg.dp} ({world} gloo processes)",
                                     a, (30, 70, 200), 1)],
                title=title, xlabel="step", ylabel="loss", size=PLOT_SIZE)
    with open(files["plan.json"], "w") as f:
        f.write(plan.to_json())
    summary = {
        "config": asdict(cfg), "model": dict(SIZES[cfg.size], parameters=n_params),
        "corpus_bytes": len(data), "tokens_per_step": tokens,
        "losses": {"sharded": a, "unsharded": b},
        "grad_norms": {"sharded": [n for _, n in sharded], "unsharded": [n for _, n in unsharded]},
        "max_abs_diff": max(diffs), "tolerance": {"atol": ATOL, "rtol": RTOL},
        "steps_out_of_tolerance": bad, "match": ok,
        "tokens_per_s": {"sharded": cfg.steps * tokens / t_sharded,
                         "unsharded": cfg.steps * tokens / t_unsharded},
        "seconds": {"spawn": spawn, "sharded": t_sharded, "unsharded": t_unsharded,
                    "total": time.perf_counter() - t_start},
        "plan": {"param_bytes_per_rank": plan.memory.param_bytes_per_rank,
                 "param_bytes_unsharded": plan.memory.param_bytes_unsharded,
                 "collectives_per_step": len(plan.collectives),
                 "comm_bytes_per_step": sum(c.bytes for c in plan.collectives),
                 "warnings": len(plan.warnings)},
        "plot": {"file": "loss.png", "width": width, "height": height},
    }
    with open(files["summary.json"], "w") as f:
        json.dump(summary, f, indent=2)
    with open(files["summary.md"], "w") as f:
        f.write(_markdown(summary))
    verdict = ("the curves match" if ok else
               f"the curves DISAGREE at {len(bad)} steps (first: step {bad[0]})")
    print(f"\nfinal loss: tp={cfg.tp} dp={cfg.dp} {a[-1]:.4f}, unsharded {b[-1]:.4f}; "
          f"max |Δloss| over {cfg.steps} steps = {max(diffs):.2e} "
          f"(tolerance {ATOL:g} + {RTOL:g}·|loss|): {verdict}")
    print(f"wrote {', '.join(files.values())}")
    return 0 if ok else 1


def _markdown(s: dict) -> str:
    c, p = s["config"], s["plan"]
    a, b = s["losses"]["sharded"], s["losses"]["unsharded"]
    from .report import human
    rows = sorted({0, len(a) // 4, len(a) // 2, 3 * len(a) // 4, len(a) - 1})
    table = "\n".join(f"| {i} | {a[i]:.6f} | {b[i]:.6f} | {abs(a[i] - b[i]):.2e} |" for i in rows)
    verdict = "match" if s["match"] else "**DISAGREE**"
    return f"""# shardplan demo

GPT {c['size']} ({s['model']['parameters']:,} parameters, {s['model']['n_layer']} layers,
n_embd {s['model']['n_embd']}, byte tokens) trained {c['steps']} steps on
{s['corpus_bytes']:,} bytes of public-domain text, {s['tokens_per_step']} tokens per step
(AdamW lr {c['lr']:g}, weight decay {c['weight_decay']:g}, clipping {c['clip']:g}, seed {c['seed']}).

- sharded: tp={c['tp']} x dp={c['dp']} on {c['tp'] * c['dp']} gloo processes,
  {s['tokens_per_s']['sharded']:,.0f} tokens/s
- unsharded: one process, {s['tokens_per_s']['unsharded']:,.0f} tokens/s
- loss curves: **{verdict}**, max |Δloss| = {s['max_abs_diff']:.2e}
  (tolerance {s['tolerance']['atol']:g} + {s['tolerance']['rtol']:g}·|loss| per step)
- plan: parameters per rank {human(p['param_bytes_per_rank'])} of
  {human(p['param_bytes_unsharded'])} unsharded; {p['collectives_per_step']} collectives,
  {human(p['comm_bytes_per_step'])} per step and tp group

| step | tp={c['tp']} dp={c['dp']} | unsharded | abs diff |
|---:|---:|---:|---:|
{table}

Files: `loss.png` (both curves), `plan.json` (`shardplan.Plan.from_json`), `summary.json`.
"""


# -- PNG, by hand ---------------------------------------------------------

def write_png(path: str, width: int, height: int, rgb: bytes | bytearray) -> None:
    """Write 8-bit RGB pixels (row-major, ``3 * width * height`` bytes) as a PNG."""
    if len(rgb) != 3 * width * height:
        raise ValueError(f"expected {3 * width * height} bytes of RGB, got {len(rgb)}")
    stride = 3 * width
    raw = b"".join(b"\x00" + bytes(rgb[y * stride:(y + 1) * stride]) for y in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n"
                + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))


_GLYPHS = {  # 5x7 bitmaps: 7 rows of 5 pixels, '#' is ink
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.",
    "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####",
    "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.",
    "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.",
    "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.",
    "9": ".###. #...# #...# .#### ....# ...#. .##..",
    "A": ".###. #...# #...# ##### #...# #...# #...#",
    "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.",
    "D": "###.. #..#. #...# #...# #...# #..#. ###..",
    "E": "##### #.... #.... ####. #.... #.... #####",
    "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####",
    "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#",
    "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#",
    "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.",
    "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#",
    "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.",
    "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.",
    "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.",
    "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..",
    "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    ".": "..... ..... ..... ..... ..... .##.. .##..",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...",
    "-": "..... ..... ..... ##### ..... ..... .....",
    "=": "..... ..... ##### ..... ##### ..... .....",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    "|": "..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    "/": "..... ....# ...#. ..#.. .#... #.... .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    "%": "##... ##..# ...#. ..#.. .#... #..## ...##",
    "Δ": "..#.. ..#.. .#.#. .#.#. #...# #...# #####",
    " ": "..... ..... ..... ..... ..... ..... .....",
}


class Canvas:
    """An RGB pixel buffer with lines, rectangles and 5x7 text."""

    def __init__(self, width: int, height: int, background=(255, 255, 255)):
        self.width, self.height = width, height
        self.px = bytearray(bytes(background) * (width * height))

    def dot(self, x: int, y: int, color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.px[i:i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        """Filled, corners inclusive."""
        for y in range(max(0, min(y0, y1)), min(self.height, max(y0, y1) + 1)):
            for x in range(max(0, min(x0, x1)), min(self.width, max(x0, x1) + 1)):
                self.dot(x, y, color)

    def line(self, x0: float, y0: float, x1: float, y1: float, color, width: int = 1) -> None:
        """A straight line, ``width`` pixels thick (square pen)."""
        x0, y0, x1, y1 = round(x0), round(y0), round(x1), round(y1)
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, lo, hi = dx + dy, -((width - 1) // 2), width // 2
        while True:
            if width == 1:
                self.dot(x0, y0, color)
            else:
                self.rect(x0 + lo, y0 + lo, x0 + hi, y0 + hi, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, s: str, color, scale: int = 2) -> None:
        """``s`` with its top-left at (x, y); letters are drawn as capitals."""
        for ch in s.upper():
            glyph = _GLYPHS.get(ch, _GLYPHS[" "]).replace(" ", "")
            for i, bit in enumerate(glyph):
                if bit == "#":
                    r, c = divmod(i, 5)
                    self.rect(x + c * scale, y + r * scale,
                              x + c * scale + scale - 1, y + r * scale + scale - 1, color)
            x += 6 * scale

    @staticmethod
    def text_width(s: str, scale: int = 2) -> int:
        return 6 * scale * len(s) - scale

    def text_up(self, x: int, y: int, s: str, color, scale: int = 2) -> None:
        """``s`` rotated a quarter turn counter-clockwise, its bottom-left at (x, y)."""
        tmp = Canvas(self.text_width(s, scale), 7 * scale, (0, 0, 0))
        tmp.text(0, 0, s, (255, 255, 255), scale)
        for ty in range(tmp.height):
            for tx in range(tmp.width):
                if tmp.px[3 * (ty * tmp.width + tx)]:
                    self.dot(x + ty, y - tx, color)

    def save(self, path: str) -> None:
        write_png(path, self.width, self.height, self.px)


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values (1, 2, 5 x 10^k apart) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0, 1.0]
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    raw = (hi - lo) / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks, t = [], first
    while t <= hi + step * 0.5:
        ticks.append(round(t, 10))
        t += step
    return ticks


def _fmt(v: float, step: float) -> str:
    digits = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{v:.{digits}f}"


def plot_curves(path: str, series, *, title: str = "", xlabel: str = "", ylabel: str = "",
                size: tuple[int, int] = PLOT_SIZE) -> None:
    """A line chart of ``series``: ``(label, ys, rgb, pen width)``, x = 1..len(ys)."""
    width, height = size
    cv = Canvas(width, height)
    ink, grid, muted = (30, 30, 30), (225, 225, 225), (90, 90, 90)
    left, right, top, bottom = 78, 20, 44, 56
    x0, x1, y0, y1 = left, width - right, top, height - bottom  # plot box; y0 on top
    n = max(len(ys) for _, ys, _, _ in series)
    values = [v for _, ys, _, _ in series for v in ys if math.isfinite(v)] or [0.0, 1.0]
    yt = nice_ticks(min(values), max(values))
    ylo, yhi = yt[0], yt[-1]
    xt = [t for t in nice_ticks(0, n, 8) if t >= 0] or [0, 1]
    xlo, xhi = 0.0, max(float(xt[-1]), 1.0)

    def px(step: float) -> float:
        return x0 + (step - xlo) / (xhi - xlo) * (x1 - x0)

    def py(v: float) -> float:
        return y1 - (v - ylo) / ((yhi - ylo) or 1.0) * (y1 - y0)

    for t in yt:
        y = round(py(t))
        cv.line(x0, y, x1, y, grid)
        cv.line(x0 - 6, y, x0, y, ink)
        label = _fmt(t, yt[1] - yt[0] if len(yt) > 1 else 1.0)
        cv.text(x0 - 10 - cv.text_width(label), y - 7, label, ink)
    for t in xt:
        x = round(px(t))
        cv.line(x, y0, x, y1, grid)
        cv.line(x, y1, x, y1 + 6, ink)
        label = _fmt(t, 1.0)
        cv.text(x - cv.text_width(label) // 2, y1 + 12, label, ink)
    cv.line(x0, y0, x0, y1, ink)
    cv.line(x0, y1, x1, y1, ink)
    for label, ys, color, pen in series:
        pts = [(px(i + 1), py(v)) for i, v in enumerate(ys) if math.isfinite(v)]
        for (ax, ay), (bx, by) in zip(pts, pts[1:]):
            cv.line(ax, ay, bx, by, color, pen)
        if len(pts) == 1:
            cv.rect(round(pts[0][0]) - 2, round(pts[0][1]) - 2,
                    round(pts[0][0]) + 2, round(pts[0][1]) + 2, color)
    # legend, top right inside the box
    lw = max(cv.text_width(label) for label, *_ in series) + 56
    lx, ly = x1 - lw - 10, y0 + 10
    cv.rect(lx, ly, lx + lw, ly + 10 + 24 * len(series), (255, 255, 255))
    for i, (label, _, color, pen) in enumerate(series):
        yy = ly + 12 + 24 * i
        cv.line(lx + 8, yy + 6, lx + 40, yy + 6, color, max(pen, 2))
        cv.text(lx + 48, yy, label, ink)
    cv.text(max(4, (width - cv.text_width(title)) // 2), 14, title, ink)
    cv.text((x0 + x1 - cv.text_width(xlabel)) // 2, height - 22, xlabel, muted)
    cv.text_up(12, (y0 + y1 + cv.text_width(ylabel)) // 2, ylabel, muted)
    cv.save(path)


# -- command line ---------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    ap.add_argument("--tp", type=int, default=d.tp, help=f"tensor-parallel size (default {d.tp})")
    ap.add_argument("--dp", type=int, default=d.dp,
                    help=f"data-parallel replicas: tp*dp gloo processes (default {d.dp})")
    ap.add_argument("--steps", type=int, default=d.steps, help=f"training steps (default {d.steps})")
    ap.add_argument("--size", choices=list(SIZES), default=d.size,
                    help=f"model size (default {d.size})")
    ap.add_argument("--batch", type=int, default=d.batch,
                    help=f"sequences of {SIZES[d.size]['block_size']} bytes per step, "
                         f"split over dp (default {d.batch})")
    ap.add_argument("--out", default=d.out, metavar="DIR",
                    help=f"output folder for loss.png, plan.json, summary.* (default ./{d.out}/)")
    ap.add_argument("--seed", type=int, default=d.seed, help=f"model and data seed (default {d.seed})")


def config_from_args(args) -> DemoConfig:
    return DemoConfig(tp=args.tp, dp=args.dp, steps=args.steps, size=args.size,
                      out=args.out, seed=args.seed, batch=args.batch)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardplan.demo", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(config_from_args(ap.parse_args(argv)))


if __name__ == "__main__":
    from shardplan.demo import main as _main  # workers unpickle shardplan.demo, not __main__
    sys.exit(_main())
