"""What a capture costs with and without the fake-tensor dispatch cache; prints a table.

    python -m benchmarks.capture_cost              # 5 interleaved rounds
    python -m benchmarks.capture_cost --rounds 3 --families llama gpt2

``planner.capture`` exports every model with symbolic batch and sequence dims,
inside ``torch_compat.uncached_fake_dispatch`` (the cache off). Each round
captures each model twice in this process, once that way and once with the cache
on (torch's default), in alternating order; the cell is the median CPU time
(user + system of this process: on a shared machine wall time also counts the
neighbours) and the ratio is cache on over cache off. The models are tiny: the
bundled presets at two layers and survey families built as ``benchmarks.coverage``
builds them.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

from . import coverage

PRESETS = {"gpt-tiny": {"n_layer": 2}, "llama-tiny": {"n_layers": 2}}
FAMILIES = ["llama", "gpt2", "bert", "mixtral", "t5"]


def models(families: list[str]) -> dict:
    """``{name: (model, args, kwargs)}``: the presets and the survey's tiny families."""
    import torch

    from shardplan.models import build
    out = {}
    for preset, overrides in PRESETS.items():
        model = build(preset, **overrides)
        out[preset] = model, (torch.zeros(2, 8, dtype=torch.long),), {}
    for family in families:
        task, class_name = coverage.families()[family]
        out[family] = coverage.build(family, class_name), (), coverage.example_inputs(task)
    return out


def cpu_seconds(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--families", nargs="+", default=FAMILIES)
    opts = parser.parse_args(argv)

    from shardplan.planner import capture as capturing
    cached = mock.patch.object(capturing, "uncached_fake_dispatch", contextlib.nullcontext)
    times: dict[tuple[str, bool], list[float]] = {}
    for name, (model, args, kwargs) in models(opts.families).items():
        capturing.capture(model, args, kwargs)  # torch's first-export warm-up, not timed
        for r in range(opts.rounds):
            for cache in ((False, True) if r % 2 else (True, False)):
                with cached if cache else contextlib.nullcontext():
                    seconds = cpu_seconds(lambda: capturing.capture(model, args, kwargs))
                times.setdefault((name, cache), []).append(seconds)
    print(f"capture CPU seconds, median of {opts.rounds} interleaved rounds\n")
    print("| model | cache off (shardplan) | cache on (torch's default) | on / off |")
    print("|---|---:|---:|---:|")
    for name in dict.fromkeys(n for n, _ in times):
        off, on = (statistics.median(times[name, c]) for c in (False, True))
        print(f"| {name} | {off:.2f} | {on:.2f} | {on / off:.2f}x |")


if __name__ == "__main__":
    main()
