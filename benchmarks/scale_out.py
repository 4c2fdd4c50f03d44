"""TP x FSDP2 on 4 gloo ranks: per-rank memory at dp x tp = 1x4, 2x2, 4x1 with and
without FSDP against ``shardplan.plan(...).memory.training``, and the step time of
TP x FSDP2 against TP x replicated data parallelism at dp 2 x tp 2.

    python -m benchmarks.scale_out              # from the repo root; writes docs/benchmarks.md
    python -m benchmarks.scale_out --quick      # n_embd 128, 3 timed rounds; prints only
    python -m benchmarks.scale_out --sizes 256 512 1024 --rounds 20

One command starts four gloo worker processes (``shardplan.ranks.RealRanks(4)``,
one torch thread each); the mesh is ``ParallelDims(tp=, dp_replicate=)`` or, with
FSDP2, ``ParallelDims(tp=, dp_shard=)``, ``.with_mesh("cpu")``.
Every step is the trainer's ``training_step`` (clip 1.0; ``build_optimizer``'s
AdamW; without FSDP the gradients are averaged over dp, with FSDP2 its
reduce-scatter does it). Each dp rank trains on its rows of one global batch.

Memory, per rank after one step: the local bytes (a ``DTensor`` counts its local
shard) of the parameters, their gradients and the optimizer state (the two
moments; the 4-byte ``step`` tensors are listed apart), and the peak growth
of the process's resident set during that step (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``, minus ``VmRSS`` before the step): torch has
no CPU allocator statistics. Its estimate is the estimate's peak less its
parameters (which were resident before the step).

Step time, at every size: every worker holds both models at dp 2 x tp 2 (the
same weights); each round runs one step of each, in an order alternating every
round, each after a barrier; a step's time is the slower rank's. Memory is
measured at the first size, on workers of its own whose glibc maps every
allocation above 64 KiB separately (``MALLOC_MMAP_THRESHOLD_``), so that the
resident set follows the live tensors.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/step_time.py

import torch  # noqa: E402

from ._common import med, parser, section_head, spread, write_doc  # noqa: E402

HEADING = "## TP x FSDP2: memory per rank and step time, 4 gloo ranks"
COMMAND = "python -m benchmarks.scale_out"
LAYOUTS = ((1, 4), (2, 2), (4, 1))  # (dp, tp)
GLOBAL_BATCH, SEQ, LR, TARGET = 8, 64, 1e-3, 1.15
TERMS = ("params", "grads", "optimizer", "step_peak")
CONTENDERS = ("TP x FSDP2", "TP x replicated DP")
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"

_STATE: dict = {}  # per worker: the step-time contenders


def gpt_config(n_embd: int) -> dict:
    return dict(n_embd=n_embd, n_head=4, n_layer=4, vocab_size=16 * n_embd, block_size=SEQ,
                dropout=0.0)


def _model(cfg: dict):
    from shardplan.models import build
    torch.manual_seed(0)
    return build("gpt-tiny", **cfg)


def _global_batch(cfg: dict):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, cfg["vocab_size"], (GLOBAL_BATCH, SEQ), generator=g)
                 for _ in range(2))


class _Trainee:
    """One rank's sharded model, optimizer and batch rows, stepped by ``training_step``."""

    def __init__(self, cfg: dict, dp: int, tp: int, fsdp: bool):
        import shardplan
        from shardplan.layouts import MeshDim
        from shardplan.parallel_dims import ParallelDims
        from shardplan.train.optim import build_optimizer
        from shardplan.train.trainer import TrainConfig

        sizes = ParallelDims.data_parallel(dp=dp, fsdp=fsdp)
        dims = ParallelDims(tp=tp, **{k: v or 1 for k, v in sizes.items()}).with_mesh("cpu")
        rows = GLOBAL_BATCH // dp
        mine = slice(dims.dp_rank * rows, (dims.dp_rank + 1) * rows)
        self.batch = tuple(t[mine] for t in _global_batch(cfg))
        self.model = shardplan.parallelize(_model(cfg), mesh=dims.mesh, fsdp=fsdp,
                                           gather_output=False, example_inputs=self.batch)
        self.optimizer = build_optimizer(self.model, LR)
        self.config = TrainConfig(tp=tp, dp=dp, fsdp=fsdp, lr=LR)
        self.dp_group = dims.group(MeshDim.DP_REPLICATE) if dims.dp_replicate > 1 else None

    def step(self) -> float:
        from shardplan.train.optim import TPGradScaler
        from shardplan.train.trainer import training_step
        done = training_step(self.model, self.optimizer, TPGradScaler("cpu", enabled=False),
                             self.batch, config=self.config, lr=LR, dp_group=self.dp_group)
        return float(done.loss)


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _status_kb(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith(field + ":"))
    return int(line.split()[1])


def memory_rank(ctx, cfg: dict, dp: int, tp: int, fsdp: bool) -> dict:
    """On each worker: one step at (dp, tp), then this rank's bytes per term."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    trainee = _Trainee(cfg, dp, tp, fsdp)
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    trainee.step()
    grown = (_status_kb("VmHWM") - before) * 1024
    params = list(trainee.model.parameters())
    state = [v for s in trainee.optimizer.state.values() for k, v in s.items() if k != "step"]
    steps = [s["step"] for s in trainee.optimizer.state.values() if "step" in s]
    return {"params": _local_bytes(params),
            "grads": _local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _local_bytes(state), "step_tensors": _local_bytes(steps),
            "step_peak": grown}


def estimate(cfg: dict, dp: int, tp: int, fsdp: bool) -> dict:
    """``shardplan.plan(...).memory.training`` for the same setting, per term."""
    import shardplan
    est = shardplan.plan(_model(cfg), tp, batch=GLOBAL_BATCH // dp, seq=SEQ, dp=dp, fsdp=fsdp,
                         dtype=torch.float32, optimizer="adamw").memory.training
    return {"params": est.params, "grads": est.grads, "optimizer": est.optimizer_state,
            "step_peak": est.peak - est.params}


def time_setup(ctx, cfg: dict) -> None:
    """On each worker: both contenders at dp 2 x tp 2, from the same weights."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    _STATE.clear()
    _STATE.update({name: _Trainee(cfg, 2, 2, name == CONTENDERS[0]) for name in CONTENDERS})


def time_round(ctx, order: list[str]) -> dict:
    """On each worker: one step of each contender after a barrier: (wall, CPU, loss)."""
    import torch.distributed as dist
    out = {}
    for name in order:
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = _STATE[name].step()
        out[name] = (time.perf_counter() - t0, time.process_time() - c0, loss)
    return out


def measure_time(ranks, cfg: dict, rounds: int, warmup: int) -> dict:
    """``{contender: [(wall, CPU summed over ranks, loss)]}`` over the timed rounds."""
    ranks.run(time_setup, cfg)
    runs: dict = {name: [] for name in CONTENDERS}
    for i in range(warmup + rounds):
        order = list(CONTENDERS) if i % 2 == 0 else list(reversed(CONTENDERS))
        per_rank = ranks.run(time_round, order)
        for name in CONTENDERS:
            wall = max(r[name][0] for r in per_rank)
            cpu = sum(r[name][1] for r in per_rank)
            if i >= warmup:
                runs[name].append((wall, cpu, per_rank[0][name][2]))
        print(f"  round {i + 1}{' (warm-up)' if i < warmup else ''}: "
              + ", ".join(f"{n} {max(r[n][0] for r in per_rank) * 1e3:.0f} ms"
                          for n in CONTENDERS), file=sys.stderr, flush=True)
    return runs


def _mb(n: int) -> str:
    return f"{n / 1e6:,.3f}"


def memory_table(rows) -> str:
    head = ["| dp x tp | FSDP |"
            + "".join(f" {t}, MB | est. | ratio |" for t in
                      ("params", "grads", "AdamW moments", "step peak growth (RSS)"))
            + " AdamW `step` tensors, B |",
            "|---|---|" + "---:|" * 13]
    lines = []
    for (dp, tp, fsdp), got, want in rows:
        cells = "".join(f" {_mb(got[t])} | {_mb(want[t])} | {got[t] / want[t]:.2f} |"
                        for t in TERMS)
        lines.append(f"| {dp} x {tp} | {'yes' if fsdp else 'no'} |{cells} "
                     f"{got['step_tensors']:,} |")
    return "\n".join(head + lines)


def time_table(runs: dict) -> tuple[str, str]:
    ms = lambda x: f"{x * 1e3:,.0f}"  # noqa: E731
    f3 = lambda x: f"{x:.3f}"  # noqa: E731
    fsdp, ddp = (runs[n] for n in CONTENDERS)
    lines = ["| contender | step, ms | CPU (4 ranks), ms | last loss |", "|---|---:|---:|---:|"]
    for name in CONTENDERS:
        rs = runs[name]
        lines.append(f"| {name} | {spread([r[0] for r in rs], ms)} "
                     f"| {spread([r[1] for r in rs], ms)} | {rs[-1][2]:.4f} |")
    wall = [a[0] / b[0] for a, b in zip(fsdp, ddp)]
    cpu = [a[1] / b[1] for a, b in zip(fsdp, ddp)]
    loss_diff = max(abs(a[2] - b[2]) for a, b in zip(fsdp, ddp))
    verdict = (f"TP x FSDP2 / TP x replicated DP, per round: wall {spread(wall, f3)}, CPU "
               f"{spread(cpu, f3)} (goal <= {TARGET}x: wall "
               f"{'met' if med(wall) <= TARGET else 'NOT met'}, CPU "
               f"{'met' if med(cpu) <= TARGET else 'NOT met'}); largest loss difference "
               f"between the two at the same step: {loss_diff:.1e}.")
    return "\n".join(lines), verdict


@contextlib.contextmanager
def _mmap_large_allocations():
    """Processes spawned inside get glibc's mmap threshold fixed at 64 KiB: every larger
    allocation is its own mapping, unmapped when freed, so the RSS follows live tensors."""
    old = os.environ.get(MMAP_ENV)
    os.environ[MMAP_ENV] = str(64 * 1024)
    try:
        yield
    finally:
        if old is None:
            del os.environ[MMAP_ENV]
        else:
            os.environ[MMAP_ENV] = old


def measure_memory(cfg: dict) -> list:
    """``[((dp, tp, fsdp), measured, estimated)]``, on workers of their own; a first,
    untabled run warms them."""
    from shardplan.ranks import RealRanks
    with _mmap_large_allocations(), RealRanks(4, timeout=900) as ranks:
        return _memory_rows(ranks, cfg)


def _memory_rows(ranks, cfg: dict) -> list:
    ranks.run(memory_rank, cfg, *LAYOUTS[0], False)
    rows = []
    for dp, tp in LAYOUTS:
        for fsdp in ((False, True) if dp > 1 else (False,)):
            per_rank = ranks.run(memory_rank, cfg, dp, tp, fsdp)
            got = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
            rows.append(((dp, tp, fsdp), got, estimate(cfg, dp, tp, fsdp)))
            print(f"  memory dp {dp} x tp {tp}, fsdp {fsdp}: {got}", file=sys.stderr, flush=True)
    return rows


def model_line(n_embd: int) -> str:
    cfg = gpt_config(n_embd)
    n_params = sum(p.numel() for p in _model(cfg).parameters())
    return (f"n_embd {n_embd} (`gpt-tiny`: {cfg['n_layer']} layers, {cfg['n_head']} heads, vocab "
            f"{cfg['vocab_size']}; {n_params / 1e6:.2f}M parameters)")


def section(command: str, loads, sizes, rounds, warmup, memory: str, timing: list[str]) -> str:
    return "\n".join([
        *section_head(HEADING, command, *loads),
        f"The bundled GPT, float32, global batch {GLOBAL_BATCH} x {SEQ} tokens ({GLOBAL_BATCH} "
        "// dp rows per dp rank). Four gloo processes (`RealRanks(4)`), one torch thread each, "
        "mesh `ParallelDims(tp=, dp_replicate=)` (with FSDP2 `dp_shard=`)`.with_mesh(\"cpu\")`; "
        "every step is the trainer's "
        f"`training_step` (clip 1.0, `build_optimizer`'s AdamW, lr {LR}); without FSDP the "
        "gradients are averaged over dp, with FSDP2 its reduce-scatter averages them. The "
        "machine was shared and loaded while this ran (see the load averages): read the times "
        "as indications, the per-round ratios as the measure.", "",
        f"### Memory per rank after one step, {model_line(sizes[0])}", "",
        "Measured: the local bytes (a `DTensor` counts its local shard) of the parameters, "
        "their gradients and AdamW's two moments, the largest rank; the 4-byte `step` tensors "
        "are listed apart (the estimate leaves them out). `step peak growth`: torch has no CPU "
        "allocator statistics, so this is the resident set's high-water mark during the first "
        "step (`VmHWM`, reset through `/proc/self/clear_refs`) minus the resident set before "
        "it. These workers run with glibc's `MALLOC_MMAP_THRESHOLD_=65536`, so that every "
        "allocation above 64 KiB is mapped on its own and returned when freed and the resident "
        "set follows the live tensors; it still includes gloo's buffers and smaller "
        "allocations (an untabled run first warms the workers). "
        "Estimated: `shardplan.plan(model, tp, batch=, seq=, dp=, fsdp=, dtype=float32, "
        "optimizer=\"adamw\").memory.training` (for the peak growth: its peak less its "
        "parameters, i.e. gradients + optimizer state + FSDP's gathered block + activations, "
        "a deliberate upper bound). MB = 10^6 bytes; ratio = measured / estimated.", "",
        memory, "",
        "### Step time at dp 2 x tp 2: TP x FSDP2 against TP x replicated DP", "",
        f"{warmup} warm-up rounds, then {rounds} timed rounds; each round runs one step of each "
        "model (both on every worker, same weights), in an order alternating every round, each "
        "after a barrier; a step's time is the slower rank's, CPU the sum over the 4 ranks. "
        "Cells: median (min–max); ratios per round. Goal: TP x FSDP2 <= "
        f"{TARGET}x TP x replicated DP.", "",
        *timing,
        "The training-memory estimate for Llama-70B/405B at tp 8 x dp 8/16/64 is in "
        "[Training memory estimate (will it fit?)](#training-memory-estimate-will-it-fit) "
        "(`python -m benchmarks.memory_estimate`).", ""])


def main(argv=None) -> int:
    ap = parser(__doc__, "n_embd 128, 3 timed rounds")
    ap.add_argument("--sizes", type=int, nargs="+",
                    help="n_embd values, memory at the first (default 256 512; --quick 128)")
    ap.add_argument("--rounds", type=int, help="timed step-time rounds (default 10; --quick 3)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from shardplan.ranks import RealRanks

    sizes = args.sizes or ([128] if args.quick else [256, 512])
    rounds, warmup = args.rounds or (3 if args.quick else 10), 1 if args.quick else 2
    load_before = os.getloadavg()
    rows = measure_memory(gpt_config(sizes[0]))
    with RealRanks(4, timeout=900) as ranks:
        runs = {n: measure_time(ranks, gpt_config(n), rounds, warmup) for n in sizes}
    load_after = os.getloadavg()
    memory, timing = memory_table(rows), []
    for n, r in runs.items():
        steps, verdict = time_table(r)
        timing += [f"{model_line(n)}:", "", steps, "", verdict, ""]
    print("\n".join([memory, "", *timing]))
    if args.quick or args.no_write:
        return 0
    command = COMMAND + (" --sizes " + " ".join(map(str, sizes)) if sizes != [256, 512] else "") \
        + (f" --rounds {rounds}" if rounds != 10 else "")
    write_doc(HEADING, section(command, (load_before, load_after), sizes, rounds, warmup,
                               memory, timing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
