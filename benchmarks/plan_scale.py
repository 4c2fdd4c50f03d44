"""How long planning takes, and how much memory, as models grow.

    python -m benchmarks.plan_scale            # from the repo root; writes docs/benchmarks.md
    python -m benchmarks.plan_scale --runs 1 --no-write

Every measurement runs in a fresh Python process (the parent only starts
children and collects their numbers), so the peak RSS (the child's VmHWM,
which includes importing torch) is honest and no warm cache leaks between
runs. A child builds the model on the meta device (no parameter memory),
then times ``shardplan.plan`` twice: "cold" is the first plan in the
process (what ``shardplan plan`` pays, torch's first-export warm-up
included), "warm" a second plan of the same model in the same process.
"start to plan" is the wall time from the parent starting the child to the
end of the cold plan (interpreter start, imports, meta build, one plan): what
``shardplan plan`` costs, less printing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ._common import machine

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
HEADING = "## Planning time and memory"
COMMAND = "python -m benchmarks.plan_scale"

# (label, preset, tp, overrides)
CASES = [
    ("gpt-small", "gpt-small", 4, {}),  # 12 heads: tp=8 does not divide
    ("gpt-8.3b", "gpt-8.3b", 8, {}),
    ("llama-7b", "llama-7b", 8, {}),
    ("llama-70b", "llama-70b", 8, {}),
    ("llama-405b", "llama-405b", 8, {}),
] + [(f"llama-70b width, {n} layers", "llama-70b", 8, {"n_layers": n}) for n in (2, 8, 20, 40, 80)]


def _vm(field: str) -> int:
    """A /proc/self/status field in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(spec: str) -> None:
    """One measurement; prints one JSON line."""
    preset, tp, overrides = json.loads(spec)
    start = time.perf_counter()
    import shardplan
    from shardplan.models import build
    imported = time.perf_counter()
    model = build(preset, device="meta", **overrides)
    built = time.perf_counter()
    rss_before = _vm("VmHWM")
    t0, c0 = time.perf_counter(), time.process_time()
    p = shardplan.plan(model, tp)
    cold, cold_cpu = time.perf_counter() - t0, time.process_time() - c0
    done = time.time()  # wall clock: the parent compares it with its own start time
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak = _vm("VmHWM")
    t0 = time.perf_counter()
    shardplan.plan(model, tp)
    warm = time.perf_counter() - t0
    print(json.dumps({
        "done_at": done, "import_s": imported - start, "build_s": built - imported,
        "cold_s": cold, "cold_cpu_s": cold_cpu, "warm_s": warm,
        "cpu_to_plan_s": usage.ru_utime + usage.ru_stime,
        "peak_rss": peak, "rss_before_plan": rss_before,
        "bytes_unsharded": p.memory.param_bytes_unsharded,
        "bytes_per_rank": p.memory.param_bytes_per_rank,
        "repeated": p.repeated, "n_params": len(p.params)}))


def measure(preset: str, tp: int, overrides: dict) -> dict:
    started = time.time()
    r = subprocess.run([sys.executable, "-m", "benchmarks.plan_scale", "--child",
                        json.dumps([preset, tp, overrides])],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{preset} tp={tp} {overrides} failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["start_to_plan_s"] = out.pop("done_at") - started
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f}"


def _stat(values: list[float], fmt) -> str:
    if len(values) == 1:
        return fmt(values[0])
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}–{fmt(max(values))})"


def table(rows: list[tuple[str, int, list[dict]]]) -> str:
    s = lambda x: f"{x:.2f}"  # noqa: E731
    lines = [
        "| model | tp | blocks planned | plan cold, s | plan cold, CPU s | plan warm, s "
        "| import, s | meta build, s | start to plan, s | start to plan, CPU s "
        "| peak RSS, MB | RSS before plan, MB | params unsharded | params per rank |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, tp, runs in rows:
        r0 = runs[0]
        blocks = ", ".join(f"{k}: {a} of {b}" for k, (a, b) in r0["repeated"].items()) or "all"
        lines.append(
            f"| {label} | {tp} | {blocks} "
            f"| {_stat([r['cold_s'] for r in runs], s)} "
            f"| {_stat([r['cold_cpu_s'] for r in runs], s)} "
            f"| {_stat([r['warm_s'] for r in runs], s)} "
            f"| {_stat([r['import_s'] for r in runs], s)} "
            f"| {_stat([r['build_s'] for r in runs], s)} "
            f"| {_stat([r['start_to_plan_s'] for r in runs], s)} "
            f"| {_stat([r['cpu_to_plan_s'] for r in runs], s)} "
            f"| {_stat([r['peak_rss'] for r in runs], _mb)} "
            f"| {_stat([r['rss_before_plan'] for r in runs], _mb)} "
            f"| {_gib(r0['bytes_unsharded'])} | {_gib(r0['bytes_per_rank'])} |")
    return "\n".join(lines)


def summary(rows) -> str:
    """Where the numbers stand against the issue's targets, computed from them."""
    by = {label: runs for label, _, runs in rows}
    med = lambda label, key: statistics.median(r[key] for r in by[label])  # noqa: E731
    out = ["Against the targets (70B shape: < 5 s, < 1 GB peak RSS on 2 cores; cost linear "
           "or better in layers):", ""]
    if "llama-70b" in by:
        cold, cold_cpu, start, start_cpu, rss = (med("llama-70b", k) for k in (
            "cold_s", "cold_cpu_s", "start_to_plan_s", "cpu_to_plan_s", "peak_rss"))
        ok = lambda t: "within" if t < 5 else "over"  # noqa: E731
        out.append(f"- llama-70b at tp=8: `plan()` {cold:.2f} s wall, {cold_cpu:.2f} s CPU "
                   f"({ok(cold)} 5 s); the whole process to a plan {start:.2f} s wall, "
                   f"{start_cpu:.2f} s CPU ({ok(start)} 5 s wall; the rest is interpreter start, "
                   f"imports and the meta build); peak RSS {rss / 1e6:.0f} MB "
                   f"({'within' if rss < 1e9 else 'OVER'} 1 GB).")
    sweep = [(int(label.split(", ")[1].split()[0]), label) for label in by if "width," in label]
    if len(sweep) >= 2:
        (n0, l0), (n1, l1) = min(sweep), max(sweep)
        t0, t1 = med(l0, "cold_cpu_s"), med(l1, "cold_cpu_s")
        r0, r1 = med(l0, "peak_rss"), med(l1, "peak_rss")
        b0, b1 = med(l0, "build_s"), med(l1, "build_s")
        shape = ("flat: identical blocks are captured and planned once, then stamped"
                 if t1 / t0 < 1.5 else
                 "linear or better" if t1 / t0 <= 1.1 * n1 / n0 else "WORSE than linear")
        out.append(f"- Layers {n0} -> {n1} ({n1 / n0:.0f}x): `plan()` {t0:.2f} -> {t1:.2f} s CPU "
                   f"({t1 / t0:.2f}x), peak RSS {r0 / 1e6:.0f} -> {r1 / 1e6:.0f} MB ({shape}). "
                   f"Meta build: {b0:.2f} -> {b1:.2f} s wall.")
    return "\n".join(out)


def write_doc(section: str) -> None:
    """Put ``section`` under HEADING in docs/benchmarks.md, keeping every other section."""
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    start = text.find(HEADING + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(HEADING))
        text = text[:start] + section + (text[nxt + 1:] if nxt >= 0 else "")
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text.rstrip("\n") + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per case (default 3)")
    ap.add_argument("--no-write", action="store_true",
                    help=f"do not update {DOC.relative_to(ROOT)}")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {label: [] for label, *_ in CASES}
    for i in range(args.runs):  # round robin: a burst of load on a shared machine hits every case
        for label, preset, tp, overrides in CASES:
            r = measure(preset, tp, overrides)
            runs[label].append(r)
            print(f"run {i + 1}/{args.runs} {label:28} tp={tp}: plan {r['cold_s']:5.2f} s, "
                  f"peak RSS {r['peak_rss'] / 1e6:4.0f} MB", file=sys.stderr, flush=True)
    rows = [(label, tp, runs[label]) for label, _, tp, _ in CASES]
    load_after = os.getloadavg()
    result = table(rows)
    print(result)
    if not args.no_write:
        stats = "median (min–max) of" if args.runs > 1 else "one run of"
        section = "\n".join([
            HEADING, "",
            "Reproduce from the repository root (writes this section):", "",
            "```sh", COMMAND + (f" --runs {args.runs}" if args.runs != 3 else ""), "```", "",
            f"Machine: {machine()}. Measured {datetime.date.today().isoformat()}; 1-minute load "
            f"average {load_before[0]:.2f} before, {load_after[0]:.2f} after (the machine may be "
            "shared: a load near or above the core count means the times include contention).",
            "",
            f"Each cell is the {stats} {args.runs} fresh processes, models built on the meta "
            "device (no parameter memory).", "",
            "- `plan cold`: the first `shardplan.plan()` in a process (torch's first-export "
            "warm-up included); `plan warm`: a second plan of the same model in that process. "
            "Times are wall clock unless marked CPU (user + system, all threads): on a loaded "
            "machine wall time grows with contention and CPU time much less.",
            "- `import`: importing shardplan (and torch); `meta build`: building the model on "
            "meta; `start to plan`: wall time from starting the child to the end of its cold "
            "plan (interpreter, imports, build, one plan), i.e. what `shardplan plan` costs "
            "less printing; `start to plan, CPU`: the child's CPU time up to then.",
            "- `peak RSS`: the child's VmHWM after the cold plan, torch's import included; "
            "`RSS before plan`: VmHWM after imports and the meta build.",
            "- `blocks planned`: how many of a list of identical blocks were captured and "
            "planned (the rest are stamped from them). Parameter bytes are `plan.memory`.", "",
            result, "",
            summary(rows), ""])
        write_doc(section)
        print(f"\nwritten to {DOC.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
