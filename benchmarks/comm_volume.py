"""Communication per training step at tp=2: shardplan against DTensor, a
hand-written Megatron and the Megatron optimum computed by hand.

    python -m benchmarks.comm_volume            # from the repo root; writes docs/benchmarks.md
    python -m benchmarks.comm_volume --quick    # smaller models, prints only

Two gloo processes (``shardplan.ranks.RealRanks(2)``). Every contender runs
one forward and one backward of the same model and batch; one observer counts
what each sends: a ``torch.distributed.tensor.debug.CommDebugMode`` extended to
record each collective's logical size (``benchmarks._common.comm_counter``),
entered once around the forward and once around the backward. It sees DTensor's
functional collectives and plain ``torch.distributed`` calls alike. shardplan's
own ``CommLedger`` is read as well and must agree with the observer.

The Megatron optimum (a vocab-parallel embedding, LM head and loss):
forward 2L+1 all-reduces of b·s·h (two per layer, one after the embedding)
and 3 of b·s (the loss: max, target logit, sum of exponentials); backward
2L+1 of b·s·h (f before each attention and MLP, and before the LM head).
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from collections import Counter

import torch

from ._common import comm_counter, parser, section_head, tally, write_doc
from .megatron_manual import megatron_optimum

HEADING = "## Communication per training step, tp=2"
COMMAND = "python -m benchmarks.comm_volume"
TP = 2


def cases(quick: bool) -> list[tuple[str, str, dict]]:
    h, L, vocab, heads = (64, 2, 256, 4) if quick else (256, 4, 2048, 8)
    seq = 16 if quick else 128
    gpt = dict(n_embd=h, n_head=heads, n_layer=L, vocab_size=vocab, block_size=seq, dropout=0.0)
    llama = dict(dim=h, n_layers=L, n_heads=heads, n_kv_heads=heads // 2,
                 ffn_hidden=(8 * h // 3 + 15) // 16 * 16, vocab_size=vocab, max_seq_len=seq)
    return [("GPT, fused QKV", "gpt-tiny", dict(gpt, fused_qkv=True)),
            ("GPT, separate QKV", "gpt-tiny", dict(gpt, fused_qkv=False)),
            (f"Llama, GQA ({heads} heads, {heads // 2} KV heads)", "llama-tiny", llama)]


def batch_shape(quick: bool) -> tuple[int, int]:
    return (2, 16) if quick else (8, 128)


def _contenders(preset: str, cfg: dict) -> list[str]:
    out = ["shardplan", "shardplan, gather_output=True (default)"]
    if preset == "gpt-tiny":
        out.append("manual")
    if preset == "llama-tiny" or not cfg["fused_qkv"]:
        out.append("DTensor, hand-written")
    if preset == "gpt-tiny":
        out.append("DTensor, hand-written, model unchanged")
    out.append("DTensor, exported")
    return out


def _one(ctx, preset: str, cfg: dict, b: int, s: int) -> dict:
    """On each worker: one forward + backward per contender, counted."""
    import contextlib

    import shardplan
    from shardplan.errors import LayoutError
    from shardplan.models import build
    from shardplan.runtime.ledger import CommLedger
    from torch.distributed.device_mesh import init_device_mesh

    from . import dtensor_plan as D
    from .megatron_manual import ManualGPT

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = build(preset, **cfg)
    g = torch.Generator().manual_seed(1)
    vocab = cfg["vocab_size"]
    idx, tgt = (torch.randint(0, vocab, (b, s), generator=g) for _ in range(2))
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    out = {}
    for name in _contenders(preset, cfg):
        m = copy.deepcopy(model)
        context = contextlib.nullcontext
        try:
            if name.startswith("shardplan"):
                m = shardplan.parallelize(m, group=ctx.group, example_inputs=(idx, tgt),
                                          gather_output="default" in name)
            elif name == "manual":
                m = ManualGPT(m)
            elif name == "DTensor, hand-written":
                m, context = D.hand_written(m, mesh), D.loss_context
            elif name == "DTensor, hand-written, model unchanged":
                m, context = D.global_activations(m, mesh), D.global_context
            else:
                m, context = D.exported(m, mesh, (idx, tgt)), D.exported_context
        except LayoutError as e:
            out[name] = {"error": str(e).splitlines()[1].strip()}
            continue
        ledger = CommLedger()
        with context(), ledger:
            with comm_counter() as fwd:
                _, loss = m(idx, tgt)
            with comm_counter() as bwd:
                loss.backward()
        out[name] = {"forward": fwd.records, "backward": bwd.records,
                     "loss": float(D.full(loss.detach())),
                     "ledger": {d: [(r.kind, r.elements, r.bytes) for r in ledger.records
                                    if r.direction == d] for d in ("forward", "backward")}}
    out["unsharded loss"] = float(model(idx, tgt)[1].detach())
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f}"


def _versus(records: dict, optimum: dict) -> str:
    """``= optimum`` or what differs, per direction."""
    diffs = []
    for d in ("forward", "backward"):
        got = Counter((k, n) for k, n, _ in records[d])
        want = Counter(optimum[d])
        if got == want:
            continue
        extra, missing = got - want, want - got
        byte = sum(r[2] for r in records[d]) - sum(n * 4 for _, n in optimum[d])
        what = ", ".join(f"+{c} {k} of {n:,}" for (k, n), c in sorted(extra.items()))
        if missing:
            what += (", " if what else "") + ", ".join(
                f"-{c} {k} of {n:,}" for (k, n), c in sorted(missing.items()))
        diffs.append(f"{d}: {what} ({'+' if byte >= 0 else ''}{_mb(byte)} MB)")
    return "= optimum" if not diffs else "; ".join(diffs)


def table(results: list) -> str:
    lines = ["| model | contender | forward: count | forward: MB | backward: count | backward: MB "
             "| total MB | against the optimum |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for label, dims, optimum, rows in results:
        n_f, n_b = len(optimum["forward"]), len(optimum["backward"])
        bf, bb = (sum(n * 4 for _, n in optimum[d]) for d in ("forward", "backward"))
        lines.append(f"| {label} | Megatron optimum ({dims}) | {n_f} | {_mb(bf)} | {n_b} | {_mb(bb)} "
                     f"| {_mb(bf + bb)} | by hand |")
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"| {label} | {name} | - | - | - | - | - | cannot be expressed: {r['error']} |")
                continue
            (cf, bf_, _), (cb, bb_, _) = tally(r["forward"]), tally(r["backward"])
            lines.append(f"| {label} | {name} | {cf} | {_mb(bf_)} | {cb} | {_mb(bb_)} "
                         f"| {_mb(bf_ + bb_)} | {_versus(r, optimum)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = parser(__doc__, "small models and batch")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from shardplan.ranks import RealRanks

    b, s = batch_shape(args.quick)
    load_before = os.getloadavg()
    results = []
    with RealRanks(TP, timeout=600) as ranks:
        for label, preset, cfg in cases(args.quick):
            per_rank = ranks.run(_one, preset, cfg, b, s)
            r0 = per_rank[0]
            unsharded = r0.pop("unsharded loss")
            for other in per_rank[1:]:
                other.pop("unsharded loss")
                for name, r in other.items():  # every rank sends the same
                    if "error" not in r and (tally(r["forward"])[2], tally(r["backward"])[2]) != \
                            (tally(r0[name]["forward"])[2], tally(r0[name]["backward"])[2]):
                        print(f"warning: {label} / {name}: ranks differ", file=sys.stderr)
            L = cfg.get("n_layer", cfg.get("n_layers"))
            h = cfg.get("n_embd", cfg.get("dim"))
            optimum = megatron_optimum(L, b, s, h)
            for r in r0.values():
                r["_ref"] = unsharded
            results.append((label, f"L={L}, b={b}, s={s}, h={h}", optimum, r0))
    load_after = os.getloadavg()
    problems = []
    for label, _, _, rows in results:
        for name, r in rows.items():
            if "error" in r:
                continue
            ref = r.pop("_ref")
            if abs(r["loss"] - ref) > 1e-4 * max(1.0, abs(ref)):
                problems.append(f"{label} / {name}: loss {r['loss']:.6f} != unsharded {ref:.6f}")
            if name.startswith("shardplan"):
                for d in ("forward", "backward"):
                    seen = sorted((k, n) for k, n, _ in r[d])
                    led = sorted((k, n) for k, n, _ in r["ledger"][d])
                    if seen != led:
                        problems.append(f"{label} / {name} {d}: CommLedger {led} != observed {seen}")
    text = table(results)
    print(text)
    for p in problems:
        print("PROBLEM:", p, file=sys.stderr)
    if args.quick or args.no_write:
        return 1 if problems else 0
    section = "\n".join([
        *section_head(HEADING, COMMAND, load_before, load_after),
        "One forward and one backward of each contender at tp=2 (two gloo processes), float32, "
        "bytes as each rank sees them (the logical size: the reduced tensor of an all-reduce, the "
        "gathered tensor of an all-gather), MB = 10^6 bytes. Counted by one observer for every "
        "contender: `torch.distributed.tensor.debug.CommDebugMode`, extended to record each "
        "collective's size (`benchmarks/_common.py`), around the forward and around the "
        "backward; it sees DTensor's functional collectives and plain `torch.distributed` calls "
        "alike. shardplan's `CommLedger` "
        + ("agrees with it on every shardplan row. " if not any("CommLedger" in p for p in problems)
           else "DISAGREES with it (see below). ")
        + "Every contender's loss equals the unsharded model's"
        + (" (checked)." if not any("loss" in p for p in problems) else " EXCEPT where listed below."),
        "",
        "- Megatron optimum: forward 2L+1 all-reduces of b·s·h (two per layer, one after the "
        "vocab-parallel embedding) and 3 of b·s (the vocab-parallel loss); backward 2L+1 of b·s·h "
        "(f before each attention and MLP, and before the LM head).",
        "- `shardplan`: `parallelize(model, gather_output=False)` (training); `gather_output=True` "
        "(the default) also all-gathers the logits, which the model returns.",
        "- `manual`: `benchmarks/megatron_manual.py`, Megatron by hand (GPT only).",
        "- `DTensor, hand-written`: `benchmarks/dtensor_plan.py` (ColwiseParallel/RowwiseParallel, "
        "PrepareModuleInput for the shared q/k/v (and Llama's w1/w3) input, `loss_parallel`; "
        "local heads). Not expressible for a fused QKV: a 1-D shard of the fused weight gives a "
        "rank all of q and half of k.",
        "- `DTensor, hand-written, model unchanged`: the same styles with q/k/v (or the fused "
        "c_attn) left as DTensors with global shapes through the attention code, which decides "
        "the communication (SDPA's math kernel, implicit replication).",
        "- `DTensor, exported`: shardplan's plan through `shardplan.export.parallelize_with_dtensor` "
        "(no PrepareModuleInput, loss on gathered logits).", "",
        text, ""]
        + ([f"Problems: {'; '.join(problems)}", ""] if problems else [])
        + ["Target: shardplan exactly the Megatron optimum, and fewer bytes than DTensor where "
           "DTensor sends more.", ""])
    write_doc(HEADING, section)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
