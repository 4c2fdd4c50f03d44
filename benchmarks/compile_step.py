"""Training-step time at tp=2 on gloo under ``torch.compile``: shardplan compiled
against shardplan eager, DTensor compiled and a hand-written Megatron, measured
side by side in one run.

    python -m benchmarks.compile_step              # from the repo root; writes docs/benchmarks.md
    python -m benchmarks.compile_step --quick      # n_embd 512, 3 steps, prints only
    python -m benchmarks.compile_step --sizes 256 512 --steps 20

Two gloo worker processes (``shardplan.ranks.RealRanks(2)``, one torch thread
each) hold every contender of the same bundled GPT (``benchmarks.step_time``'s
model, batch and AdamW):

- ``shardplan, compiled``: ``shardplan.parallelize(model, gather_output=False,
  compile=True)``: the rewritten graph as one inductor graph (functional collectives,
  each started before the compute that does not need it: ``shardplan.runtime.overlap``;
  forward and input-gradient GEMMs on oneDNN: ``shardplan.runtime.onednn``);
- ``shardplan``: the same without ``compile``;
- ``DTensor, compiled``: the best hand-written plan (``benchmarks.dtensor_plan.hand_written``)
  with each transformer block under ``torch.compile`` (torchtitan's recipe; the
  embedding, head and ``loss_parallel`` stay eager);
- ``manual``: ``benchmarks.megatron_manual.ManualGPT``, eager (the eager floor).

The first step of every contender, timed alone after a barrier, holds the
compile; it is reported separately. Then each timed round runs one step of
every contender, in an order rotated every round, each after a barrier; a
contender's step time is the slower rank's. Losses are checked against each
other at every step.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as benchmarks.step_time

import torch  # noqa: E402

from ._common import command_line, med, parser, section_head, spread, write_doc  # noqa: E402
from .step_time import (BATCH, HEADS, LAYERS, SEQ, VOCAB, _STATE, _Contender,  # noqa: E402
                        _model_and_batch, _round)

HEADING = "## Training-step time under torch.compile, tp=2 on gloo"
COMMAND = "python -m benchmarks.compile_step"
CONTENDERS = ["shardplan, compiled", "shardplan", "DTensor, compiled", "manual"]


def _setup(ctx, n_embd: int) -> dict:
    """On each worker: build every contender from the same model, then time each one's
    first step (the compile) alone; ``{name: seconds}``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import shardplan
    from . import dtensor_plan
    from .megatron_manual import ManualGPT

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch._dynamo.reset()
    model, idx, tgt = _model_and_batch(n_embd)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    made = {}
    for name in CONTENDERS:
        m = copy.deepcopy(model)
        if name.startswith("shardplan"):
            made[name] = _Contender(shardplan.parallelize(
                m, group=ctx.group, example_inputs=(idx, tgt), gather_output=False,
                compile=name.endswith("compiled")))
        elif name == "DTensor, compiled":
            m = dtensor_plan.hand_written(m, mesh)
            for block in m.transformer.h:
                block.compile()
            made[name] = _Contender(m, dtensor_plan.loss_context)
        else:
            made[name] = _Contender(ManualGPT(m))
    _STATE.clear()
    _STATE.update(contenders=made, idx=idx, tgt=tgt)
    first = {}
    for name, c in made.items():
        dist.barrier()
        first[name] = c.step(idx, tgt)["step"]
    return first


def measure(n_embd: int, steps: int, warmup: int, ranks) -> tuple[dict, dict, str]:
    """(first-step seconds, the slower rank's; ``{contender: [per-step dict]}``; the
    profile of one more step of shardplan compiled and eager, by category)."""
    first = {n: max(r[n] for r in ranks.run(_setup, n_embd)) for n in CONTENDERS}
    print(f"  n_embd {n_embd} first step: "
          + ", ".join(f"{n} {s:.1f}" for n, s in first.items()) + " s", file=sys.stderr)
    runs: dict = {name: [] for name in CONTENDERS}
    for i in range(warmup + steps):
        k = i % len(CONTENDERS)
        per_rank = ranks.run(_round, CONTENDERS[k:] + CONTENDERS[:k])
        done = {n: dict(max(per_rank, key=lambda r: r[n]["step"])[n],
                        cpu=sum(r[n]["cpu"] for r in per_rank)) for n in CONTENDERS}
        if i >= warmup:
            for name, r in done.items():
                runs[name].append(r)
        print(f"  n_embd {n_embd} {'warm-up' if i < warmup else 'step'} {i + 1}: "
              + ", ".join(f"{n} {r['step'] * 1e3:.0f}" for n, r in done.items()) + " ms",
              file=sys.stderr, flush=True)
    prof = ranks.run(_profile, ["shardplan, compiled", "shardplan"])
    return first, runs, profile_table(prof) + "\n\n" + explain(prof[0])


#: profiler categories, first match wins: (name, substrings of the op names in it)
CATEGORIES = (
    # eager collectives block inside the mappings' autograd Functions: their self time
    ("collectives (gloo, waits)", ("c10d", "gloo", "wait_tensor", "record_param_comms",
                                   "all_reduce", "allreduce", "all_gather", "reduce_scatter",
                                   "FromRegion", "ToRegion", "Sequence", "_SumOverReplicas",
                                   "_GatherShard")),
    ("ledger op", ("shardplan::record_collective",)),
    ("GEMMs", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn",
               "onednn_mm")),
    ("attention kernels", ("flash_attention", "scaled_dot_product", "efficient_attention")),
    ("optimizer", ("optimizer.", "adamw", "_foreach")),
    ("compiled region's own time (inductor's fused kernels, wrapper, guards)",
     ("torch-compiled region", "compiledfunction", "compiledfxgraph", "dynamo")),
)


def _profile(ctx, names: list[str]) -> dict:
    """On each worker: one profiled step of each contender in ``names`` (after a
    barrier); ``{name: {category: self CPU ms}}`` plus ``"step"`` (wall ms) and
    ``"other"`` (self time in no category: the elementwise ops, Python glue)."""
    import time

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    out = {}
    for name in names:
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            _STATE["contenders"][name].step(_STATE["idx"], _STATE["tgt"])
            wall = time.perf_counter() - t0
        sums = dict.fromkeys([c for c, _ in CATEGORIES] + ["other"], 0.0)
        for e in prof.key_averages():
            key = e.key.lower()
            cat = next((c for c, subs in CATEGORIES if any(x.lower() in key for x in subs)),
                       "other")
            sums[cat] += e.self_cpu_time_total / 1e3
        out[name] = dict(sums, step=wall * 1e3)
    return out


def explain(prof: dict) -> str:
    """What rank 0's profile (``_profile``: compiled and eager shardplan) says about
    where compile gains: GEMMs (oneDNN for the forward and input gradients), the rest."""
    c, e = prof["shardplan, compiled"], prof["shardplan"]
    total = {k: sum(v for cat, v in p.items() if cat != "step") for k, p in (("c", c), ("e", e))}
    gemm, coll = CATEGORIES[2][0], CATEGORIES[0][0]
    region = CATEGORIES[-1][0]
    rest_c = c[region] + c["other"] + c["ledger op"]
    return (f"GEMMs take {c[gemm] / total['c']:.0%} of the compiled step's profiled time and "
            f"{e[gemm] / total['e']:.0%} of the eager one's ({c[gemm]:,.0f} ms against "
            f"{e[gemm]:,.0f} ms): compiled, the forward and input-gradient GEMMs run on "
            "oneDNN (`shardplan/runtime/onednn.py`), the weight gradients on MKL as in eager; "
            "the attention kernels are eager's. Besides: inductor's fused kernels, its wrapper "
            f"and the ledger op took {rest_c:,.0f} ms against eager's {e['other']:,.0f} ms of "
            f"elementwise ops and Python glue; collectives {c[coll]:,.0f} ms compiled (gloo "
            f"work and `wait_tensor`; each backward all-reduce is started before the weight-"
            f"gradient GEMMs, `shardplan/runtime/overlap.py`) against {e[coll]:,.0f} ms eager "
            "(blocking inside the mappings). On a loaded machine the wall times also include waiting for a core (compare "
            "the CPU column).")


def profile_table(per_rank: list[dict]) -> str:
    """Rank 0's profiled step of each profiled contender, by category."""
    prof = per_rank[0]
    names = list(prof)
    cats = [c for c in prof[names[0]] if c != "step"]
    lines = ["| self CPU time, ms (rank 0, one step) | " + " | ".join(names) + " |",
             "|---|" + "---:|" * len(names)]
    for cat in cats:
        lines.append(f"| {cat} | " + " | ".join(f"{prof[n][cat]:,.1f}" for n in names) + " |")
    lines.append("| sum | " + " | ".join(
        f"{sum(prof[n][c] for c in cats):,.1f}" for n in names) + " |")
    lines.append("| step wall time (profiled) | " + " | ".join(
        f"{prof[n]['step']:,.1f}" for n in names) + " |")
    return "\n".join(lines)


def _ms(x: float) -> str:
    return f"{x * 1e3:,.0f}"


def _ratios(runs, a: str, b: str, key: str) -> list[float]:
    return [x[key] / y[key] for x, y in zip(runs[a], runs[b])]


def table(first: dict, runs: dict) -> str:
    lines = ["| contender | step, ms | forward, ms | backward, ms | step / shardplan eager "
             "| CPU, ms | CPU / shardplan eager | first step (compile), s "
             "| loss difference vs manual |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f2 = lambda x: f"{x:.2f}"  # noqa: E731
    for name, rs in runs.items():
        diff = max(abs(r["loss"] - m["loss"]) / max(1.0, abs(m["loss"]))
                   for r, m in zip(rs, runs["manual"]))
        lines.append(f"| {name} | {spread([r['step'] for r in rs], _ms)} "
                     f"| {spread([r['fwd'] for r in rs], _ms)} "
                     f"| {spread([r['bwd'] for r in rs], _ms)} "
                     f"| {spread(_ratios(runs, name, 'shardplan', 'step'), f2)} "
                     f"| {spread([r['cpu'] for r in rs], _ms)} "
                     f"| {spread(_ratios(runs, name, 'shardplan', 'cpu'), f2)} "
                     f"| {first[name]:.1f} | {diff:.1e} |")
    return "\n".join(lines)


def verdict(n_embd: int, runs: dict) -> str:
    """Against the goal: compiled shardplan the fastest, and <= 0.9x eager shardplan."""
    parts = []
    for key, what in (("step", "wall"), ("cpu", "CPU")):
        times = {n: med([r[key] for r in rs]) for n, rs in runs.items()}
        fastest = min(times, key=times.get)
        ratio = med(_ratios(runs, "shardplan, compiled", "shardplan", key))
        met = fastest == "shardplan, compiled" and ratio <= 0.9
        parts.append(f"{what}: fastest {fastest}, compiled / eager shardplan {ratio:.2f} "
                     f"({'met' if met else 'NOT met'})")
    return (f"- n_embd {n_embd} (goal: compiled shardplan the fastest and <= 0.90x eager): "
            + "; ".join(parts) + ".")


def main(argv=None) -> int:
    ap = parser(__doc__, "n_embd 512, 3 steps after 1 warm-up")
    ap.add_argument("--sizes", type=int, nargs="+", help="n_embd values (default 256 512)")
    ap.add_argument("--steps", type=int, help="timed steps per size (default 10)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed steps after the first (default 2)")
    args = ap.parse_args(argv)
    if args.quick:
        sizes, steps, warmup = args.sizes or [512], args.steps or 3, min(args.warmup, 1)
    else:
        sizes, steps, warmup = args.sizes or [256, 512], args.steps or 10, args.warmup
    warnings.filterwarnings("ignore")
    from shardplan.ranks import RealRanks

    load_before = os.getloadavg()
    results = {}
    with RealRanks(2, timeout=900) as ranks:
        for n_embd in sizes:
            results[n_embd] = measure(n_embd, steps, warmup, ranks)
    load_after = os.getloadavg()
    body = []
    for n_embd, (first, runs, profiled) in results.items():
        body += [f"n_embd {n_embd} (heads {HEADS}, {LAYERS} layers, vocab {VOCAB}, batch {BATCH}, "
                 f"sequence {SEQ}):", "", table(first, runs), "",
                 f"Where one step's time goes at n_embd {n_embd} (`torch.profiler`, self CPU "
                 "time per category of op name):",
                 "", profiled, ""]
    body += [verdict(n, runs) for n, (_, runs, _) in results.items()]
    text = "\n".join(body)
    print(text)
    diverged = [f"n_embd {n} {name}" for n, (_, runs, _) in results.items()
                for name, rs in runs.items()
                if max(abs(r["loss"] - m["loss"]) for r, m in zip(rs, runs["manual"])) > 1e-3]
    if diverged:
        print(f"PROBLEM: losses differ from the manual run: {', '.join(diverged)}", file=sys.stderr)
    if args.quick or args.no_write:
        return 1 if diverged else 0
    cmd = command_line(COMMAND, {"--sizes": (sizes, [256, 512]), "--steps": (steps, 10),
                                 "--warmup": (warmup, 2)})
    section = "\n".join(section_head(HEADING, cmd, load_before, load_after) + [
        "The model, batch and optimizer of the training-step section above; two gloo processes, "
        "one torch thread each. Contenders: `shardplan, compiled` (`parallelize(..., "
        "compile=True)`: the rewritten graph as one inductor graph, its forward and input-"
        "gradient GEMMs on oneDNN), `shardplan` (eager), "
        "`DTensor, compiled` (the hand-written plan with each block under `torch.compile`, "
        "torchtitan's recipe; embedding, head and `loss_parallel` eager) and `manual` (the "
        "hand-written Megatron, eager). The first step of each, timed alone, holds its compile "
        f"(`first step`); then {warmup} warm-up and {steps} timed rounds of one step of every "
        "contender in a rotated order, each after a barrier (the slower rank's time). Cells: "
        "median (min–max); ratios are medians of the per-round ratios. `CPU` is the step's "
        "CPU time summed over both ranks (one thread each), the steadier measure on a shared "
        "machine. `first step` depends on inductor's on-disk cache (`/tmp/torchinductor_$USER`): "
        "a cold cache makes the compiled contenders' first steps several times longer.", "",
        text, ""])
    write_doc(HEADING, section)
    return 1 if diverged else 0


if __name__ == "__main__":
    sys.exit(main())
