"""Will it fit? ``shardplan.plan(..., batch=, seq=, dp=, fsdp=, recompute=)``'s per-rank
training memory for Llama-70B and 405B at the layouts people use (tp 8 x dp 8/16/64,
with and without FSDP, sequence parallelism and recomputation), bf16 + AdamW,
batch 1 x 4096 tokens per rank, against an 80 GB GPU.

    python -m benchmarks.memory_estimate            # writes docs/benchmarks.md
    python -m benchmarks.memory_estimate --quick    # Llama-70B only; prints only

Estimates only (planned on meta, no GPU): the activations come from the rank's
rewritten graph run on fake tensors (what autograd saves); dp and FSDP change only
the parameter, gradient and optimizer terms (``memory.state_bytes``). The paper
column is Korthikanti et al. 2022's per-layer activations, L·sbh(10 + 24/t),
L·sbh·34/t with SP, L·2sbh with recomputation (L·2sbh/t with SP), in bytes at 16 bits without the
5as²b/t attention term (the fused attention kernel does not keep s x s scores),
and without the embedding, LM head and loss (the estimate's "outside").
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

from ._common import parser, section_head, write_doc

HEADING = "## Training memory estimate (will it fit?)"
COMMAND = "python -m benchmarks.memory_estimate"
TP, BATCH, SEQ, GPU = 8, 1, 4096, 80 * 10**9
DPS = (8, 16, 64)
MODES = ((False, False), (True, False), (True, True))  # (sequence parallel, recompute)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f}"


def paper_activations(cfg, sp: bool, rc: bool) -> int:
    sbh = SEQ * BATCH * cfg.dim
    per_layer = (2 * sbh // TP if sp else 2 * sbh) if rc else (34 * sbh // TP if sp else 10 * sbh + 24 * sbh // TP)
    return cfg.n_layers * per_layer


def rows(preset: str) -> list[str]:
    import shardplan
    from shardplan.models import PRESETS, build
    from shardplan.planner.memory import state_bytes
    cfg = PRESETS[preset][1]
    model = build(preset, device="meta", max_seq_len=max(cfg.max_seq_len, SEQ))
    out = []
    for sp, rc in MODES:
        p = shardplan.plan(model, TP, batch=BATCH, seq=SEQ, sequence_parallel=sp, recompute=rc,
                           dtype=torch.bfloat16)
        act = p.memory.training
        print(f"  {preset} sp={sp} recompute={rc}: activations {_gib(act.activations)} GiB",
              file=sys.stderr, flush=True)
        for dp in DPS:
            for fsdp in (False, True):
                params, grads, state, transient = state_bytes(p, torch.bfloat16, dp=dp, fsdp=fsdp,
                                                              optimizer="adamw")
                peak = params + grads + state + transient + act.activations
                out.append(
                    f"| {preset} | {dp} | {'yes' if fsdp else 'no'} | {'yes' if sp else 'no'} "
                    f"| {'yes' if rc else 'no'} | {_gib(params)} | {_gib(grads)} | {_gib(state)} "
                    f"| {_gib(transient)} | {_gib(act.activations)} "
                    f"({_gib(act.activations_per_block)}/block) "
                    f"| {_gib(paper_activations(cfg, sp, rc))} | {_gib(peak)} "
                    f"| {'FITS' if peak <= GPU else 'DOES NOT FIT'} |")
    return out


def main(argv=None) -> int:
    args = parser(__doc__, "Llama-70B only").parse_args(argv)
    warnings.filterwarnings("ignore")
    load_before = os.getloadavg()
    lines = ["| model | dp | FSDP | SP | recompute | parameters, GiB | gradients | AdamW state "
             "| FSDP gathered block | activations (per block) | paper, blocks only | peak "
             "| 80 GB |", "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for preset in ("llama-70b",) if args.quick else ("llama-70b", "llama-405b"):
        lines += rows(preset)
    table = "\n".join(lines)
    print(table)
    if args.quick or args.no_write:
        return 0
    section = "\n".join([
        *section_head(HEADING, COMMAND, load_before, os.getloadavg()),
        f"Per-rank bytes of one training step at tp {TP}, bf16 parameters and activations, "
        f"AdamW (two fp32 moments and an fp32 master copy: 12 bytes per parameter), gradients "
        f"in bf16, batch {BATCH} x {SEQ} tokens per rank; GiB = 2^30 bytes; 80 GB = 8·10^10 "
        "bytes. FSDP shards parameters, gradients and optimizer state over dp and adds one "
        "block's gathered parameters and unsharded gradients; plain dp replicates them. "
        "Activations are what the rank's rewritten graph saves for backward (run on fake "
        "tensors), including the embedding, LM head and vocab-parallel loss outside the "
        "blocks; the paper column is Korthikanti et al. 2022's blocks-only formula at 16 bits "
        "without the s² attention term, derived for GPT blocks (4h MLP, LayerNorm): a Llama block saves more (a 3.5h SwiGLU MLP, RMSNorm written out in elementwise ops, RoPE). The peak is the sum (an upper bound). Estimates, not "
        "measurements: tests/test_memory_estimate.py checks every term within 5% of a real "
        "step of the bundled GPT at tp 2.", "", table, ""])
    write_doc(HEADING, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
