"""Training-step time at tp=2 on gloo: shardplan against DTensor, a hand-written
Megatron and the unsharded model, measured side by side in one run.

    python -m benchmarks.step_time                 # from the repo root; writes docs/benchmarks.md
    python -m benchmarks.step_time --quick         # n_embd 256, fewer steps, prints only
    python -m benchmarks.step_time --sizes 256 512 1024 --steps 20

One command starts two gloo worker processes (``shardplan.ranks.RealRanks(2)``,
one torch thread each). Every worker holds every tp contender of the same
bundled GPT (same weights, same batch, an AdamW each):

- ``shardplan``: ``shardplan.parallelize(model, gather_output=False)`` (training:
  the loss is all that is needed, the logits stay vocabulary-sharded);
- ``manual``: ``benchmarks.megatron_manual.ManualGPT``, Megatron by hand with
  plain tensors and in-place ``torch.distributed`` all-reduces (the floor);
- ``DTensor``: ``parallelize_module`` with the best hand-written plan
  (``benchmarks.dtensor_plan.hand_written``: ColwiseParallel / RowwiseParallel,
  PrepareModuleInput so q/k/v share one input, ``loss_parallel``; the attention
  reads this rank's head count);
- ``DTensor, model unchanged``: the same styles, q/k/v left as DTensors with
  global shapes through the unchanged attention code;
- ``DTensor, exported``: shardplan's plan exported with
  ``shardplan.export.parallelize_with_dtensor`` (the model unchanged, DTensor
  activations with global shapes, the loss on gathered logits).

A step is forward, backward, ``optimizer.step()`` and ``zero_grad()``. Each
timed round runs one step of every tp contender, in an order rotated every
round, each after a barrier; a contender's step time is the slower rank's.
After each round the parent process (the workers idle) runs one step of the
unsharded model with 1 and with 2 threads. Every contender's loss is checked
against the unsharded one at every step (the same training run).
"""

from __future__ import annotations

import copy
import os
import sys
import time
import warnings

# Before torch starts OpenMP: on a shared machine with more runnable threads than cores,
# spinning OpenMP workers made the 2-thread unsharded step 3-10x slower (waits are passive).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from ._common import command_line, measured_line, med, parser, spread, write_doc

HEADING = "## Training-step time, tp=2 on gloo"
COMMAND = "python -m benchmarks.step_time"
TP_CONTENDERS = ["shardplan", "manual", "DTensor", "DTensor, model unchanged", "DTensor, exported"]
UNSHARDED = ["unsharded, 1 thread", "unsharded, 2 threads"]
BATCH, SEQ, LAYERS, HEADS, VOCAB = 8, 128, 4, 8, 2048
LR = 1e-3

_STATE: dict = {}  # per worker process: the contenders of the current size


def gpt_config(n_embd: int) -> dict:
    return dict(n_embd=n_embd, n_head=HEADS, n_layer=LAYERS, vocab_size=VOCAB, block_size=SEQ,
                fused_qkv=False, dropout=0.0)


def _model_and_batch(n_embd: int):
    from shardplan.models import build
    torch.manual_seed(0)
    model = build("gpt-tiny", **gpt_config(n_embd))
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return model, idx, tgt


class _Contender:
    def __init__(self, module, context=None):
        import contextlib
        self.module = module
        self.context = context or contextlib.nullcontext
        self.opt = torch.optim.AdamW(module.parameters(), lr=LR)

    def step(self, idx, tgt):
        c0 = time.process_time()
        t0 = time.perf_counter()
        with self.context():
            _, loss = self.module(idx, tgt)
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        cpu = time.process_time() - c0
        loss = loss.detach()
        loss = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        return {"fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2, "step": t3 - t0, "cpu": cpu,
                "loss": loss}


def _setup(ctx, n_embd: int, names: list[str]) -> dict:
    """On each worker: build every tp contender from the same model."""
    import shardplan
    from torch.distributed.device_mesh import init_device_mesh

    from . import dtensor_plan
    from .megatron_manual import ManualGPT

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, idx, tgt = _model_and_batch(n_embd)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    made = {}
    for name in names:
        m = copy.deepcopy(model)
        if name == "shardplan":
            made[name] = _Contender(shardplan.parallelize(
                m, group=ctx.group, example_inputs=(idx, tgt), gather_output=False))
        elif name == "manual":
            made[name] = _Contender(ManualGPT(m))
        elif name == "DTensor":
            made[name] = _Contender(dtensor_plan.hand_written(m, mesh), dtensor_plan.loss_context)
        elif name == "DTensor, model unchanged":
            made[name] = _Contender(dtensor_plan.global_activations(m, mesh),
                                    dtensor_plan.global_context)
        elif name == "DTensor, exported":
            made[name] = _Contender(dtensor_plan.exported(m, mesh, (idx, tgt)),
                                    dtensor_plan.exported_context)
        else:
            raise ValueError(name)
    _STATE.clear()
    _STATE.update(contenders=made, idx=idx, tgt=tgt)
    return {name: sum(p.numel() for p in c.module.parameters()) for name, c in made.items()}


def _round(ctx, order: list[str]) -> dict:
    """On each worker: one step of every contender, each after a barrier."""
    import torch.distributed as dist
    out = {}
    for name in order:
        dist.barrier()
        out[name] = _STATE["contenders"][name].step(_STATE["idx"], _STATE["tgt"])
    return out


def measure(n_embd: int, steps: int, warmup: int, names: list[str], ranks) -> dict:
    """``{contender: [per-step dict]}`` for the timed steps (tp and unsharded)."""
    ranks.run(_setup, n_embd, names)
    model, idx, tgt = _model_and_batch(n_embd)
    plain = {UNSHARDED[0]: (_Contender(copy.deepcopy(model)), 1),
             UNSHARDED[1]: (_Contender(copy.deepcopy(model)), 2)}
    threads = torch.get_num_threads()
    runs: dict = {name: [] for name in [*names, *plain]}
    try:
        for i in range(warmup + steps):
            k = i % len(names)
            order = names[k:] + names[:k]
            per_rank = ranks.run(_round, order)
            done = {}
            for name in names:
                slow = max(per_rank, key=lambda r: r[name]["step"])[name]
                done[name] = dict(slow, cpu=sum(r[name]["cpu"] for r in per_rank))
            for name, (c, n) in plain.items():
                torch.set_num_threads(n)
                done[name] = c.step(idx, tgt)
            if i >= warmup:
                for name, r in done.items():
                    runs[name].append(r)
            what = f"warm-up {i + 1}" if i < warmup else f"step {i + 1 - warmup}"
            print(f"  n_embd {n_embd} {what}: "
                  + ", ".join(f"{n} {r['step'] * 1e3:.0f}" for n, r in done.items()) + " ms",
                  file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(threads)
    return runs


def _ratios(runs, a: str, b: str, key: str = "step") -> list[float]:
    return [x[key] / y[key] for x, y in zip(runs[a], runs[b])]


def _ms(x: float) -> str:
    return f"{x * 1e3:,.0f}"


def table(runs: dict) -> str:
    base = "manual" if "manual" in runs else None
    lines = ["| contender | step, ms | forward, ms | backward, ms | optimizer, ms "
             "| step / manual | CPU, ms | CPU / manual | loss difference vs unsharded |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ref = [r["loss"] for r in runs[UNSHARDED[0]]]
    for name, rs in runs.items():
        ratio = spread(_ratios(runs, name, base), lambda x: f"{x:.2f}") if base else "-"
        cpu_ratio = spread(_ratios(runs, name, base, "cpu"), lambda x: f"{x:.2f}") if base else "-"
        diff = max(abs(r["loss"] - x) / max(1.0, abs(x)) for r, x in zip(rs, ref))
        lines.append(f"| {name} | {spread([r['step'] for r in rs], _ms)} "
                     f"| {spread([r['fwd'] for r in rs], _ms)} "
                     f"| {spread([r['bwd'] for r in rs], _ms)} "
                     f"| {spread([r['opt'] for r in rs], _ms)} | {ratio} "
                     f"| {spread([r['cpu'] for r in rs], _ms)} | {cpu_ratio} | {diff:.1e} |")
    return "\n".join(lines)


def summary(results: dict) -> list[str]:
    f3 = lambda x: f"{x:.3f}"  # noqa: E731
    out = []
    for n_embd, runs in results.items():
        parts = []
        pairs = [("shardplan", "manual", 1.05), ("shardplan", "DTensor", 0.7),
                 ("manual", "DTensor", None), ("shardplan", "DTensor, model unchanged", None),
                 ("shardplan", "DTensor, exported", None)]
        for a, b, target in pairs:
            if a not in runs or b not in runs:
                continue
            r, c = _ratios(runs, a, b), _ratios(runs, a, b, "cpu")
            verdict = "" if target is None else (
                f" (target <= {target}: wall {'met' if med(r) <= target else 'NOT met'}, "
                f"CPU {'met' if med(c) <= target else 'NOT met'})")
            parts.append(f"{a} / {b}: wall {spread(r, f3)}, CPU {spread(c, f3)}{verdict}")
        r = _ratios(runs, "shardplan", UNSHARDED[1])
        parts.append(f"shardplan (2 processes x 1 thread) / unsharded with 2 threads: wall "
                     f"{spread(r, lambda x: f'{x:.2f}')}")
        out.append(f"- n_embd {n_embd}: " + "; ".join(parts) + ".")
    floor = {n: med(_ratios(runs, "manual", "DTensor", "cpu")) for n, runs in results.items()
             if "manual" in runs and "DTensor" in runs}
    if floor and any(v > 0.7 for v in floor.values()):
        out.append("- The hand-written Megatron floor itself runs at "
                   + ", ".join(f"{v:.2f}x DTensor's CPU time at n_embd {n}" for n, v in floor.items())
                   + ": with the same collectives, what separates DTensor from the floor is its "
                   "per-op dispatch (sharding propagation, redistribution checks; the optimizer step "
                   "on DTensor parameters among it), a fixed cost per op that shrinks against the "
                   "GEMMs as the model grows. A 0.7x target is out of reach for any implementation "
                   "that sends what Megatron sends, wherever that ratio is above 0.7.")
    return out


def main(argv=None) -> int:
    ap = parser(__doc__, "n_embd 256, 5 steps after 2 warm-up")
    ap.add_argument("--sizes", type=int, nargs="+", help="n_embd values (default 256 512)")
    ap.add_argument("--steps", type=int, help="timed steps per size (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--contenders", nargs="+", choices=TP_CONTENDERS, default=TP_CONTENDERS)
    args = ap.parse_args(argv)
    if args.quick:
        sizes, steps, warmup = args.sizes or [256], args.steps or 5, min(args.warmup, 2)
    else:
        sizes, steps, warmup = args.sizes or [256, 512], args.steps or 10, args.warmup
    names = list(args.contenders)
    if "shardplan" not in names:
        ap.error("shardplan must be one of the contenders")
    warnings.filterwarnings("ignore")
    from shardplan.ranks import RealRanks

    load_before = os.getloadavg()
    results = {}
    with RealRanks(2, timeout=600) as ranks:
        for n_embd in sizes:
            results[n_embd] = measure(n_embd, steps, warmup, names, ranks)
    load_after = os.getloadavg()
    body = []
    for n_embd, runs in results.items():
        n_params = sum(p.numel() for p in _model_and_batch(n_embd)[0].parameters())
        body += [f"n_embd {n_embd} (heads {HEADS}, {LAYERS} layers, vocab {VOCAB}, batch {BATCH}, "
                 f"sequence {SEQ}; {n_params / 1e6:.1f}M parameters):", "", table(runs), ""]
    text = "\n".join(body + summary(results))
    print(text)
    diverged = [f"n_embd {n} {name}" for n, runs in results.items() for name, rs in runs.items()
                if max(abs(r["loss"] - u["loss"]) / max(1.0, abs(u["loss"]))
                       for r, u in zip(rs, runs[UNSHARDED[0]])) > 1e-3]
    if diverged:
        print(f"PROBLEM: losses differ from the unsharded run: {', '.join(diverged)}",
              file=sys.stderr)
    if args.quick or args.no_write:
        return 1 if diverged else 0
    cmd = command_line(COMMAND, {"--sizes": (sizes, [256, 512]), "--steps": (steps, 10)})
    section = "\n".join([
        HEADING, "",
        "Reproduce from the repository root (writes this section; `--quick` for a short check "
        "that writes nothing):", "",
        "```sh", cmd, "```", "",
        measured_line(load_before, load_after), "",
        f"The bundled GPT (`shardplan.models.build(\"gpt-tiny\", ...)`, separate q/k/v so that "
        "every contender runs the same model, tied embedding/LM head, dropout 0), one fixed "
        f"batch, AdamW (lr {LR}). tp=2: two gloo processes started by one command "
        "(`shardplan.ranks.RealRanks(2)`), one torch thread each. Contenders:", "",
        "- `shardplan`: `shardplan.parallelize(model, gather_output=False)` (the logits stay "
        "vocabulary-sharded; the default `gather_output=True` adds one all-gather of the logits);",
        "- `manual`: Megatron by hand, `benchmarks/megatron_manual.py` (plain tensors, in-place "
        "`torch.distributed` all-reduces, the same collectives): the floor;",
        "- `DTensor`: `parallelize_module` with the best hand-written plan "
        "(`benchmarks/dtensor_plan.py`: ColwiseParallel/RowwiseParallel, PrepareModuleInput so "
        "q/k/v share one input, `loss_parallel`; the attention reads this rank's head count);",
        "- `DTensor, model unchanged`: the same styles with q/k/v left as DTensors of global "
        "shape through the unchanged attention code (SDPA's math kernel, implicit replication);",
        "- `DTensor, exported`: shardplan's plan through `shardplan.export.parallelize_with_dtensor` "
        "(model unchanged, DTensor activations through attention, loss on gathered logits);",
        "- `unsharded`: the plain model in the parent process, 1 and 2 threads.", "",
        f"{warmup} warm-up rounds, then {steps} timed rounds. A round is one step (forward, "
        "backward, `optimizer.step()`, `zero_grad()`) of every tp contender, in an order rotated "
        "each round, each after a barrier (a contender's time is the slower rank's), then one "
        "step of each unsharded model while the workers idle. Cells: median (min–max) over the "
        "timed steps; forward/backward/optimizer are the slower rank's phases. `step / manual` "
        "is the median (min–max) of the per-round ratios. The last column compares each "
        "contender's loss at every step with the unsharded 1-thread run (same training).", "",
        "`CPU` is the CPU time of the step (user + system, all threads; for tp contenders the sum "
        "over both ranks), with its own per-round ratio. On a shared machine whose load exceeds "
        "its cores, wall times mostly measure the scheduler (see the min–max); CPU time is the "
        "steadier measure of the work each contender does.", "",
        text, "",
        "Targets: shardplan <= 1.05x the hand-written Megatron and <= 0.7x DTensor.", ""])
    write_doc(HEADING, section)
    return 1 if diverged else 0


if __name__ == "__main__":
    sys.exit(main())
