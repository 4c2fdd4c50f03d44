"""GPU measurements on one CUDA device: the overhead of the rewritten module at tp=1,
and the per-rank time of a tp=8 shard of the 8.3B GPT's transformer layer.

    python -m benchmarks.gpu                     # on a CUDA machine; writes docs/benchmarks.md
    python -m benchmarks.gpu --quick             # fewer steps; prints only
    python -m benchmarks.gpu --device cpu --quick   # the same code on CPU, tiny sizes (a check)

Without CUDA (and no ``--device cpu``) it prints why and exits 0, leaving the
doc's GPU section as it is (written as "not measured yet" if absent).

1. tp=1 overhead: ``gpt-small`` (124M) training steps, the plain model against
   ``shardplan.parallelize`` on a group of one rank (a shardplan ``ThreadGroup``
   of size 1: no process group, every collective a copy), steps interleaved,
   CUDA-synchronized; forward, backward and AdamW step.
2. The 8.3B config's layer (``gpt-8.3b``: h 3072, 32 heads): one ``Block``
   unsharded against this rank's tp=8 shard made by ``shardplan.parallelize``
   with a group whose collectives do nothing (``_NoCommGroup``: rank 0 of 8),
   so the time is the shard's compute alone, to set against 1/8 of the
   unsharded layer's. On 8 GPUs NCCL's all-reduces of b·s·h (2 forward,
   2 backward per layer) come on top.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import time
import warnings

import torch

from shardplan.runtime.comm import Group

from ._common import measured_line, parser, spread, write_doc

HEADING = "## GPU: tp=1 overhead and the 8.3B layer's tp=8 shard"
COMMAND = "python -m benchmarks.gpu"


class _NoCommGroup(Group):
    """Rank ``rank`` of ``size`` whose collectives return their input (shapes right,
    values not): a shard's compute without its communication, on one device."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def _all_reduce(self, t, op):
        return t

    def _all_gather(self, t, dim):
        return torch.cat([t] * self.size, dim)

    def _reduce_scatter(self, t, dim):
        return t.chunk(self.size, dim)[self.rank].contiguous()

    def _broadcast(self, t, src):
        return t

    def _barrier(self):
        pass


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(fn, device) -> dict:
    """fn() -> (forward_output_loss, optimizer or None); returns phase times."""
    _sync(device)
    t0 = time.perf_counter()
    loss, opt = fn()
    _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    _sync(device)
    t2 = time.perf_counter()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    _sync(device)
    t3 = time.perf_counter()
    return {"fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2, "step": t3 - t0}


def _interleaved(contenders: dict, steps: int, warmup: int, device) -> dict:
    runs = {n: [] for n in contenders}
    names = list(contenders)
    for i in range(warmup + steps):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            r = _timed_step(contenders[n], device)
            if i >= warmup:
                runs[n].append(r)
    return runs


def tp1_overhead(device, dtype, steps, warmup, small: bool) -> dict:
    import shardplan
    from shardplan.models import build
    from shardplan.runtime.comm import Rendezvous, ThreadGroup

    cfg = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=512, block_size=64) if small else {}
    b, s = (2, 64) if small else (8, 1024)
    torch.manual_seed(0)
    model = build("gpt-small", **cfg).to(device=device, dtype=dtype)
    vocab = model.config.vocab_size
    idx = torch.randint(0, vocab, (b, s), device=device)
    tgt = torch.randint(0, vocab, (b, s), device=device)
    plain = copy.deepcopy(model)
    sharded = shardplan.parallelize(copy.deepcopy(model), group=ThreadGroup(0, Rendezvous(1)),
                                    example_inputs=(idx, tgt), gather_output=False)
    opts = {"plain": torch.optim.AdamW(plain.parameters(), lr=1e-4),
            "shardplan, tp=1": torch.optim.AdamW(sharded.parameters(), lr=1e-4)}
    mods = {"plain": plain, "shardplan, tp=1": sharded}
    contenders = {n: (lambda n=n: (mods[n](idx, tgt)[1], opts[n])) for n in mods}
    return {"label": f"gpt-small{' (tiny check sizes)' if small else ''}, batch {b}, sequence {s}",
            "runs": _interleaved(contenders, steps, warmup, device)}


def layer_shard(device, dtype, steps, warmup, small: bool, tp: int = 8) -> dict:
    import shardplan
    from shardplan.models import PRESETS
    from shardplan.models.gpt import Block

    cfg = PRESETS["gpt-8.3b"][1]
    if small:
        cfg = dataclasses.replace(cfg, n_embd=256, n_head=8)
    b, s = (2, 64) if small else (8, 1024)
    torch.manual_seed(0)
    block = Block(cfg).to(device=device, dtype=dtype)
    x = torch.randn(b, s, cfg.n_embd, device=device, dtype=dtype, requires_grad=True)
    shard = shardplan.parallelize(copy.deepcopy(block), group=_NoCommGroup(0, tp),
                                  example_inputs=(x.detach(),))
    g = torch.randn_like(x)
    mods = {"unsharded layer": block, f"tp={tp} shard (rank 0)": shard}
    contenders = {n: (lambda n=n: ((mods[n](x) * g).sum(), None)) for n in mods}
    runs = _interleaved(contenders, steps, warmup, device)
    params = {n: sum(p.numel() for p in m.parameters()) for n, m in mods.items()}
    return {"label": f"gpt-8.3b layer{' (tiny check sizes)' if small else ''} (h {cfg.n_embd}, "
                     f"{cfg.n_head} heads), batch {b}, sequence {s}",
            "runs": runs, "params": params, "tp": tp}


def _ms(x):
    return f"{x * 1e3:,.2f}"


def report(over: dict, layer: dict) -> str:
    lines = [f"tp=1 overhead, {over['label']} (forward, backward, AdamW step):", "",
             "| model | step, ms | forward, ms | backward, ms | optimizer, ms | step / plain |",
             "|---|---:|---:|---:|---:|---:|"]
    runs = over["runs"]
    for n, rs in runs.items():
        ratio = [a["step"] / p["step"] for a, p in zip(rs, runs["plain"])]
        lines.append(f"| {n} | {spread([r['step'] for r in rs], _ms)} | "
                     f"{spread([r['fwd'] for r in rs], _ms)} | {spread([r['bwd'] for r in rs], _ms)} | "
                     f"{spread([r['opt'] for r in rs], _ms)} | {spread(ratio, lambda v: f'{v:.3f}')} |")
    lines += ["", f"Per-rank compute of one layer, {layer['label']} (forward and backward, "
              "collectives skipped):", "",
              "| layer | parameters | forward, ms | backward, ms | forward + backward, ms "
              "| unsharded / this |", "|---|---:|---:|---:|---:|---:|"]
    runs = layer["runs"]
    base = next(iter(runs))
    for n, rs in runs.items():
        ratio = [b["step"] / r["step"] for r, b in zip(rs, runs[base])]
        lines.append(f"| {n} | {layer['params'][n] / 1e6:,.1f}M | {spread([r['fwd'] for r in rs], _ms)} "
                     f"| {spread([r['bwd'] for r in rs], _ms)} | {spread([r['step'] for r in rs], _ms)} "
                     f"| {spread(ratio, lambda v: f'{v:.2f}')} |")
    lines += ["", f"Ideal: the tp={layer['tp']} shard at 1/{layer['tp']} of the unsharded layer "
              f"(`unsharded / this` = {layer['tp']}); small GEMMs and the replicated LayerNorms and "
              "residual adds keep it above that."]
    return "\n".join(lines)


def _section(body: str, measured: str | None) -> str:
    return "\n".join([
        HEADING, "",
        "Reproduce on a machine with one CUDA GPU, from the repository root (writes this "
        "section; `--quick` prints only; `--device cpu --quick` runs the same code on CPU at "
        "tiny sizes, as a check that it works):", "",
        "```sh", COMMAND, "```", "",
        *( [measured, ""] if measured else []),
        "1. **tp=1 overhead**: `gpt-small` (124M, bf16 by default, `--dtype float32` for fp32), "
        "batch 8, sequence 1024: the plain model against `shardplan.parallelize` on a one-rank "
        "group (the rewritten graph, with its f/g modules and vocab-parallel loss, on one GPU), "
        "training steps interleaved, CUDA-synchronized; target: no measurable overhead.",
        "2. **the 8.3B layer's tp=8 shard**: one `Block` of `gpt-8.3b` (h 3072, 32 heads), "
        "batch 8, sequence 1024, forward and backward, unsharded against rank 0's tp=8 shard "
        "made by `shardplan.parallelize` with a group whose collectives do nothing (compute "
        "only; on 8 GPUs the 2 forward and 2 backward all-reduces of b·s·h per layer add NCCL "
        "time). Ideal ratio 8.", "",
        body, ""])


def main(argv=None) -> int:
    ap = parser(__doc__, "5 steps after 2 warm-up")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a check at tiny sizes)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks.gpu: skipped, no CUDA device (torch "
              f"{torch.__version__}, cuda available: no). Run it on a GPU machine; "
              "`--device cpu --quick` checks the code here.", file=sys.stderr)
        if not (args.quick or args.no_write):
            write_doc(HEADING, _section("Not measured yet: no GPU run has been recorded.", None),
                      only_if_missing=True)
        return 0
    small = device.type != "cuda"
    if small and not args.quick:
        ap.error("--device cpu is a check at tiny sizes: add --quick")
    steps, warmup = (5, 2) if args.quick else (args.steps, args.warmup)
    dtype = getattr(torch, args.dtype)
    load_before = os.getloadavg()
    over = tp1_overhead(device, dtype, steps, warmup, small)
    layer = layer_shard(device, dtype, steps, warmup, small)
    load_after = os.getloadavg()
    body = report(over, layer)
    print(body)
    if args.quick or args.no_write:
        return 0
    gpu = torch.cuda.get_device_name(device)
    measured = (measured_line(load_before, load_after) + f" GPU: {gpu}, CUDA {torch.version.cuda}, "
                f"{args.dtype}; {steps} timed steps after {warmup} warm-up, median (min–max).")
    write_doc(HEADING, _section(body, measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
