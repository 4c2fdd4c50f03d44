"""Checkpoint save and load times of the bundled GPT at tp 2 (``shardplan.checkpoint``,
torch DCP), medians over rounds; prints a table, writes nothing.

    python -m benchmarks.checkpoint_io                 # gpt-small, 5 rounds
    python -m benchmarks.checkpoint_io --preset gpt-tiny --rounds 3

Two gloo processes (``RealRanks(2)``) each build the model from the same seed,
parallelize it at tp 2 and take one AdamW step (so the optimizer has state).
Each round, after a barrier: ``save`` (weights and optimizer state), ``load``
into the same model and optimizer, then ``async_save``: the time until it
returns (what a training step waits for: the copy of this rank's tensors) and
until ``wait()`` has committed it. The slower rank's time counts. Files go to a
temporary directory (the page cache: not disk speed), removed after each round.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time


def rank_times(ctx, preset: str, rounds: int, root: str) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    import shardplan
    from shardplan import checkpoint
    from shardplan.models import build
    torch.manual_seed(0)
    model = build(preset)
    idx = torch.randint(0, 96, (2, 16))  # every bundled vocabulary is larger
    sharded = shardplan.parallelize(model, group=ctx.group, example_inputs=(idx, idx))
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    sharded(idx, idx)[1].backward()
    opt.step()
    times: dict[str, list[float]] = {"save": [], "load": [], "async_save returns": [],
                                     "async_save committed": []}

    def timed(key, fn, path):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn(sharded, path, optimizer=opt)
        times[key].append(time.perf_counter() - t0)
        return out, t0

    for r in range(rounds):
        timed("save", checkpoint.save, f"{root}/round{r}")
        timed("load", checkpoint.load, f"{root}/round{r}")
        pending, t0 = timed("async_save returns", checkpoint.async_save, f"{root}/async{r}")
        pending.wait()
        times["async_save committed"].append(time.perf_counter() - t0)
        dist.barrier()
        if ctx.rank == 0:  # a round's checkpoints go: the next round writes afresh
            for name in (f"round{r}", f"async{r}"):
                shutil.rmtree(f"{root}/{name}")
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt-small")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    from shardplan.ranks import RealRanks
    with tempfile.TemporaryDirectory() as root, RealRanks(2, timeout=1800) as ranks:
        results = ranks.run(rank_times, args.preset, args.rounds, root)
    print(f"{args.preset} at tp 2, median of {args.rounds} rounds (slower rank):")
    for key in results[0]:
        slower = [max(rank[key][i] for rank in results) for i in range(args.rounds)]
        print(f"  {key:<22} {statistics.median(slower):8.3f} s")


if __name__ == "__main__":
    main()
