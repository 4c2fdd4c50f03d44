"""Run the benchmarks, each in its own process; each rewrites only its own section
of docs/benchmarks.md.

    python -m benchmarks                      # all of them, full settings
    python -m benchmarks step_time memory     # some of them
    python -m benchmarks --quick              # every one's short check (writes nothing)
    python -m benchmarks --list

Each is also a module of its own (``python -m benchmarks.step_time --help``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from ._common import ROOT, write_doc

HEADING = "## Running the benchmarks"

#: name -> (what it measures, extra arguments for --quick)
BENCHMARKS = {
    "plan_scale": ("planning time and memory as models grow", ["--runs", "1", "--no-write"]),
    "step_time": ("training-step time at tp=2 on gloo: shardplan, DTensor, manual Megatron, "
                  "unsharded", ["--quick"]),
    "compile_step": ("training-step time under torch.compile at tp=2: shardplan compiled and "
                     "eager, DTensor compiled, manual Megatron", ["--quick"]),
    "comm_volume": ("collectives and bytes per training step against the Megatron optimum",
                    ["--quick"]),
    "memory": ("parameter, gradient and AdamW bytes per rank at tp 1-8 against theory",
               ["--quick"]),
    "recompute": ("activation memory per rank and forward+backward time with and without "
                  "recompute=True, tp 1 and 2", ["--quick"]),
    "sequence_parallel": ("sequence parallelism against plain TP: activation bytes per block at "
                          "tp 1-8 against theory, communication bytes, step time at tp=2 "
                          "against plain and DTensor's sequence-parallel plan",
                          ["--quick"]),
    "scale_out": ("TP x FSDP2 on 4 gloo ranks: memory per rank at dp x tp 1x4, 2x2, 4x1 "
                  "against the estimate; step time against TP x replicated DP", ["--quick"]),
    "generate": ("decode latency and prefill throughput at tp 1/2/4 on gloo against the "
                 "unsharded model and HF's tp_plan; K/V-cache bytes per rank; loading a "
                 "multi-file checkpoint per rank", ["--quick"]),
    "memory_estimate": ("the training-memory estimate for Llama-70B/405B at the layouts people "
                        "use", []),
    "coverage": ("every Hugging Face text family, tiny, planned and verified at tp 2 and 4 "
                 "(docs/coverage.md)", ["--quick"]),
    "gpu": ("tp=1 overhead and the 8.3B layer's tp=8 shard on one CUDA GPU (skips without)",
            ["--quick"]),
}


def section() -> str:
    rows = "\n".join(f"| `{name}` | {what} | `python -m benchmarks.{name}` |"
                     for name, (what, _) in BENCHMARKS.items())
    return "\n".join([
        HEADING, "",
        "From the repository root, with the project's environment (`.venv/bin/python`). Each "
        "benchmark runs in its own process and rewrites only its own section below; timings are "
        "benchmarks, never test assertions.", "",
        "```sh",
        "python -m benchmarks                      # all of them (the GPU one skips without CUDA)",
        "python -m benchmarks step_time memory     # some of them",
        "python -m benchmarks --quick              # each one's short check; writes nothing",
        "```", "",
        "| name | measures | alone |", "|---|---|---|", rows, ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", metavar="name",
                    help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}")
    ap.add_argument("--quick", action="store_true",
                    help="each benchmark's short check; nothing is written")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = ap.parse_args(argv)
    if args.list:
        for name, (what, _) in BENCHMARKS.items():
            print(f"{name:12} {what}")
        return 0
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    if not (args.quick or args.no_write):
        write_doc(HEADING, section())
    failed = []
    start = time.monotonic()
    for name in args.names or list(BENCHMARKS):
        extra = list(BENCHMARKS[name][1]) if args.quick else []
        if args.no_write and "--no-write" not in extra:
            extra.append("--no-write")
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *extra]
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        print(f"=== {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in "
              f"{time.monotonic() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    print(f"\n{len(args.names or BENCHMARKS) - len(failed)} ok, {len(failed)} failed "
          f"({', '.join(failed) or 'none'}) in {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
