"""``shardplan demo``: the main job in one command, on a laptop's CPU.

    shardplan demo                       # tp=2: two gloo processes, about a minute
    shardplan demo --tp 2 --dp 2 --size tiny --steps 60 --out /tmp/demo

1. plans the bundled GPT (byte tokens, sized for text) and prints the memory
   and communication summary of the layout report;
2. starts ``tp * dp`` gloo worker processes (``RealRanks``), each running a
   ``shardplan.train.trainer.Trainer`` (the training entry point: the tp x dp mesh,
   AdamW with weight decay 0.01, warm-up then cosine, global-norm clipping at
   1.0 that counts replicated gradients once, gradients averaged over the dp
   replicas) on the public-domain corpus bundled in ``shardplan.data``, one
   step at a time behind a progress line;
3. trains the unsharded model on the same batches in this process (the same
   optimizer, schedule and clipping from ``shardplan.train.optim``) and compares
   the two loss curves step by step;
4. writes ``loss.png``, ``plan.json``, ``summary.md`` and ``summary.json``
   into the output folder.

Exit status 0 when the curves agree within fp32 tolerance, 1 when not, 2 for
bad options. Nothing here needs matplotlib or tqdm: the progress line and the
PNG (``write_png``, ``plot_curves``) are written by hand.
"""

from __future__ import annotations

import argparse
import contextlib
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
#: Two fp32 runs of the same math, summed in different orders, agree to rounding
#: (~1e-6) at first; training can amplify that later (Adam, a loss spike), so
#: a step's |sharded - unsharded| must be within ATOL + RTOL * |unsharded| with
#: the tight pair for the first EARLY_STEPS steps and the loose one after.
#: Measured with the defaults: <= 6e-5 over 150 steps (seeds 0-2); a clipping
#: norm that counts replicated gradients on every rank fails at step 3 or 4.
EARLY_STEPS = 10
TOLERANCE = {"early": (1e-4, 1e-4), "later": (5e-3, 1e-3)}  # (atol, rtol)


def within_tolerance(step: int, sharded: float, unsharded: float) -> bool:
    """Does step ``step`` (from 1) of the two curves agree? (NaN never does.)"""
    atol, rtol = TOLERANCE["early" if step <= EARLY_STEPS else "later"]
    return abs(sharded - unsharded) <= atol + rtol * abs(unsharded)


@dataclass
class DemoConfig:
    tp: int = 2
    dp: int = 1
    steps: int = 150
    size: str = "small"
    out: str = "shardplan-demo"
    seed: int = 0
    batch: int = 16  # sequences per step, all replicas together
    lr: float = 2e-3
    weight_decay: float = 0.01
    clip: float = 1.0

    @property
    def block(self) -> int:
        return SIZES[self.size]["block_size"]

    @property
    def warmup(self) -> int:  # a fifth of the run: no loss spike at the peak to amplify
        return max(1, self.steps // 5)


def gpt_tiny():
    """The demo's tiny GPT (for ``TrainConfig.model``: ``shardplan.train.demo:gpt_tiny``)."""
    from ..models import build
    return build("gpt-tiny", **SIZES["tiny"])


def gpt_small():
    """The demo's small GPT (``shardplan.train.demo:gpt_small``)."""
    from ..models import build
    return build("gpt-tiny", **SIZES["small"])


def train_config(cfg: DemoConfig, data: str):
    """The ``shardplan.train.trainer.TrainConfig`` of every rank."""
    from .trainer import TrainConfig
    return TrainConfig(model=f"{__name__}:gpt_{cfg.size}", tp=cfg.tp, dp=cfg.dp,
                       steps=cfg.steps, batch_size=cfg.batch // cfg.dp, seq_len=cfg.block,
                       lr=cfg.lr, warmup=cfg.warmup, clip=cfg.clip,
                       weight_decay=cfg.weight_decay, seed=cfg.seed, data=data,
                       log_every=0, device="cpu")


@contextlib.contextmanager
def corpus_path():
    """A file path of the bundled corpus (extracted if the package is zipped)."""
    from importlib import resources
    with resources.as_file(resources.files("shardplan.data").joinpath(CORPUS)) as path:
        yield str(path)


# -- on each rank (top-level: RealRanks pickles them by name) -------------

_RANK: dict = {}  # this worker's Trainer, between runs


def _rank_setup(ctx, tc) -> int:
    from .trainer import Trainer
    _RANK.clear()
    _RANK["trainer"] = Trainer(tc)
    return sum(p.numel() for p in _RANK["trainer"].sharded.parameters())


def _rank_steps(ctx, n: int) -> list[tuple[float, float]]:
    trainer = _RANK["trainer"]
    return [(r["loss"], r["grad_norm"]) for r in (trainer.train_step() for _ in range(n))]


def _rank_close(ctx) -> None:
    """Replicated parameters still equal on every rank (raises on every rank if not)."""
    try:
        _RANK["trainer"].check_replicas()
    finally:
        _RANK.clear()


# -- progress line ----------------------------------------------------------

class Progress:
    """One line redrawn with ``\r`` on a terminal; a line every ~10% otherwise."""

    def __init__(self, total: int, label: str, stream=None, width: int = 24):
        self.total, self.label, self.width = total, label, width
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = max(1, total // 10)

    def update(self, done: int, loss: float, tok_s: float) -> None:
        text = (f"{done:>{len(str(self.total))}}/{self.total} "
                f"loss {loss:7.4f}  {tok_s:8,.0f} tok/s")
        if self.tty:
            fill = self.width * done // self.total
            bar = "#" * fill + "." * (self.width - fill)
            self.stream.write(f"\r{self.label} [{bar}] {text}\x1b[K")
            self.stream.flush()
        elif done == 1 or done % self.every == 0 or done == self.total:
            self.stream.write(f"{self.label} {text}\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# -- the two runs -----------------------------------------------------------

def _train_sharded(cfg: DemoConfig, tc, ranks, times: dict) -> list[tuple[float, float]]:
    t0 = time.perf_counter()
    ranks.run(_rank_setup, tc)
    times["parallelize"] = time.perf_counter() - t0
    bar = Progress(cfg.steps, f"tp={cfg.tp} dp={cfg.dp}")
    curve, t_train = [], 0.0
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        curve += ranks.run(_rank_steps, 1)[0]
        t_train += time.perf_counter() - t0
        bar.update(step + 1, curve[-1][0], (step + 1) * cfg.batch * cfg.block / t_train)
    bar.close()
    times["train_sharded"] = t_train
    t0 = time.perf_counter()
    ranks.run(_rank_close)
    times["check_replicas"] = time.perf_counter() - t0
    return curve


def _train_unsharded(cfg: DemoConfig, tc, model, times: dict) -> list[tuple[float, float]]:
    """The plain model in this process, on one thread like each rank (intra-op threads
    on a busy machine can be many times slower than one): what ``Trainer.train_step``
    does, without parallelism."""
    from .optim import build_optimizer, clip_grad_norm_, lr_schedule
    from .trainer import TokenData
    data = TokenData(tc.data, seq_len=tc.seq_len, batch_size=cfg.batch, dp=1, seed=tc.seed)
    opt = build_optimizer(model, tc.lr, weight_decay=tc.weight_decay)
    bar = Progress(cfg.steps, "unsharded")
    curve, t_train = [], 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model.train()
    try:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_schedule(step, lr=tc.lr, warmup=tc.warmup, total=tc.steps,
                                          min_lr=tc.floor_lr)
            x, y = data.global_batch(step)  # every replica's rows, in order
            opt.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            norm = clip_grad_norm_(model, tc.clip)
            opt.step()
            curve.append((loss.item(), norm.item()))
            t_train += time.perf_counter() - t0
            bar.update(step + 1, curve[-1][0], (step + 1) * cfg.batch * cfg.block / t_train)
    finally:
        torch.set_num_threads(threads)
    bar.close()
    times["train_unsharded"] = t_train
    return curve


# -- the demo -------------------------------------------------------------

def _plan_summary(plan) -> str:
    """The report's header, memory and communication; the per-parameter table counted."""
    head = plan.report().split("\nparameters (layout:")[0].rstrip()
    split = sum(p.layout != "R" for p in plan.params)
    text = (f"{head}\nparameter tensors: {split} split, {len(plan.params) - split} replicated "
            "(every layout in plan.json)")
    if plan.count(purpose="gather_output"):
        text += ("\n(training asks for the loss only, gather_output=False: the gather_output "
                 "all-gather does not run)")
    return text


def check(cfg: DemoConfig) -> None:
    from ..errors import ConfigurationError
    if cfg.size not in SIZES:
        raise ConfigurationError(f"unknown size {cfg.size!r}", fix=f"use one of {', '.join(SIZES)}")
    if cfg.tp < 1 or cfg.dp < 1 or cfg.steps < 1 or cfg.batch < 1:
        raise ConfigurationError(f"--tp, --dp, --steps and --batch must be positive, got "
                                 f"tp={cfg.tp} dp={cfg.dp} steps={cfg.steps} batch={cfg.batch}")
    if cfg.batch % cfg.dp:
        raise ConfigurationError(f"the batch of {cfg.batch} sequences does not split over "
                                 f"dp={cfg.dp}", fix="pick --dp dividing --batch")
    heads = SIZES[cfg.size]["n_head"]
    if heads % cfg.tp:
        raise ConfigurationError(f"tp={cfg.tp} does not divide the {heads} attention heads "
                                 f"of size {cfg.size!r}", fix="use --tp 1, 2 or 4")


def run(cfg: DemoConfig) -> int:
    """The whole demo; returns the exit status (0: the curves agree)."""
    with corpus_path() as data:
        return _run(cfg, data)


def _run(cfg: DemoConfig, data: str) -> int:
    import shardplan
    from ..ranks import RealRanks
    from .trainer import TokenData, build_model
    check(cfg)
    t_start = time.perf_counter()
    os.makedirs(cfg.out, exist_ok=True)
    tc = train_config(cfg, data)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tc.seed)  # as every rank's Trainer does: the same initial weights
        model = build_model(tc)
    n_params = sum(p.numel() for p in model.parameters())
    corpus = TokenData(data, seq_len=tc.seq_len, batch_size=tc.batch_size, dp=cfg.dp,
                       seed=tc.seed)
    plan = shardplan.plan(model, cfg.tp, example_inputs=corpus.batch(0, 0))
    times = {"plan": time.perf_counter() - t_start}
    m = SIZES[cfg.size]
    print(f"shardplan demo: GPT {cfg.size} ({n_params / 1e6:.2f} M parameters, {m['n_layer']} "
          f"layers, n_embd {m['n_embd']}, byte tokens), {len(corpus.tokens) / 1024:.0f} KiB of "
          f"public-domain text, {cfg.steps} steps of {cfg.batch} x {cfg.block} tokens\n")
    print(_plan_summary(plan))
    world = cfg.tp * cfg.dp
    print(f"\nstarting {world} gloo processes (tp={cfg.tp} x dp={cfg.dp}) ...", flush=True)
    t0 = time.perf_counter()
    with RealRanks(world) as ranks:
        ranks.start()
        times["start_ranks"] = time.perf_counter() - t0
        sharded = _train_sharded(cfg, tc, ranks, times)
    unsharded = _train_unsharded(cfg, tc, model, times)

    a = [loss for loss, _ in sharded]
    b = [loss for loss, _ in unsharded]
    diffs = [abs(u - v) for u, v in zip(a, b)]
    bad = [i + 1 for i, (u, v) in enumerate(zip(a, b))  # steps from 1, as plotted
           if not within_tolerance(i + 1, u, v)]
    ok = not bad
    tokens = cfg.batch * cfg.block
    files = {name: os.path.join(cfg.out, name)
             for name in ("loss.png", "plan.json", "summary.json", "summary.md")}
    width, height = PLOT_SIZE
    plot_curves(files["loss.png"], [("unsharded", b, (240, 150, 40), 5),
                                    (f"tp={cfg.tp} dp={cfg.dp} ({world} gloo processes)",
                                     a, (30, 70, 200), 1)],
                title=f"shardplan demo: GPT {cfg.size}, training loss",
                note=f"max |Δloss| {max(diffs):.1e}: {'match' if ok else 'DISAGREE'}",
                xlabel="step", ylabel="loss", size=PLOT_SIZE)
    with open(files["plan.json"], "w") as f:
        f.write(plan.to_json())
    times["total"] = time.perf_counter() - t_start
    summary = {
        "config": asdict(cfg), "model": dict(m, parameters=n_params),
        "corpus_bytes": len(corpus.tokens), "tokens_per_step": tokens,
        "losses": {"sharded": a, "unsharded": b},
        "grad_norms": {"sharded": [n for _, n in sharded], "unsharded": [n for _, n in unsharded]},
        "max_abs_diff": max(diffs),
        "tolerance": {"early_steps": EARLY_STEPS,
                      **{k: {"atol": at, "rtol": rt} for k, (at, rt) in TOLERANCE.items()}},
        "max_grad_norm_rel_diff": max(abs(u - v) / max(abs(v), 1e-12)
                                      for (_, u), (_, v) in zip(sharded, unsharded)),
        "steps_out_of_tolerance": bad, "match": ok,
        "tokens_per_s": {"sharded": cfg.steps * tokens / times["train_sharded"],
                         "unsharded": cfg.steps * tokens / times["train_unsharded"]},
        "seconds": times,
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
          f"(tolerance {_tolerance_text()}): {verdict}")
    print("seconds: " + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in times.items()))
    print(f"wrote {', '.join(files.values())}")
    return 0 if ok else 1


def _tolerance_text() -> str:
    (ea, er), (la, lr) = TOLERANCE["early"], TOLERANCE["later"]
    return (f"{ea:g} + {er:g}·|loss| for the first {EARLY_STEPS} steps, "
            f"{la:g} + {lr:g}·|loss| after")


def _markdown(s: dict) -> str:
    from ..report.text import human
    c, p, m = s["config"], s["plan"], s["model"]
    a, b = s["losses"]["sharded"], s["losses"]["unsharded"]
    rows = sorted({0, len(a) // 4, len(a) // 2, 3 * len(a) // 4, len(a) - 1})
    table = "\n".join(f"| {i + 1} | {a[i]:.6f} | {b[i]:.6f} | {abs(a[i] - b[i]):.2e} |"
                      for i in rows)
    verdict = "match" if s["match"] else f"DISAGREE (steps {s['steps_out_of_tolerance'][:10]})"
    sec = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in s["seconds"].items())
    return f"""# shardplan demo

GPT {c['size']}: {m['parameters']:,} parameters, {m['n_layer']} layers, n_embd {m['n_embd']},
{m['n_head']} heads, byte tokens (vocabulary {m['vocab_size']}), context {m['block_size']}.
Trained {c['steps']} steps of {s['tokens_per_step']} tokens on {s['corpus_bytes']:,} bytes of
public-domain text (`shardplan/data/corpus.txt`): AdamW, lr {c['lr']:g} with warm-up and cosine
decay, weight decay {c['weight_decay']:g}, gradient clipping at {c['clip']:g}, seed {c['seed']}.

- **Loss curves: {verdict}.** Max |Δloss| {s['max_abs_diff']:.2e}; tolerance per step
  {_tolerance_text()}.
- Sharded: tp={c['tp']} x dp={c['dp']}, {c['tp'] * c['dp']} gloo processes,
  {s['tokens_per_s']['sharded']:,.0f} tokens/s.
- Unsharded: this process, one thread, {s['tokens_per_s']['unsharded']:,.0f} tokens/s.
- Plan: parameters per rank {human(p['param_bytes_per_rank'])} of
  {human(p['param_bytes_unsharded'])} unsharded; per step and tp group
  {p['collectives_per_step']} collectives moving {human(p['comm_bytes_per_step'])}.
- Seconds: {sec}.

| step | tp={c['tp']} dp={c['dp']} | unsharded | abs diff |
|---:|---:|---:|---:|
{table}

Files: `loss.png` (both curves), `plan.json` (load with `shardplan.Plan.from_json`),
`summary.json` (every loss and gradient norm).
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
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(k * step, 10) for k in range(first, max(last, first + 1) + 1)]


def _fmt(v: float, step: float) -> str:
    digits = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{v:.{digits}f}"


def plot_curves(path: str, series, *, title: str = "", note: str = "", xlabel: str = "",
                ylabel: str = "", size: tuple[int, int] = PLOT_SIZE) -> None:
    """A line chart of ``series``: ``(label, ys, rgb, pen width)``, x = 1..len(ys).

    ``note`` goes under the legend."""
    width, height = size
    cv = Canvas(width, height)
    ink, grid, muted = (30, 30, 30), (225, 225, 225), (90, 90, 90)
    left, right, top, bottom = 78, 30, 44, 56
    x0, x1, y0, y1 = left, width - right, top, height - bottom  # plot box; y0 on top
    n = max(len(ys) for _, ys, _, _ in series)
    values = [v for _, ys, _, _ in series for v in ys if math.isfinite(v)] or [0.0, 1.0]
    yt = nice_ticks(min(values), max(values))
    ylo, yhi = yt[0], yt[-1]
    xlo, xhi = 0.0, float(max(n, 1))
    xt = [t for t in nice_ticks(0, xhi, 8) if 0 <= t <= xhi]

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
    lw = max(cv.text_width(s) for s in [label for label, *_ in series] + [note]) + 56
    lx, ly = x1 - lw - 10, y0 + 10
    rows = len(series) + bool(note)
    cv.rect(lx, ly, lx + lw, ly + 10 + 24 * rows, (200, 200, 200))
    cv.rect(lx + 1, ly + 1, lx + lw - 1, ly + 9 + 24 * rows, (255, 255, 255))
    for i, (label, _, color, pen) in enumerate(series):
        yy = ly + 12 + 24 * i
        cv.line(lx + 8, yy + 6, lx + 40, yy + 6, color, max(pen, 2))
        cv.text(lx + 48, yy, label, ink)
    if note:
        cv.text(lx + 48, ly + 12 + 24 * len(series), note, muted)
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
    ap.add_argument("--steps", type=int, default=d.steps,
                    help=f"training steps (default {d.steps})")
    ap.add_argument("--size", choices=list(SIZES), default=d.size,
                    help=f"model size (default {d.size})")
    ap.add_argument("--batch", type=int, default=d.batch,
                    help=f"sequences of {SIZES[d.size]['block_size']} bytes per step, "
                         f"split over dp (default {d.batch})")
    ap.add_argument("--out", default=d.out, metavar="DIR",
                    help=f"output folder for loss.png, plan.json, summary.* (default ./{d.out}/)")
    ap.add_argument("--seed", type=int, default=d.seed,
                    help=f"model and data seed (default {d.seed})")


def config_from_args(args) -> DemoConfig:
    return DemoConfig(tp=args.tp, dp=args.dp, steps=args.steps, size=args.size,
                      out=args.out, seed=args.seed, batch=args.batch)


def main(argv: list[str] | None = None) -> int:
    """``python -m shardplan.train.demo ...`` = ``shardplan demo ...`` (same options and errors)."""
    from ..cli import main as cli_main
    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    from shardplan.train.demo import main as _main  # workers unpickle shardplan.train.demo, not __main__
    sys.exit(_main())
