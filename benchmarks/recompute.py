"""Activation recomputation (``parallelize(..., recompute=True)``): the activation
memory each rank keeps for backward, and the forward+backward time, with and
without, for the bundled GPT and Llama (GQA) at tp 1 and 2.

    python -m benchmarks.recompute            # from the repo root; writes docs/benchmarks.md
    python -m benchmarks.recompute --quick    # smaller models, fewer rounds; prints only

Ranks: tp=2 is two gloo processes (``shardplan.ranks.RealRanks(2)``, one torch
thread each), tp=1 this process; every rank builds both contenders
(``recompute=False``, "stored", and ``True``) of each model from the same
weights and batch.

Memory: one forward under ``torch.autograd.graph.saved_tensors_hooks`` whose
pack hook records the untyped storage of every tensor autograd saves for
backward, each storage once (a view and its base share memory), leaving out
parameters and buffers (model state). Tensors saved inside a recomputed block
go to torch's checkpoint hook instead and are dropped, so the count is what
stays alive until backward. Each case is built at two depths: the difference
is the bytes per block, the rest lies outside the blocks (embedding, final
norm, LM head, loss). Theory: a recomputed block keeps only its input, s·b·h
elements (Korthikanti et al. 2022); a stored GPT block, ``gpt_block_theory``.
Process RSS is not the measure: the allocator keeps and reuses freed memory
(the time loop records RSS growth over each forward to show it).

Time: forward and backward, no optimizer step. Each round runs one step of
every contender, in an order rotated every round, tp=2 first (each step after
a barrier; the slower rank's time, the CPU time of both), then tp=1 with one
thread while the workers idle. Ratios are per round.
"""

from __future__ import annotations

import copy
import os
import resource
import sys
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

from ._common import med, parser, section_head, spread, write_doc

HEADING = "## Activation recomputation"
COMMAND = "python -m benchmarks.recompute"
TPS = (1, 2)
MODES = (False, True)  # recompute
MODE_NAME = {False: "stored", True: "recomputed"}


def settings(quick: bool) -> dict:
    if quick:
        return dict(h=128, heads=8, kv_heads=2, vocab=512, batch=4, seq=64, depths=(1, 2))
    return dict(h=256, heads=8, kv_heads=2, vocab=2048, batch=8, seq=128, depths=(4, 8))


def cases(st: dict, n_layer: int) -> list[tuple[str, str, dict]]:
    h = st["h"]
    gpt = dict(n_embd=h, n_head=st["heads"], n_layer=n_layer, vocab_size=st["vocab"],
               block_size=st["seq"], dropout=0.0)
    llama = dict(dim=h, n_layers=n_layer, n_heads=st["heads"], n_kv_heads=st["kv_heads"],
                 ffn_hidden=(8 * h // 3 + 15) // 16 * 16, vocab_size=st["vocab"],
                 max_seq_len=st["seq"])
    return [("GPT, fused QKV", "gpt-tiny", gpt),
            (f"Llama, GQA ({st['heads']} heads, {st['kv_heads']} KV heads)", "llama-tiny", llama)]


def _model_and_batch(preset: str, cfg: dict, st: dict):
    from shardplan.models import build
    torch.manual_seed(0)
    model = build(preset, **cfg)
    g = torch.Generator().manual_seed(1)
    return model, tuple(torch.randint(0, st["vocab"], (st["batch"], st["seq"]), generator=g)
                        for _ in range(2))


def _parallelize(ctx, model, batch, recompute: bool):
    import shardplan
    return shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=batch,
                                 gather_output=False, recompute=recompute)


# ----------------------------------------------------------------------------- measure

_STATE: dict = {}  # per process (this one for tp=1, each worker for tp=2): timed contenders


def _kept(sharded, batch) -> tuple[int, list, dict]:
    """One forward and backward: the storages autograd kept for backward after the
    forward, each once, parameters and buffers left out (bytes, [(bytes, shape,
    dtype)]), and the gradients."""
    gm = sharded.graph_module
    state = {t.untyped_storage().data_ptr() for t in (*gm.parameters(), *gm.buffers())}
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in state:
            kept.setdefault(s.data_ptr(), (s.nbytes(), tuple(t.shape), str(t.dtype)[6:]))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = sharded(*batch)
    loss.backward()
    grads = {n: p.grad for n, p in sharded.named_parameters()}
    sharded.zero_grad(set_to_none=True)
    return sum(v[0] for v in kept.values()), list(kept.values()), grads


def _setup(ctx, st: dict) -> dict:
    """On every rank: stored and recomputed contenders of each case at both depths;
    the memory each keeps; the shallower ones stay for timing.
    ``{(label, depth): {"bytes": {mode: n}, "tensors": {mode: [...]}, "grad_diff"}}``."""
    warnings.filterwarnings("ignore")
    _STATE.clear()
    out = {}
    for depth in st["depths"]:
        for label, preset, cfg in cases(st, depth):
            model, batch = _model_and_batch(preset, cfg, st)
            r = out[label, depth] = {"bytes": {}, "tensors": {}}
            grads = {}
            for rc in MODES:
                sharded = _parallelize(ctx, model, batch, rc)
                r["bytes"][rc], r["tensors"][rc], grads[rc] = _kept(sharded, batch)
                if depth == st["depths"][0]:
                    _STATE[label, rc] = sharded
                    _STATE["batch"] = batch
            r["grad_diff"] = max((grads[False][n] - grads[True][n]).abs().max().item()
                                 for n in grads[False])
    return out


def gpt_block_theory(st: dict, tp: int) -> int:
    """Bytes one GPT block saves without recomputation, fp32, dropout 0, CPU SDPA.

    Replicated: the two LayerNorm inputs and outputs (the outputs are the QKV and
    first MLP GEMM inputs), 4·s·b·h, and each LayerNorm's mean and 1/std, 4·s·b.
    Split over tp: q, k, v, 3·s·b·h; the attention output (also the output
    projection's input), s·b·h; the attention's log-sum-exp, a·s·b (the fused
    kernel keeps it instead of the s×s probabilities); the GELU input and output
    (the second MLP GEMM's input), 8·s·b·h. Korthikanti et al.'s
    sbh(10 + 24/t) + 5as²b/t bytes at 16 bits, less the dropout masks, with the
    s² terms replaced by the fused kernel's.
    """
    sb, h, a = st["seq"] * st["batch"], st["h"], st["heads"]
    return 4 * (4 * sb * h + 12 * sb * h // tp + 4 * sb + a * sb // tp)


def memory(per_tp: dict, st: dict) -> dict:
    """``{(label, tp): {"depth": {L: {mode: bytes}}, "per_block", "outside", ...}}`` from
    each tp's ranks (the largest rank)."""
    out = {}
    for tp, ranks in per_tp.items():
        for (label, depth), r0 in ranks[0].items():
            got = {rc: max(r[label, depth]["bytes"][rc] for r in ranks) for rc in MODES}
            differ = max(max(r[label, depth]["bytes"][rc] for r in ranks)
                         - min(r[label, depth]["bytes"][rc] for r in ranks) for rc in MODES)
            m = out.setdefault((label, tp), {"depth": {}, "grad_diff": 0.0, "ranks_differ": 0})
            m["depth"][depth] = got
            m["ranks_differ"] = max(m["ranks_differ"], differ)
            m["grad_diff"] = max(m["grad_diff"], *(r[label, depth]["grad_diff"] for r in ranks))
            m["tensors"] = r0["tensors"]  # rank 0's, of the deeper model (the later depth)
    for m in out.values():
        (l1, m1), (l2, m2) = sorted(m["depth"].items())
        m["per_block"] = {rc: (m2[rc] - m1[rc]) / (l2 - l1) for rc in MODES}
        m["outside"] = {rc: m1[rc] - l1 * m["per_block"][rc] for rc in MODES}
    return dict(sorted(out.items()))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _step(module, batch) -> dict:
    rss0 = _rss()
    c0, t0 = time.process_time(), time.perf_counter()
    _, loss = module(*batch)
    t1 = time.perf_counter()
    rss1 = _rss()
    t1b = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    cpu = time.process_time() - c0
    module.zero_grad(set_to_none=True)
    return {"step": (t1 - t0) + (t2 - t1b), "bwd": t2 - t1b, "cpu": cpu, "rss": rss1 - rss0,
            "loss": loss.item()}


def _round(ctx, order) -> dict:
    import torch.distributed as dist
    out = {}
    for key in order:
        dist.barrier()
        out[key] = _step(_STATE[key], _STATE["batch"])
    return out


def measure(st: dict, steps: int, warmup: int) -> tuple[dict, dict]:
    """(memory by (label, tp), time: ``{(label, tp): {mode: [per-step dict]}}``)."""
    from shardplan.ranks import RealRanks, SimulatedRanks
    labels = [label for label, _, _ in cases(st, 1)]
    keys = [(label, rc) for label in labels for rc in MODES]
    runs = {(label, tp): {rc: [] for rc in MODES} for label in labels for tp in TPS}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker; idle OpenMP threads would spin on a busy machine
    try:
        with RealRanks(2, timeout=600) as ranks, ThreadPoolExecutor(1) as pool:
            t0 = time.perf_counter()
            workers = pool.submit(ranks.run, _setup, st)  # tp=2 while this process does tp=1
            per_tp = {1: SimulatedRanks(1, timeout=600).run(_setup, st), 2: workers.result()}
            print(f"  built and measured in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
            for i in range(warmup + steps):
                order = keys[i % len(keys):] + keys[:i % len(keys)]
                per_rank = ranks.run(_round, order)
                done = {(label, 2, rc): dict(max(per_rank, key=lambda r: r[label, rc]["step"])
                                             [label, rc],
                                             cpu=sum(r[label, rc]["cpu"] for r in per_rank))
                        for label, rc in order}
                for label, rc in order:
                    done[label, 1, rc] = _step(_STATE[label, rc], _STATE["batch"])
                if i >= warmup:
                    for (label, tp, rc), r in done.items():
                        runs[label, tp][rc].append(r)
                what = f"warm-up {i + 1}" if i < warmup else f"step {i + 1 - warmup}"
                print(f"  time {what}: " + ", ".join(
                    f"{label.split(',')[0]} tp={tp} {MODE_NAME[rc]} {r['step'] * 1e3:.0f}"
                    for (label, tp, rc), r in sorted(done.items())) + " ms",
                    file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(threads)
    return memory(per_tp, st), runs


# ----------------------------------------------------------------------------- report

def _mb(n: float) -> str:
    return f"{n / 1e6:,.3f}"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.0f}"


def memory_tables(mem: dict, st: dict) -> str:
    l1, l2 = st["depths"]
    sbh4 = st["seq"] * st["batch"] * st["h"] * 4
    lines = ["| model | tp | layers | stored, MB | recomputed, MB | stored / recomputed "
             "| recomputed vs L·s·b·h·4 + outside |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for (label, tp), r in mem.items():
        for n_layer in (l1, l2):
            m = r["depth"][n_layer]
            want = n_layer * sbh4 + r["outside"][True]
            lines.append(f"| {label} | {tp} | {n_layer} | {_mb(m[False])} | {_mb(m[True])} "
                         f"| {m[False] / m[True]:.2f} | {100 * (m[True] - want) / want:+.2f}% |")
    lines += ["", "| model | tp | per block stored, MB | theory | per block recomputed, MB "
              "| theory s·b·h·4 | outside the blocks, MB: stored | recomputed "
              "| max abs gradient difference |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (label, tp), r in mem.items():
        pb, out = r["per_block"], r["outside"]
        theory = _mb(gpt_block_theory(st, tp)) if label.startswith("GPT") else "-"
        lines.append(f"| {label} | {tp} | {_mb(pb[False])} | {theory} | {_mb(pb[True])} "
                     f"| {_mb(sbh4)} | {_mb(out[False])} | {_mb(out[True])} "
                     f"| {r['grad_diff']:.1e} |")
    return "\n".join(lines)


def memory_findings(mem: dict, st: dict) -> list[str]:
    sbh4 = st["seq"] * st["batch"] * st["h"] * 4
    out = []
    for (label, tp), r in mem.items():
        pb, deepest = r["per_block"], max(r["depth"])
        if pb[True] != sbh4:
            census = Counter(f"{n:,} B {dtype}{list(shape)}"
                             for n, shape, dtype in r["tensors"][True])
            out.append(f"{label}, tp={tp}: a recomputed block keeps {pb[True]:,.0f} B, not "
                       f"{sbh4:,} (s·b·h·4); kept at {deepest} layers: "
                       + ", ".join(f"{k} x{c}" for k, c in census.items()))
        if label.startswith("GPT") and pb[False] != gpt_block_theory(st, tp):
            out.append(f"{label}, tp={tp}: a stored block keeps {pb[False]:,.0f} B, theory "
                       f"{gpt_block_theory(st, tp):,}")
        if r["outside"][False] != r["outside"][True]:
            out.append(f"{label}, tp={tp}: outside the blocks differs with recomputation "
                       f"({r['outside'][False]:,.0f} vs {r['outside'][True]:,.0f} B)")
        if r["ranks_differ"]:
            out.append(f"{label}, tp={tp}: ranks differ by up to {r['ranks_differ']:,} B "
                       "(the largest is reported)")
    return out


def time_table(runs: dict) -> str:
    lines = ["| model | tp | forward+backward, ms: stored | recomputed | recomputed / stored "
             "| backward, ms: stored | recomputed | CPU, ms: stored | recomputed "
             "| CPU recomputed / stored | RSS growth over forward, MB: stored | recomputed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f2 = lambda x: f"{x:.2f}"  # noqa: E731
    for (label, tp), rs in runs.items():
        s, r = rs[False], rs[True]
        cells = [f"{label} | {tp}"]
        for key in ("step", "bwd", "cpu"):
            cells += [spread([x[key] for x in s], _ms), spread([x[key] for x in r], _ms)]
            if key != "bwd":
                cells.append(spread([b[key] / a[key] for a, b in zip(s, r)], f2))
        cells += [spread([x["rss"] / 1e6 for x in m], lambda v: f"{v:.1f}") for m in (s, r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def loss_problems(runs: dict) -> list[str]:
    return [f"{label} tp={tp}" for (label, tp), rs in runs.items()
            if any(a["loss"] != b["loss"] for a, b in zip(rs[False], rs[True]))]


def main(argv=None) -> int:
    ap = parser(__doc__, "h 128, sequence 64, batch 4, 1 and 2 layers, 3 rounds")
    ap.add_argument("--steps", type=int, help="timed rounds (default 8; --quick 3)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    st = settings(args.quick)
    steps, warmup = args.steps or (3 if args.quick else 8), 1 if args.quick else 2

    load_before = os.getloadavg()
    mem, runs = measure(st, steps, warmup)
    load_after = os.getloadavg()

    l1, l2 = st["depths"]
    layers = f"{l1} layer{'s' * (l1 > 1)}"
    sizes = (f"h {st['h']}, {st['heads']} heads, sequence s = {st['seq']}, batch b = "
             f"{st['batch']}, vocabulary {st['vocab']}, float32, dropout 0")
    findings = memory_findings(mem, st)
    ratios = {k: med([b["step"] / a["step"] for a, b in zip(rs[False], rs[True])])
              for k, rs in runs.items()}
    cpu_ratios = {k: med([b["cpu"] / a["cpu"] for a, b in zip(rs[False], rs[True])])
                  for k, rs in runs.items()}
    kept = {k: r["depth"][l1][False] / r["depth"][l1][True] for k, r in mem.items()}
    summary = (f"At {layers}, recomputation keeps {min(kept.values()):.1f}-"
               f"{max(kept.values()):.1f}x less activation memory per rank, and a forward+backward "
               f"takes {min(ratios.values()):.2f}-{max(ratios.values()):.2f}x the time "
               f"(medians per case; CPU time {min(cpu_ratios.values()):.2f}-"
               f"{max(cpu_ratios.values()):.2f}x).")
    if not findings:
        summary += (" Every block's measured bytes equal the theory to the byte where there is one "
                    "(recomputed: s·b·h·4 in both models; stored: the GPT derivation), and the "
                    "part outside the blocks is the same with and without recomputation.")
    text = "\n".join([
        f"Activation memory per rank ({sizes}; {l1} and {l2} layers):", "",
        memory_tables(mem, st), "",
        f"Forward+backward time ({layers}, {warmup} warm-up and {steps} timed rounds):", "",
        time_table(runs), "",
        summary, *(f"- Unexpected: {f}." for f in findings)])
    print(text)
    problems = loss_problems(runs)
    if problems:
        print(f"PROBLEM: recomputation changed the loss: {', '.join(problems)}", file=sys.stderr)
    if args.quick or args.no_write:
        return 1 if problems else 0
    cmd = COMMAND + (f" --steps {steps}" if args.steps else "")
    section = "\n".join([
        *section_head(HEADING, cmd, load_before, load_after),
        "`shardplan.parallelize(model, gather_output=False, recompute=True)` recomputes each "
        "Transformer block in backward (torch's non-reentrant checkpoint per block, both random "
        "streams restored); `stored` is the same model with `recompute=False`. Models: the "
        "bundled GPT (`gpt-tiny` preset resized, fused QKV, tied embedding) and Llama "
        "(`llama-tiny` resized: grouped-query attention, RoPE, SwiGLU). tp=2 runs on two gloo "
        "processes (`shardplan.ranks.RealRanks(2)`, one torch thread each), tp=1 in the parent "
        "process; every rank builds both contenders of each model from the same weights and "
        "batch.", "",
        "**Activation memory**: one forward under `torch.autograd.graph.saved_tensors_hooks`, "
        "whose pack hook records the untyped storage of every tensor autograd saves for "
        "backward, each storage once (a view and its base share memory), leaving out "
        "parameters and buffers (model state). Tensors saved inside a recomputed block go to "
        "the checkpoint's own hook and are dropped, so the count is what stays alive until "
        "backward. The largest rank is reported; MB = 10^6 bytes. Each case is built with "
        f"{l1} and {l2} layers: the difference gives the bytes per block, the rest lies outside "
        "the blocks (token ids, embedding mask and positions, final norm, LM head input, the "
        "loss's logits, targets and masks). Theory for recomputation (Korthikanti et al. 2022, "
        "\"Reducing Activation Recomputation in Large Transformer Models\"): a block keeps only "
        "its input, s·b·h elements, so the total is L·s·b·h·4 bytes plus the part outside the "
        "blocks (the first table's last column uses the measured one).", "",
        "Theory for a stored GPT block, t = tp, a = heads, in float32 elements: "
        "(4 + 12/t)·s·b·h + (4 + a/t)·s·b. Replicated on every rank: both LayerNorm inputs and "
        "outputs (the outputs feed the QKV and first MLP GEMMs), 4·s·b·h, and each LayerNorm's "
        "mean and 1/std, 4·s·b. Split over t: q, k and v, 3·s·b·h; the attention output (also "
        "the output projection's input), s·b·h; the GELU input and output (the second MLP "
        "GEMM's input), 8·s·b·h; the attention's log-sum-exp, a·s·b (torch's CPU "
        "scaled-dot-product attention is the fused kernel: it keeps these statistics, not the "
        "s×s probabilities). That is the paper's sbh(10 + 24/t) + 5as²b/t bytes at 16 bits "
        "without the dropout masks and with the s² terms replaced by the fused kernel's. The "
        "Llama block (RMSNorm written out in elementwise ops, RoPE, repeated K/V heads, SwiGLU) "
        "is measured only.", "",
        "Process RSS is not the measure: the CPU allocator keeps freed memory and reuses it, so "
        "the resident size hardly moves with the activations (the time table's last two "
        "columns: its growth over each forward, median (min–max)).", "",
        "**Time**: forward and backward, no optimizer step. Each round runs one step of every "
        "contender, in an order rotated each round: tp=2 first (each step after a barrier; a "
        "step's time is the slower rank's, its CPU time (user + system) the sum over both "
        "ranks), then tp=1 in the parent with one thread while the workers idle. Cells: median "
        "(min–max) over the timed rounds; ratios are per round. On a machine loaded beyond its "
        "cores, wall times include waits for a core (see the min–max); CPU time is the steadier "
        "measure of the work. Recomputation adds one forward "
        "of the blocks to the backward (not of the embedding, LM head and loss): about "
        "1.2-1.4x is expected. The losses of the two contenders are checked equal at every "
        "step, and their gradients after the memory measurement (second table's last column).",
        "",
        text, ""])
    write_doc(HEADING, section)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
