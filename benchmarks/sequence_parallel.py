"""Sequence parallelism (``parallelize(..., sequence_parallel=True)``) against plain
tensor parallelism: activation memory per rank per block, communication bytes per
step, and training-step time at tp=2 on gloo.

    python -m benchmarks.sequence_parallel            # from the repo root; writes docs/benchmarks.md
    python -m benchmarks.sequence_parallel --quick    # one size, tp 1-4, fewer rounds; prints only

Memory: simulated ranks (``shardplan.ranks.SimulatedRanks(tp)``), one forward
under ``torch.autograd.graph.saved_tensors_hooks`` whose pack hook records every
storage autograd saves for backward, each once, parameters and buffers left out
(as ``benchmarks.recompute``); each model built with 1 and 2 layers, the
difference is the bytes per block. Theory: ``block_theory``.

Communication: ``shardplan.plan(model, tp, sequence_parallel=...)``'s collectives,
summed bytes per step (forward and backward), by purpose.

Time: two gloo processes (``RealRanks(2)``, one torch thread each), a step is
forward, backward, AdamW step and zero_grad; each round runs one step of each
contender (plain, SP, SP with every region in sequence order, DTensor's
hand-written sequence-parallel plan) in an order
rotated every round, each after a barrier; a step's time is the slower rank's;
ratios per round; each rank's CPU time per step (main thread, all threads);
shardplan's c10d calls timed per contender.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
import warnings
from collections import defaultdict

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import logging  # noqa: E402

logging.getLogger("torch._export").setLevel(logging.ERROR)

from ._common import med, parser, section_head, spread, write_doc  # noqa: E402

HEADING = "## Sequence parallelism"
COMMAND = "python -m benchmarks.sequence_parallel"
MODES = (False, True)  # sequence_parallel
NAME = {False: "plain", True: "SP"}


def sizes(quick: bool) -> list[dict]:
    """Two shapes: long sequence relative to hidden (the paper's 5as/h dominates its
    formula), and short sequence, wide hidden (it does not)."""
    long = dict(name="long sequence", h=64, heads=8, seq=1024, batch=1, vocab=256)
    wide = dict(name="wide hidden", h=512, heads=8, seq=64, batch=2, vocab=256)
    if quick:
        return [dict(long, seq=256)]
    return [long, wide]


def _model(sz: dict, n_layer: int, fused_qkv: bool = True):
    from shardplan.models import build
    torch.manual_seed(0)
    model = build("gpt-tiny", n_layer=n_layer, n_embd=sz["h"], n_head=sz["heads"],
                  vocab_size=sz["vocab"], block_size=sz["seq"], dropout=0.0, fused_qkv=fused_qkv)
    g = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, sz["vocab"], (sz["batch"], sz["seq"]), generator=g)
                  for _ in range(2))
    return model, batch


# ------------------------------------------------------------------------------ memory

def _saved(ctx, model, batch, sp: bool) -> int:
    import shardplan
    warnings.filterwarnings("ignore")
    sharded = shardplan.parallelize(copy.deepcopy(model), group=ctx.group, example_inputs=batch,
                                    gather_output=False, sequence_parallel=sp)
    state = {t.untyped_storage().data_ptr()
             for t in (*sharded.parameters(), *sharded.buffers())}
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in state:
            kept.setdefault(s.data_ptr(), s.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = sharded(*batch)
    loss.backward()
    return sum(kept.values())


def block_theory(sz: dict, tp: int, sp: bool) -> int:
    """Bytes one GPT block saves, fp32 (4 bytes an element), dropout 0, fused SDPA.

    Elements: LayerNorm inputs 2sbh and outputs (the QKV and fc GEMM inputs) 2sbh,
    replicated without SP, split with SP; q, k, v 3sbh, attention output (the
    projection's input) sbh, GELU input and output 8sbh, all split; LayerNorm mean
    and 1/std 4sb (split with SP); the attention's log-sum-exp a·s·b, split.
    """
    s, b, a, t = sz["seq"], sz["batch"], sz["heads"], tp
    sb, sbh = s * b, s * b * sz["h"]
    if sp:
        return 4 * (16 * sbh + 4 * sb + a * sb) // t
    return 4 * (4 * sbh + 12 * sbh // t + 4 * sb + a * sb // t)


def paper(sz: dict, tp: int, sp: bool) -> float:
    """Korthikanti et al. 2022, bytes per layer at 16 bits, with dropout."""
    s, b, h, a, t = sz["seq"], sz["batch"], sz["h"], sz["heads"], tp
    return s * b * h * ((34 / t if sp else 10 + 24 / t) + 5 * a * s / (h * t))


def memory(sz: dict, tps) -> dict:
    from shardplan.ranks import SimulatedRanks
    out = {}
    for tp in tps:
        for sp in MODES:
            got = {L: max(SimulatedRanks(tp, timeout=600).run(_saved, *_model(sz, L), sp))
                   for L in (1, 2)}
            out[tp, sp] = dict(per_block=got[2] - got[1], outside=2 * got[1] - got[2])
            print(f"  {sz['name']} tp={tp} {NAME[sp]}: {out[tp, sp]['per_block']:,} B per block",
                  file=sys.stderr, flush=True)
    return out


# ------------------------------------------------------------------------ communication

def comm(sz: dict, tps) -> dict:
    import shardplan
    model, batch = _model(sz, 2)
    out = {}
    for tp in tps:
        for sp in MODES:
            p = shardplan.plan(copy.deepcopy(model), tp, example_inputs=batch, sequence_parallel=sp)
            by, wire = defaultdict(int), defaultdict(float)
            for c in p.collectives:
                purpose = getattr(c.purpose, "value", c.purpose)
                if purpose == "gather_output":  # the logits gather; training passes gather_output=False
                    continue
                key = f"{purpose} {c.kind} {c.direction}"
                by[key] += c.bytes
                # a ring all-reduce sends 2(t-1)/t of the tensor, a reduce-scatter or all-gather (t-1)/t
                wire[key] += c.bytes * (tp - 1) / tp * (2 if c.kind == "all_reduce" else 1)
            head = p.param("lm_head.weight")
            # a replicated head run on the tokens: its weight's gradient is summed (ring
            # all-reduce), inside the block-less bucket; Megatron keeps the head vocab-parallel
            head_sum = (4 * math.prod(head.global_shape) * 2 * (tp - 1) / tp
                        if sp and head.layout == "R" else 0.0)
            # the position embedding's output (s x h) is summed in the block-less bucket too
            alone = any(k.startswith("seq_grad ") for k in wire)  # or in a sum of its own
            pos_sum = 4 * sz["seq"] * sz["h"] * 2 * (tp - 1) / tp if sp and not alone else 0.0
            out[tp, sp] = dict(total=sum(by.values()), wire=sum(wire.values()), head_sum=head_sum,
                               pos_sum=pos_sum,
                               n=sum(1 for c in p.collectives
                                     if getattr(c.purpose, "value", c.purpose) != "gather_output"),
                               by=dict(by), by_wire=dict(wire))
    return out


# --------------------------------------------------------------------------------- time

_STATE: dict = {}
CONTENDERS = ("plain", "SP", "SP in sequence order", "DTensor SP")


def _setup(ctx, sz: dict) -> None:
    import contextlib

    import shardplan
    from shardplan.planner.token_order import sequence_order
    from torch.distributed.device_mesh import init_device_mesh

    from . import dtensor_plan
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, batch = _model(sz, sz["layers"], fused_qkv=False)  # DTensor needs separate q/k/v
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    _STATE.clear()
    _STATE["batch"] = batch
    for name in CONTENDERS:
        m = copy.deepcopy(model)
        if name == "DTensor SP":
            m, context = dtensor_plan.sequence_parallel(m, mesh), dtensor_plan.loss_context
        else:
            order = sequence_order() if name == "SP in sequence order" else contextlib.nullcontext()
            with order:
                m = shardplan.parallelize(m, group=ctx.group, example_inputs=batch,
                                          gather_output=False, sequence_parallel=name != "plain")
            context = contextlib.nullcontext
        _STATE[name] = (m, torch.optim.AdamW(m.parameters(), lr=1e-3), context)
    _time_collectives()


def _time_collectives() -> None:
    """Time every collective shardplan's contenders run, by contender and c10d call: its
    launch and its wait (an overlapped call counts only the time the step waits for it)."""
    from shardplan.runtime import comm
    spent = _STATE["spent"] = defaultdict(lambda: [0.0, 0])
    checked = comm.TorchGroup._checked
    launched = {}  # id of an async call's Work -> its c10d call

    def timed(self, fn, *args, **kwargs):
        waited = launched.pop(id(getattr(fn, "__self__", None)), None)
        t0 = time.perf_counter()
        out = None
        try:
            out = checked(self, fn, *args, **kwargs)
            return out
        finally:
            name = waited or fn.__name__
            cell = spent[_STATE.get("running"), name]
            cell[0] += time.perf_counter() - t0
            if waited is None:
                cell[1] += 1
            if kwargs.get("async_op") and out is not None:
                launched[id(out)] = name
    comm.TorchGroup._checked = timed


def _spent(ctx, reset: bool = False) -> dict:
    """This rank's collective seconds and calls so far ((contender, call) -> [s, n])."""
    out = {k: list(v) for k, v in _STATE["spent"].items()}
    if reset:
        _STATE["spent"].clear()
    return out


def _round(ctx, order) -> dict:
    import torch.distributed as dist

    from .dtensor_plan import full
    out = {}
    for name in order:
        dist.barrier()
        m, opt, context = _STATE[name]
        _STATE["running"] = name
        t0, main0, all0 = time.perf_counter(), time.thread_time(), time.process_time()
        with context():
            _, loss = m(*_STATE["batch"])
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out[name] = (time.perf_counter() - t0, float(full(loss.detach())),
                     time.thread_time() - main0, time.process_time() - all0)
    return out


def timing(sz: dict, steps: int, warmup: int) -> dict:
    from shardplan.ranks import RealRanks
    runs = {name: [] for name in CONTENDERS}
    losses = {name: [] for name in CONTENDERS}
    cpu = {name: [] for name in CONTENDERS}  # per round: (main thread, all threads), rank mean
    with RealRanks(2, timeout=600) as ranks:
        ranks.run(_setup, sz)
        for i in range(warmup + steps):
            k = i % len(CONTENDERS)
            order = list(CONTENDERS[k:] + CONTENDERS[:k])  # rotated every round
            per_rank = ranks.run(_round, order)
            got = {name: max(r[name][0] for r in per_rank) for name in CONTENDERS}
            for name in CONTENDERS:
                losses[name] += [r[name][1] for r in per_rank]
            if i + 1 == warmup:
                ranks.run(_spent, True)
            if i >= warmup:
                for name in CONTENDERS:
                    runs[name].append(got[name])
                    cpu[name].append(tuple(sum(r[name][j] for r in per_rank) / len(per_rank)
                                           for j in (2, 3)))
            print(f"  time round {i + 1}: " + ", ".join(f"{name} {got[name] * 1e3:.0f} ms"
                                                          for name in CONTENDERS),
                  file=sys.stderr, flush=True)
        spent = ranks.run(_spent)
    runs["collectives"] = {k: [sum(r[k][0] for r in spent) / len(spent) / steps,
                               spent[0][k][1] / steps] for k in spent[0]}
    runs["cpu"] = {name: tuple(med([c[j] for c in cpu[name]]) for j in (0, 1))
                   for name in CONTENDERS}
    runs["loss_diff"] = {name: max(abs(a - b) for a, b in zip(losses[name], losses["plain"]))
                         for name in CONTENDERS[1:]}
    return runs


# ------------------------------------------------------------------------------- report

def _mb(n: float) -> str:
    return f"{n / 1e6:,.3f}"


def memory_table(results: list) -> str:
    lines = ["| size | tp | plain, MB per block | theory (ours) | paper (16-bit) "
             "| SP, MB per block | theory (ours) | paper (16-bit) | SP / plain "
             "| outside the blocks, MB: plain | SP |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for sz, mem in results:
        for tp in sorted({t for t, _ in mem}):
            p, s = mem[tp, False], mem[tp, True]
            lines.append(
                f"| {sz['name']} | {tp} | {_mb(p['per_block'])} | {_mb(block_theory(sz, tp, False))} "
                f"| {_mb(paper(sz, tp, False))} | {_mb(s['per_block'])} "
                f"| {_mb(block_theory(sz, tp, True))} | {_mb(paper(sz, tp, True))} "
                f"| {s['per_block'] / p['per_block']:.3f} | {_mb(p['outside'])} "
                f"| {_mb(s['outside'])} |")
    return "\n".join(lines)


def _split_extra(s: dict) -> dict:
    """SP's sent bytes beyond plain's pairs, by who else pays them: re-gathers and the
    norms' and row biases' gradient sums (Megatron pays both), and ours alone: the
    replicated head's weight-gradient sum and the gathers before it (``seq_unshard``), the
    position embedding's gradient sum (in the bucket, or a ``seq_grad`` of its own)."""
    w = s["by_wire"]
    pick = lambda *pre: sum(v for k, v in w.items() if k.startswith(pre))  # noqa: E731
    return dict(regather=pick("seq_regather"),
                megatron_sums=pick("seq_grad_bucket") - s["head_sum"] - s["pos_sum"],
                ours=s["head_sum"] + s["pos_sum"] + pick("seq_unshard") + pick("seq_grad "))


def _residual(s: dict, p: dict) -> float:
    """SP's sent bytes less plain's and less the three extra columns (0 when the table
    accounts for everything)."""
    return s["wire"] - p["wire"] - sum(_split_extra(s).values())


def comm_table(results: list) -> str:
    lines = ["| size | tp | logical MB: plain (collectives) | SP (collectives) | SP / plain "
             "| sent per rank (ring), MB: plain | SP | SP / plain "
             "| of SP's sent, Megatron pays too: backward re-gathers | norm and bias gradient "
             "sums | not in Megatron: head, position embedding |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for sz, cm in results:
        for tp in sorted({t for t, _ in cm}):
            p, s = cm[tp, False], cm[tp, True]
            x = _split_extra(s)
            lines.append(f"| {sz['name']} | {tp} | {_mb(p['total'])} ({p['n']}) "
                         f"| {_mb(s['total'])} ({s['n']}) | {s['total'] / p['total']:.3f} "
                         f"| {_mb(p['wire'])} | {_mb(s['wire'])} | {s['wire'] / p['wire']:.3f} "
                         f"| {_mb(x['regather'])} | {_mb(x['megatron_sums'])} "
                         f"| {_mb(x['ours'])} |")
    return "\n".join(lines)


def _x3(x: float) -> str:
    return f"{x:.3f}"


def collective_table(spent: dict) -> str:
    lines = ["| contender | c10d call | calls per step | ms per step |", "|---|---|---:|---:|"]
    for (name, call), (sec, n) in sorted(spent.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        lines.append(f"| {name} | `{call}` | {n:.0f} | {sec * 1e3:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = parser(__doc__, "the long-sequence size at s=256, tp 1-4, 1 warm-up and 3 timed rounds")
    ap.add_argument("--steps", type=int, help="timed rounds (default 10; --quick 3)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    tps = (1, 2, 4) if args.quick else (1, 2, 4, 8)
    steps, warmup = args.steps or (3 if args.quick else 10), 1 if args.quick else 2
    tsz = (dict(name="step", h=128, heads=8, seq=128, batch=4, vocab=512, layers=2) if args.quick
           else dict(name="step", h=256, heads=8, seq=128, batch=8, vocab=2048, layers=4))

    load_before = os.getloadavg()
    mem = [(sz, memory(sz, tps)) for sz in sizes(args.quick)]
    cm = [(sz, comm(sz, (2, 4, 8) if not args.quick else (2, 4))) for sz in sizes(args.quick)]
    runs = timing(tsz, steps, warmup)
    load_after = os.getloadavg()

    ratio = [b / a for a, b in zip(runs["plain"], runs["SP"])]
    vs_dtensor = [b / a for a, b in zip(runs["DTensor SP"], runs["SP"])]
    vs_order = [b / a for a, b in zip(runs["SP in sequence order"], runs["SP"])]
    mismatch = [f"{sz['name']} tp={tp} {NAME[sp]}: measured {m['per_block']:,} B, theory "
                f"{block_theory(sz, tp, sp):,}"
                for sz, mm in mem for (tp, sp), m in mm.items()
                if m["per_block"] != block_theory(sz, tp, sp)]
    szdesc = "; ".join(f"{sz['name']}: h {sz['h']}, {sz['heads']} heads, s {sz['seq']}, "
                       f"b {sz['batch']} (5as/h = {5 * sz['heads'] * sz['seq'] / sz['h']:.0f})"
                       for sz in sizes(args.quick))
    per_round = {"plain": ratio, "SP in sequence order": vs_order, "DTensor SP": vs_dtensor}
    ttab = "\n".join([
        "| contender | step, ms: median (min–max) | SP / this per round | CPU per step, ms: "
        "main thread | all threads |", "|---|---:|---:|---:|---:|",
        *(f"| {name} | {spread([x * 1e3 for x in runs[name]])} | "
          f"{spread(per_round[name], _x3) if name in per_round else ''} | "
          f"{runs['cpu'][name][0] * 1e3:.1f} | {runs['cpu'][name][1] * 1e3:.1f} |"
          for name in CONTENDERS)])
    verdict = "within" if med(ratio) <= 1.05 else "outside"
    verdict_dt = "within" if med(vs_dtensor) <= 0.75 else "outside"
    text = "\n".join([
        f"Activation memory per rank per block ({szdesc}; float32, dropout 0; the largest "
        "simulated rank; MB = 10^6 bytes):", "",
        memory_table(mem), "",
        ("Every measured block equals our theory to the byte." if not mismatch else
         "Measured blocks that differ from our theory:\n" + "\n".join(f"- {x}" for x in mismatch)),
        "", "Communication per training step (forward + backward), from `shardplan.plan`, "
        "2-layer models, MB = 10^6 bytes:", "",
        comm_table(cm), "",
        "Sent per rank, SP less those three columns equals plain to within "
        f"{max(abs(_residual(m[t, True], m[t, False])) for _, m in cm for t, _ in m):,.0f} "
        "bytes in every row: an all-reduce and its reduce-scatter + all-gather pair send the "
        "same. Megatron pays the re-gathers (one all-gather of s·b·h per gathered input, "
        "shared by the linears reading it: q, k, v share one) and the norms' and row biases' "
        "gradient sums (it all-reduces them in one bucket, as we do: `seq_grad_bucket`, one "
        "per step, one per block under recomputation or FSDP). Ours alone: at the wide-hidden size the embedding has fewer rows "
        "(vocabulary 256) than columns (h 512), so both plans keep the tied embedding and LM "
        "head replicated (plain too: the head cannot be vocab-parallel while its tied "
        "embedding is replicated); under SP that head runs on this rank's tokens, so its V·h "
        "weight gradient is summed over the ranks, and its logits are gathered for the loss "
        "(`seq_unshard`); at the long-sequence size the head is vocab-parallel as in plain and "
        "the only such term is the position embedding's s·h gradient sum, in the bucket's call "
        "(Megatron, with a "
        "learned position embedding, all-reduces the word embedding instead, adds the "
        "positions on the whole sequence and then splits it: an all-reduce where we "
        "reduce-scatter, and no gradient sum). The gradient sums are fixed per model, so they "
        "weigh less as b·s grows.", "",
        f"Training-step time at tp=2 on gloo (h {tsz['h']}, {tsz['heads']} heads, s {tsz['seq']}, "
        f"b {tsz['batch']}, {tsz['layers']} layers, vocabulary {tsz['vocab']}; {warmup} warm-up, "
        f"{steps} timed rounds):", "",
        ttab, "",
        f"SP / plain step time, median per round: {med(ratio):.3f}x ({verdict} the 1.05x goal); "
        f"SP / DTensor SP: {med(vs_dtensor):.3f}x ({verdict_dt} the 0.75x goal); SP / SP in "
        f"sequence order: {med(vs_order):.3f}x. Largest loss difference over the rounds against "
        "plain: " + ", ".join(f"{n} {d:.1e}" for n, d in runs["loss_diff"].items()) + ".", "",
        "Time inside shardplan's collectives per step (mean of the two ranks; the c10d call "
        "each runs; waiting for the slower rank included; a call overlapped with compute "
        "counts its launch and the wait for it, not the time it ran behind the GEMMs):", "",
        collective_table(runs["collectives"]), "",
        "Where SP's extra time goes. A torch.profiler run of both plans (same size, one rank, "
        "8 steps each; 2026-12-02, not part of this command) found their GEMMs, norms and "
        "copies taking about the same time (SP's norms and residual adds run on half the "
        "tokens; its reduce-scatters' sums and the attention input's copies add a few ms), and "
        "the difference in time spent inside collectives. Megatron's sequence parallelism "
        "replaces a region's all-reduce by an all-gather and a reduce-scatter whose results "
        "the next op reads at once: at 4 layers a step has 31 collectives that block (9 "
        "gathers and 9 reduce-scatters forward, 9 gradient gathers backward, the loss's 3 "
        "all-reduces and the gradient bucket) against plain's 21, plus 18 in the background "
        "(the backward re-gathers and input-gradient reduce-scatters). Each blocking call "
        "waits for the slower rank, and on this shared 2-core machine the ranks drift apart "
        "by a millisecond or two between calls; gloo's threads also work more per step (the "
        "CPU columns: more calls, and the re-gathers' bytes). Gathering in the background "
        "earlier (at the region's output-gradient gather) or keeping the gathered input "
        "instead of re-gathering it each measured within 1% of SP's step here.", ""])
    print(text)
    if args.quick or args.no_write:
        return 0
    cmd = COMMAND + (f" --steps {steps}" if args.steps else "")
    section = "\n".join([
        *section_head(HEADING, cmd, load_before, load_after),
        "`shardplan.parallelize(model, gather_output=False, sequence_parallel=True)` (SP) against "
        "the same model with `sequence_parallel=False` (plain), on the bundled GPT (`gpt-tiny` "
        "resized: fused QKV, LayerNorm, GELU MLP, tied embedding, torch's "
        "`scaled_dot_product_attention`).", "",
        "**Activation memory**: simulated ranks (`SimulatedRanks(tp)`), one forward under "
        "`torch.autograd.graph.saved_tensors_hooks`, counting each storage autograd saves for "
        "backward once, parameters and buffers left out; each model is built with 1 and 2 layers "
        "and the difference is one block's bytes (the rest, outside the blocks: embedding, final "
        "norm, LM head, loss). Outside the blocks SP shrinks the bytes where the plan keeps "
        "the head vocabulary-sharded on the sequence shard (long-sequence size), not where it "
        "keeps the head replicated on the gathered sequence (wide-hidden size, vocabulary 256: "
        "the outside part is the same as plain's).", "",
        "The paper (Korthikanti et al. 2022, \"Reducing Activation Recomputation in Large "
        "Transformer Models\") counts, per layer at 16 bits with dropout, "
        "sbh(10 + 24/t + 5as/(ht)) bytes without SP and sbh(34/t + 5as/(ht)) with it. Its 34 "
        "sbh are: the two LayerNorm inputs 4; the QKV GEMM input 2; q and k 4; v 2; the "
        "projection input 2; the fc GEMM input 2; the GELU input 8 and output 8; two dropout "
        "masks 1 + 1; and 5as²b for the attention scores: softmax output 2as²b, its dropout mask "
        "as²b and the dropout output 2as²b. Without SP, 10 of the 34 (LayerNorm inputs, both "
        "GEMM inputs, both masks) are replicated on every rank. What we run differs term by "
        "term: (1) float32, so every saved element is 4 bytes, not 2: 16 elements of s·b·h "
        "per block are 64·sbh bytes where the paper has 32; (2) dropout = 0, so no masks: the "
        "paper's 2·sbh of masks and the as²b score mask vanish; (3) torch's SDPA is the fused "
        "kernel: it saves q, k, v, its output and a log-sum-exp of a·s·b floats, never the s×s "
        "softmax or its dropout, so the whole 5as/(ht) term becomes 4·a·s·b/t bytes, linear in "
        "s; (4) the paper leaves out LayerNorm's mean and 1/std, 2·s·b floats per norm, which "
        "we count (4·4·sb bytes, split over t with SP). Our theory, in bytes: plain "
        "4·[(4 + 12/t)·sbh + (4 + a/t)·sb]; SP 4·[16·sbh + (4 + a)·sb]/t, everything split. "
        "The paper's column is shown for scale: at the long-sequence size its 5as/h term is "
        "most of its estimate, and the fused kernel removes it, so there we save far less than "
        "the paper predicts, in absolute and relative terms. With SP the column GEMMs save "
        "their input as this rank's sequence shard and re-gather it in backward, so nothing in "
        "an SP block is replicated: its bytes are the tp=1 block's divided by t.", "",
        "**Communication**: the plan's collectives (`shardplan.plan(model, tp, "
        "example_inputs=..., sequence_parallel=...)`), forward and backward, bytes each rank "
        "sees, without the plan's logits gather (`gather_output`, absent in training). Logical "
        "size: the reduced tensor of an all-reduce, the gathered tensor of an all-gather, the "
        "full input of a reduce-scatter, so one all-reduce of N counts N and its SP replacement, "
        "a reduce-scatter and an all-gather, 2N. Sent per rank: what a ring algorithm sends, "
        "2(t-1)/t·N for an all-reduce, (t-1)/t·N for a reduce-scatter or all-gather, so plain's "
        "all-reduces and SP's pairs send the same; SP adds the backward all-gathers that re-gather "
        "each column GEMM's saved input shard (`seq_regather`), and the all-reduces of the "
        "gradients of per-token replicated parameters (`seq_grad`: norm weights and biases, row "
        "biases, position embedding).", "",
        "**Time**: two gloo processes (`RealRanks(2)`, one torch thread each), four "
        "contenders built from the same weights and batch (the GPT with separate q, k, v, "
        "which DTensor's styles need) with an AdamW each: plain, SP, SP in sequence order "
        "(the same plan rewritten under `planner.token_order.sequence_order()`: every "
        "gather puts the tokens back in sequence order and every reduce-scatter cuts them "
        "out again, as before the gathered order), and DTensor's own "
        "sequence-parallel plan written by hand (`benchmarks/dtensor_plan.py`, "
        "`sequence_parallel`: torchtitan's recipe, `SequenceParallel` norms, "
        "`PrepareModuleInput` from `Shard(1)`, column / row layers with `Shard(1)` "
        "outputs, `loss_parallel`); a step is forward, backward, `optimizer.step()`, "
        "`zero_grad()`; each round runs one step of each, the order rotated every round, each "
        "after a barrier; a step's time is the slower rank's; ratios are per round, median "
        "(min–max). CPU per step: the CPU time of a rank's main thread "
        "(`time.thread_time`) and of all its threads (`time.process_time`: gloo's workers "
        "too) during the step, the mean of the two ranks, median over the rounds. shardplan's "
        "collectives are timed around each c10d call and, for one launched in the background "
        "(the overlapped backward of the column linears), around the wait for it.", "",
        text, ""])
    write_doc(HEADING, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
