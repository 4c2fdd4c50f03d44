"""What the benchmarks share: machine description, statistics, the doc writer,
and a neutral collective counter."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"


def machine() -> str:
    mem = next(line for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal:"))
    ram_gib = int(mem.split()[1]) / 2**20
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
               platform.processor() or "unknown CPU")
    import torch
    return (f"{os.cpu_count()} cores (nproc {len(os.sched_getaffinity(0))}), "
            f"{ram_gib:.1f} GiB RAM, {cpu}; Linux {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def measured_line(load_before, load_after) -> str:
    return (f"Machine: {machine()}. Measured {datetime.date.today().isoformat()}; 1-minute load "
            f"average {load_before[0]:.2f} before, {load_after[0]:.2f} after (the machine may be "
            "shared: a load near or above the core count means the times include contention).")


def command_line(command: str, options: dict) -> str:
    """``command`` with each option that differs from its default: ``{flag: (value, default)}``
    (a list value is written space-separated)."""
    for flag, (value, default) in options.items():
        if value != default:
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            command += f" {flag} {shown}"
    return command


def section_head(heading: str, command: str, load_before, load_after) -> list[str]:
    """The opening lines every benchmark section shares: how to reproduce it, and where."""
    return [heading, "",
            "Reproduce from the repository root (writes this section; `--quick` for a short check "
            "that writes nothing):", "",
            "```sh", command, "```", "",
            measured_line(load_before, load_after), ""]


def med(values) -> float:
    return statistics.median(values)


def spread(values, fmt=lambda x: f"{x:.1f}") -> str:
    """``median (min–max)``."""
    values = list(values)
    if len(values) == 1:
        return fmt(values[0])
    return f"{fmt(med(values))} ({fmt(min(values))}–{fmt(max(values))})"


def parser(doc: str, quick: str) -> argparse.ArgumentParser:
    """A benchmark's command line: described by its docstring's first paragraph, with
    ``--quick`` (``quick`` says what it shrinks) and ``--no-write``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{quick}; prints only")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    return ap


def write_doc(heading: str, section: str, *, only_if_missing: bool = False) -> None:
    """Put ``section`` (which starts with ``heading``) in docs/benchmarks.md in place of
    the section under that heading, keeping every other section; append if absent."""
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    start = text.find(heading + "\n")
    if start >= 0 and only_if_missing:
        return
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + section.rstrip("\n") + "\n" + ("\n" + text[nxt + 1:] if nxt >= 0 else "")
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text.rstrip("\n") + "\n")
    print(f"\nwritten to {DOC.relative_to(DOC.parent.parent)}", file=sys.stderr)


# ----------------------------------------------------------------- counting collectives

def _numel(x) -> int:
    import torch
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(_numel(y) for y in x)
    return 0


def _elsize(x) -> int:
    import torch
    if isinstance(x, torch.Tensor):
        return x.element_size()
    if isinstance(x, (list, tuple)) and x:
        return _elsize(x[0])
    return 0


def comm_counter():
    """A ``CommDebugMode`` that also records each collective's kind and logical size.

    It sees every collective at the dispatcher: DTensor's functional collectives and
    plain ``torch.distributed`` calls (c10d ops) alike, so one observer counts every
    contender. Sizes follow shardplan's ledger: the reduced tensor for an all-reduce,
    the gathered (full) tensor for an all-gather, the full input of a reduce-scatter.
    ``records``: ``[(kind, elements, bytes)]`` in issue order.
    """
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    ops = torch.ops
    kinds = {}
    for name, kind in [("all_reduce", "all_reduce"), ("all_reduce_coalesced", "all_reduce"),
                       ("all_gather_into_tensor", "all_gather"),
                       ("all_gather_into_tensor_coalesced", "all_gather"),
                       ("reduce_scatter_tensor", "reduce_scatter"),
                       ("reduce_scatter_tensor_coalesced", "reduce_scatter"),
                       ("all_to_all_single", "all_to_all"), ("broadcast", "broadcast")]:
        for ns in ("_c10d_functional", "c10d_functional"):
            op = getattr(getattr(ops, ns), name, None)
            if op is not None:
                kinds[op] = kind
    c10d = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
            "allgather_": "all_gather", "_allgather_base_": "all_gather",
            "allgather_into_tensor_coalesced_": "all_gather",
            "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
            "reduce_scatter_tensor_coalesced_": "reduce_scatter", "broadcast_": "broadcast",
            "alltoall_": "all_to_all", "alltoall_base_": "all_to_all"}
    for name, kind in c10d.items():
        op = getattr(ops.c10d, name, None)
        if op is not None:
            kinds[op] = kind

    class Counting(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.records: list[tuple[str, int, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is NotImplemented or any(t == DTensor for t in types):
                return out
            pkt = getattr(func, "_overloadpacket", None)
            kind = kinds.get(pkt)
            if kind is not None:
                name = pkt.__name__
                if name in ("allgather_",):  # (outputs, inputs, ...)
                    n, es = _numel(args[0]), _elsize(args[0])
                elif name in ("_allgather_base_",):  # (output, input)
                    n, es = _numel(args[0]), _elsize(args[0])
                elif kind == "all_gather":  # funcol (input, group_size, tag)
                    n, es = _numel(args[0]) * int(args[1]), _elsize(args[0])
                elif name in ("reduce_scatter_", "_reduce_scatter_base_"):  # (outputs, inputs)
                    n, es = _numel(args[1]), _elsize(args[1])
                else:
                    n, es = _numel(args[0]), _elsize(args[0])
                self.records.append((kind, n, n * es))
            return out

    return Counting()


def tally(records) -> tuple[int, int, Counter]:
    """(count, bytes, Counter of (kind, elements))."""
    return len(records), sum(r[2] for r in records), Counter((r[0], r[1]) for r in records)
