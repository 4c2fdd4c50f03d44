"""``shardplan demo``: the main job in one command, on a laptop's CPU.

    shardplan demo                       # tp=2: two gloo processes, about a minute
    shardplan demo --tp 2 --dp 2 --size tiny --steps 60 --out /tmp/demo
    shardplan demo --tp 1 --pp 2         # two pipeline stages (1F1B, 2 microbatches)

1. plans the bundled GPT (byte tokens, sized for text) and prints the memory
   and communication summary of the layout report;
2. starts ``tp * dp`` gloo worker processes (``RealRanks``), each running a
   ``shardplan.train.trainer.Trainer`` (the training entry point: the tp x dp mesh,
   AdamW with weight decay 0.01, warm-up then cosine, global-norm clipping at
   1.0 that counts replicated gradients once, gradients averaged over the dp
   replicas, or FSDP2 over them with ``--fsdp``) on the public-domain corpus
   bundled in ``shardplan.data``, one
   step at a time behind a progress line; with ``--pp N`` the ranks are a
   pp x tp mesh, the model cut into N stages run by a pipeline schedule
   (``--schedule``, ``--microbatches``; not yet with ``--dp`` or the options
   the trainer refuses with pp);
3. trains the unsharded model on the same batches in this process with the
   ranks' own step (``trainer.training_step``: the same optimizer, schedule
   and clipping) and compares the two loss curves step by step;
4. writes ``loss.png`` (both curves and the verdict, with matplotlib:
   ``shardplan.train.plot``), ``plan.json``, ``summary.md`` and
   ``summary.json`` into the output folder, with lines sampled from the trained
   sharded model (not with ``--pp``: generation does not run through a pipeline
   yet).

Exit status 0 when the curves agree within fp32 tolerance, 1 when not, 2 for
bad options.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

#: model sizes: the bundled GPT with byte tokens (vocabulary 256)
SIZES = {
    "tiny": dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64),
    "small": dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128),
}
CORPUS = "corpus.txt"  # in the shardplan.data package
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
    sequence_parallel: bool = False
    fsdp: bool = False  # FSDP2 over the dp ranks instead of replicas
    compile: str | None = None  # a torch.compile backend for the sharded graph
    pp: int = 1  # pipeline stages
    schedule: str | None = None  # the pipeline's schedule (with pp > 1; default 1f1b)
    microbatches: int | None = None  # with pp > 1 (default: pp)

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def label(self) -> str:
        """``tp=2 dp=1``, with ``pp=2 `` first for a pipeline."""
        return f"{f'pp={self.pp} ' if self.pp > 1 else ''}tp={self.tp} dp={self.dp}"

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
                       log_every=0, device="cpu", sequence_parallel=cfg.sequence_parallel,
                       fsdp=cfg.fsdp, compile=cfg.compile, pp=cfg.pp,
                       schedule=cfg.schedule, microbatches=cfg.microbatches)


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
    return sum(p.numel() for p in _RANK["trainer"].trained.parameters())


def _rank_steps(ctx, n: int) -> list[tuple[float, float]]:
    trainer = _RANK["trainer"]
    return [(r["loss"], r["grad_norm"]) for r in (trainer.train_step() for _ in range(n))]


SAMPLE_PROMPTS = ("The ", "And ")  # equal lengths: the bundled GPT takes no padding mask
SAMPLE_SEED = 0


def _rank_sample(ctx, new_tokens: int) -> list[str]:
    """A few lines sampled from the trained sharded model (same on every rank)."""
    sharded = _RANK["trainer"].sharded.eval()
    ids = torch.tensor([list(p.encode()) for p in SAMPLE_PROMPTS])
    out = sharded.generate(ids, max_new_tokens=new_tokens, do_sample=True, top_k=10,
                           generator=torch.Generator().manual_seed(SAMPLE_SEED))
    return [bytes(row.tolist()).decode("utf-8", errors="replace") for row in out]


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
    bar = Progress(cfg.steps, cfg.label)
    curve, t_train = [], 0.0
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        curve += ranks.run(_rank_steps, 1)[0]
        t_train += time.perf_counter() - t0
        bar.update(step + 1, curve[-1][0], (step + 1) * cfg.batch * cfg.block / t_train)
    bar.close()
    times["train_sharded"] = t_train
    samples = []
    if cfg.pp == 1:  # generation does not run through a pipeline yet
        t0 = time.perf_counter()
        samples = ranks.run(_rank_sample, min(48, cfg.block - 4))[0]
        times["sample"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ranks.run(_rank_close)
    times["check_replicas"] = time.perf_counter() - t0
    return curve, samples


def _train_unsharded(cfg: DemoConfig, tc, model, times: dict) -> list[tuple[float, float]]:
    """The plain model in this process, each step by ``training_step`` as on every rank,
    on the global batch; on one thread like each rank (intra-op threads on a busy
    machine can be many times slower than one)."""
    from .optim import TPGradScaler, build_optimizer
    from .trainer import TokenData, training_step
    data = TokenData(tc.data, seq_len=tc.seq_len, batch_size=cfg.batch, dp=1, seed=tc.seed)
    opt = build_optimizer(model, tc.lr, weight_decay=tc.weight_decay)
    scaler = TPGradScaler("cpu", enabled=False)  # the demo trains in fp32
    bar = Progress(cfg.steps, "unsharded")
    curve, t_train = [], 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model.train()
    try:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            done = training_step(model, opt, scaler, data.batch(step, 0), config=tc,
                                 lr=tc.lr_at(step))
            curve.append((done.loss.item(), done.norm.item()))
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
    if cfg.tp < 1 or cfg.dp < 1 or cfg.pp < 1 or cfg.steps < 1 or cfg.batch < 1:
        raise ConfigurationError(f"--tp, --dp, --pp, --steps and --batch must be positive, "
                                 f"got tp={cfg.tp} dp={cfg.dp} pp={cfg.pp} steps={cfg.steps} "
                                 f"batch={cfg.batch}")
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
    from . import plot
    from .trainer import TokenData, build_model
    check(cfg)
    plot.pyplot()  # without matplotlib, fail now rather than after training
    t_start = time.perf_counter()
    os.makedirs(cfg.out, exist_ok=True)
    tc = train_config(cfg, data)  # the trainer's checks: what pp does not run yet
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tc.seed)  # as every rank's Trainer does: the same initial weights
        model = build_model(tc)
    n_params = sum(p.numel() for p in model.parameters())
    corpus = TokenData(data, seq_len=tc.seq_len, batch_size=tc.batch_size, dp=cfg.dp,
                       seed=tc.seed)
    pipeline = dict(pp=tc.pp, schedule=tc.schedule, microbatches=tc.microbatches) \
        if tc.pp > 1 else {}
    plan = shardplan.plan(model, cfg.tp, example_inputs=corpus.batch(0, 0), **pipeline)
    times = {"plan": time.perf_counter() - t_start}
    m = SIZES[cfg.size]
    print(f"shardplan demo: GPT {cfg.size} ({n_params / 1e6:.2f} M parameters, {m['n_layer']} "
          f"layers, n_embd {m['n_embd']}, byte tokens), {len(corpus.tokens) / 1024:.0f} KiB of "
          f"public-domain text, {cfg.steps} steps of {cfg.batch} x {cfg.block} tokens\n")
    print(_plan_summary(plan))
    world = cfg.world
    stages = f"pp={cfg.pp} ({tc.schedule}, {tc.microbatches} microbatches) x " \
        if cfg.pp > 1 else ""
    print(f"\nstarting {world} gloo processes ({stages}tp={cfg.tp} x dp={cfg.dp}"
          f"{', FSDP2 over dp' if cfg.fsdp else ''}) ...", flush=True)
    t0 = time.perf_counter()
    with RealRanks(world) as ranks:
        ranks.start()
        times["start_ranks"] = time.perf_counter() - t0
        sharded, samples = _train_sharded(cfg, tc, ranks, times)
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
    plot.save_png(plot.loss_figure(
        [plot.Curve("unsharded", b, "tab:orange", 5.0),
         plot.Curve(f"{cfg.label}{' FSDP2' if cfg.fsdp else ''} ({world} gloo "
                    "processes)", a, "tab:blue", 1.5)],
        title=f"shardplan demo: GPT {cfg.size}, training loss",
        verdict=f"max |Δloss| {max(diffs):.1e}: {'match' if ok else 'DISAGREE'}"),
        files["loss.png"])
    with open(files["plan.json"], "w") as f:
        f.write(plan.to_json())
    times["total"] = time.perf_counter() - t_start
    summary = {
        "config": asdict(cfg), "mesh": cfg.label, "processes": world,
        "model": dict(m, parameters=n_params),
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
        "plot": {"file": "loss.png", "width": plot.SIZE[0], "height": plot.SIZE[1]},
        "samples": samples,
    }
    with open(files["summary.json"], "w") as f:
        json.dump(summary, f, indent=2)
    with open(files["summary.md"], "w") as f:
        f.write(_markdown(summary))
    verdict = ("the curves match" if ok else
               f"the curves DISAGREE at {len(bad)} steps (first: step {bad[0]})")
    print(f"\nfinal loss: {cfg.label} {a[-1]:.4f}, unsharded {b[-1]:.4f}; "
          f"max |Δloss| over {cfg.steps} steps = {max(diffs):.2e} "
          f"(tolerance {_tolerance_text()}): {verdict}")
    print("seconds: " + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in times.items()))
    if samples:
        print(f"samples from the trained tp={cfg.tp} model (top-k 10, seed {SAMPLE_SEED}):")
    else:
        print("no samples: generation does not run through a pipeline yet")
    for line in samples:
        print(f"  {line!r}")
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
    samples = ("Sampled from the trained sharded model (top-k 10, seed "
               f"{SAMPLE_SEED}):\n\n" + "\n".join(f"    {line!r}" for line in s["samples"])
               if s["samples"] else
               "No samples: generation does not run through a pipeline yet.")
    return f"""# shardplan demo

GPT {c['size']}: {m['parameters']:,} parameters, {m['n_layer']} layers, n_embd {m['n_embd']},
{m['n_head']} heads, byte tokens (vocabulary {m['vocab_size']}), context {m['block_size']}.
Trained {c['steps']} steps of {s['tokens_per_step']} tokens on {s['corpus_bytes']:,} bytes of
public-domain text (`shardplan/data/corpus.txt`): AdamW, lr {c['lr']:g} with warm-up and cosine
decay, weight decay {c['weight_decay']:g}, gradient clipping at {c['clip']:g}, seed {c['seed']}.

- **Loss curves: {verdict}.** Max |Δloss| {s['max_abs_diff']:.2e}; tolerance per step
  {_tolerance_text()}.
- Sharded: {s['mesh'].replace(' ', ' x ')}, {s['processes']} gloo processes,
  {s['tokens_per_s']['sharded']:,.0f} tokens/s.
- Unsharded: this process, one thread, {s['tokens_per_s']['unsharded']:,.0f} tokens/s.
- Plan: parameters per rank {human(p['param_bytes_per_rank'])} of
  {human(p['param_bytes_unsharded'])} unsharded; per step and tp group
  {p['collectives_per_step']} collectives moving {human(p['comm_bytes_per_step'])}.
- Seconds: {sec}.

| step | {s['mesh']} | unsharded | abs diff |
|---:|---:|---:|---:|
{table}

{samples}

Files: `loss.png` (both curves), `plan.json` (load with `shardplan.Plan.from_json`),
`summary.json` (every loss and gradient norm).
"""


# -- command line ---------------------------------------------------------

DESCRIPTION = ("train the bundled GPT on text at tp=2 on gloo, check it matches unsharded, "
               "write a loss plot and summary")


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
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="hold the activations between the parallel regions on 1/tp of the "
                         "sequence")
    ap.add_argument("--fsdp", action="store_true",
                    help="shard parameters, gradients and optimizer state over the dp ranks "
                         "with FSDP2 (e.g. --tp 2 --dp 2 --fsdp)")
    ap.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                    help="torch.compile the sharded graph with BACKEND (bare: inductor)")
    ap.add_argument("--pp", type=int, default=d.pp,
                    help=f"pipeline stages: pp*tp gloo processes, each stage tensor-parallel "
                         f"over its tp ranks (not with --dp yet; default {d.pp})")
    ap.add_argument("--schedule", default=None,
                    help="the pipeline's schedule, with --pp: gpipe, 1f1b or interleaved "
                         "(default 1f1b)")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="microbatches a step's batch is cut into, with --pp (default: pp)")


def config_from_args(args) -> DemoConfig:
    return DemoConfig(tp=args.tp, dp=args.dp, steps=args.steps, size=args.size,
                      out=args.out, seed=args.seed, batch=args.batch,
                      sequence_parallel=args.sequence_parallel, fsdp=args.fsdp,
                      compile=args.compile, pp=args.pp, schedule=args.schedule,
                      microbatches=args.microbatches)


def main(argv: list[str] | None = None) -> int:
    """``python -m shardplan.train.demo ...`` = ``shardplan demo ...`` (same options and errors)."""
    from ..errors import ShardplanError
    ap = argparse.ArgumentParser(prog="python -m shardplan.train.demo", description=DESCRIPTION)
    add_arguments(ap)
    try:
        return run(config_from_args(ap.parse_args(argv)))
    except ShardplanError as e:
        print(f"shardplan: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from shardplan.train.demo import main as _main  # workers unpickle shardplan.train.demo, not __main__
    sys.exit(_main())
