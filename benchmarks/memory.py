"""Memory per rank: parameters, gradients and AdamW state of ``shardplan.parallelize``
at tp 1, 2, 4 and 8, measured from the tensors after one optimizer step, against theory.

    python -m benchmarks.memory              # from the repo root; writes docs/benchmarks.md
    python -m benchmarks.memory --quick      # smaller models, tp 2 and 4; prints only

Ranks are simulated (``shardplan.ranks.SimulatedRanks(tp)``: threads, each
with its own deep copy of the model). On every rank: parallelize, one forward,
backward and ``AdamW.step()``, then the bytes of the distinct storages behind
the module's parameters, their gradients and the optimizer's state tensors
(a storage counts whole, so a shard that were a view of the full tensor would
show). Theory is Megatron's split, written out per parameter name here, not
taken from shardplan's plan: the GEMM weights (and column biases) of every
block and the (padded) vocabulary split tp ways, K/V projections split
``min(tp, kv_heads)`` ways (fewer K/V heads than tp: each is held by a group of
ranks), everything else replicated; gradients the same; AdamW two moments per
parameter plus a 4-byte step per parameter tensor.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import warnings

import torch

from ._common import parser, section_head, write_doc

HEADING = "## Memory per rank"
COMMAND = "python -m benchmarks.memory"
TPS = (1, 2, 4, 8)


def cases(quick: bool) -> list[tuple[str, str, dict]]:
    h, L, vocab = (64, 2, 256) if quick else (256, 4, 2048)
    gpt = dict(n_embd=h, n_head=8, n_layer=L, vocab_size=vocab, block_size=32, fused_qkv=True,
               tie_weights=True)
    llama = dict(dim=h, n_layers=L, n_heads=8, n_kv_heads=2, ffn_hidden=(8 * h // 3 + 15) // 16 * 16,
                 vocab_size=vocab, max_seq_len=32)
    out = [("GPT, fused QKV, tied", "gpt-tiny", gpt),
           (META_LABEL, "gpt-tiny", gpt),
           ("Llama, 8 heads, 2 KV heads", "llama-tiny", llama)]
    if not quick:
        out.append(("GPT, vocab 2047 (padded to 2048)", "gpt-tiny", dict(gpt, vocab_size=vocab - 1)))
    return out


META_LABEL = "GPT, fused QKV, tied; built on meta, then `load_full_state_dict`"


def _build(preset: str, cfg: dict):
    from shardplan.models import build
    torch.manual_seed(0)
    return build(preset, **cfg)


def theory(model, tp: int) -> dict:
    """Megatron's per-rank bytes: ``{"params", "grads", "optimizer"}``."""
    cfg = model.config
    kv = getattr(cfg, "n_kv_heads", None)
    seen, total, tensors = set(), 0, 0
    for name, p in model.named_parameters():  # tied weights: one parameter
        if id(p) in seen:
            continue
        seen.add(id(p))
        tensors += 1
        n, es = p.numel(), p.element_size()
        leaf = name.rsplit(".", 2)
        mod = leaf[-2] if len(leaf) > 1 else ""
        if mod in ("wte", "lm_head", "tok_embeddings", "output"):
            rows = -(-p.shape[0] // tp) * tp  # padded vocabulary
            total += rows * p.shape[1] // tp * es
        elif mod in ("wk", "wv"):
            total += n * es // min(tp, kv)
        elif (mod in ("c_attn", "c_fc", "wq", "w1", "w3")
              or (mod in ("c_proj", "wo", "w2") and name.endswith("weight"))):
            total += n * es // tp
        else:  # norms, position embedding, row-parallel biases
            total += n * es
    return {"params": total, "grads": total, "optimizer": 2 * total + 4 * tensors}


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.is_meta:
            continue
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def _rank(ctx, model, idx, tgt, on_meta: bool = False) -> dict:
    import shardplan
    if on_meta:  # the large-model path: nothing materialized before the shards are loaded
        from shardplan.checkpoint import load_full_state_dict
        from shardplan.models import build
        m = build("gpt-tiny", device="meta", **dataclasses.asdict(model.config))
        sharded = shardplan.parallelize(m, group=ctx.group, example_inputs=(idx, tgt),
                                        gather_output=False)
        # a copy per rank: the loaded replicated tensors may share the given tensors' memory
        load_full_state_dict(sharded, copy.deepcopy(model.state_dict()))
    else:
        m = copy.deepcopy(model)
        sharded = shardplan.parallelize(m, group=ctx.group, example_inputs=(idx, tgt),
                                        gather_output=False)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    _, loss = sharded(idx, tgt)
    loss.backward()
    opt.step()
    params = list(sharded.parameters())
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    source = list(m.parameters())
    names = {id(p): n for n, p in sharded.named_parameters()}
    oversized = {}  # tensors whose storage is larger than themselves: views of bigger buffers
    for p in params:
        for what, t in (("", p), (".grad", p.grad)):
            if t is not None and t.untyped_storage().nbytes() > t.numel() * t.element_size():
                oversized[names[id(p)] + what] = t.untyped_storage().nbytes() / (t.numel() * t.element_size())
    return {"oversized": oversized,
            "params": _storage_bytes(params),
            "grads": _storage_bytes(p.grad for p in params),
            "optimizer": _storage_bytes(state),
            # what the ShardedModule keeps alive besides its own parameters: its source model
            "source_extra": _storage_bytes(params + source) - _storage_bytes(params)}


def _err(got: int, want: int) -> str:
    return f"{100 * (got - want) / want:+.2f}%"


def _mb(n: int) -> str:
    return f"{n / 1e6:,.3f}"


def main(argv=None) -> int:
    ap = parser(__doc__, "small models, tp 2 and 4")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from shardplan.ranks import SimulatedRanks

    tps = (2, 4) if args.quick else TPS
    load_before = os.getloadavg()
    rows, worst, oversized = [], 0.0, {}
    for label, preset, cfg in cases(args.quick):
        model = _build(preset, cfg)
        vocab = cfg["vocab_size"]
        g = torch.Generator().manual_seed(1)
        idx, tgt = (torch.randint(0, vocab, (2, 16), generator=g) for _ in range(2))
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        for tp in (tps[-1],) if "padded" in label or label == META_LABEL else tps:
            per_rank = SimulatedRanks(tp, timeout=600).run(_rank, model, idx, tgt,
                                                           label == META_LABEL)
            want = theory(model, tp)
            got = {k: max(r[k] for r in per_rank) for k in per_rank[0] if k != "oversized"}
            for r in per_rank:
                for name, x in r["oversized"].items():
                    oversized.setdefault((label, tp), {})[name] = x
            spread_ = {k: max(r[k] for r in per_rank) - min(r[k] for r in per_rank)
                       for k in ("params", "grads", "optimizer")}
            errs = {k: (got[k] - want[k]) / want[k] for k in ("params", "grads", "optimizer")}
            worst = max(worst, *(abs(e) for e in errs.values()))
            rows.append((label, tp, full, got, want, spread_))
            print(f"{label} tp={tp}: " + ", ".join(f"{k} {_mb(got[k])} MB ({_err(got[k], want[k])})"
                                                  for k in ("params", "grads", "optimizer")),
                  file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    lines = ["| model | tp | params, MB | theory | error | grads, MB | theory | error "
             "| AdamW state, MB | theory | error | total, MB | source model also kept, MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, tp, full, got, want, sp in rows:
        cells = []
        for k in ("params", "grads", "optimizer"):
            note = "" if not sp[k] else f" (ranks differ by {sp[k]:,} B)"
            cells.append(f"{_mb(got[k])}{note} | {_mb(want[k])} | {_err(got[k], want[k])}")
        total = got["params"] + got["grads"] + got["optimizer"]
        lines.append(f"| {label} | {tp} | " + " | ".join(cells) + f" | {_mb(total)} "
                     f"| {_mb(got['source_extra'])} |")
    text = "\n".join(lines)
    verdict = (f"Largest error against theory: {100 * worst:.2f}% "
               f"(target: within 1%: {'met' if worst <= 0.01 else 'NOT met'}).")
    for (label, tp), names in oversized.items():
        listed = sorted(names)
        ratio = sorted(set(f"{x:.0f}x" for x in names.values()))
        verdict += (f" {label}, tp={tp}: {len(listed)} tensors are views into larger storages "
                    f"({', '.join(ratio)} their size), e.g. `{listed[0]}`"
                    + (f", `{listed[-1]}`" if len(listed) > 1 else "") + ".")
    print(text + "\n\n" + verdict)
    if args.quick or args.no_write:
        return 0
    section = "\n".join([
        *section_head(HEADING, COMMAND, load_before, load_after),
        "`shardplan.parallelize(model, gather_output=False)` on simulated ranks "
        "(`SimulatedRanks(tp)`, each rank a deep copy of the model), float32, one forward, "
        "backward and `AdamW.step()`; then the bytes of the distinct storages behind the "
        "sharded module's parameters, their `.grad`s and the optimizer's state tensors (a "
        "storage counts whole: a shard that kept its full tensor alive would show). The largest "
        "rank is reported (ranks that differ are marked). MB = 10^6 bytes.", "",
        "Theory is Megatron's split written out by parameter name (`benchmarks/memory.py`, not "
        "shardplan's plan): block GEMM weights, column-parallel biases and the vocabulary "
        "(padded to a multiple of tp) / tp; K/V projections / min(tp, KV heads) (fewer KV heads "
        "than tp: each head held by a group of ranks); norms, position embedding and "
        "row-parallel biases replicated. Gradients: the same. AdamW: two moments per "
        "parameter and a 4-byte `step` tensor per parameter tensor.", "",
        "`source model also kept`: the unsharded model the `ShardedModule` holds on to "
        "(`ShardedModule._source`, used to capture new call signatures) beyond the parameters it "
        "shares with it (the replicated ones), i.e. per-rank memory the shards do not account "
        "for while the sharded module lives. The row built on `meta` (parallelize, then "
        "`shardplan.checkpoint.load_full_state_dict`) shows the path that keeps none.", "",
        text, "",
        verdict + " Target: per-rank memory within 1% of theory.", ""])
    write_doc(HEADING, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
