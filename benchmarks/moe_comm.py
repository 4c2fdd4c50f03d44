"""Communication of Hugging Face MoE models per training step at tp 2 and 4: shardplan's
plan against the same plan with g and f left beside the experts' GEMMs, and against
the Megatron optimum.

    python -m benchmarks.moe_comm             # from the repo root; writes docs/benchmarks.md
    python -m benchmarks.moe_comm --quick     # a smaller model, prints only

The models are built on ``meta`` (nothing is allocated) and only planned: a
plan's collectives are the list every rank executes (the ledger tests check
that). HF's experts run on each token k times (top-k), sorted by expert; the
peer is the plan whose rule set has no ``partial_through`` or ``partial_sums``
ops, so each MoE layer's g follows the down projection's grouped GEMM (b·s·k·h
elements) and its f precedes the up projection (b·s·k·h), instead of one g after
the sum over the k and one f before the token gather (b·s·h each). The Megatron optimum is
``megatron_manual.megatron_optimum`` (2 all-reduces of b·s·h per layer each way,
the embedding's, the LM head's and the loss's); shardplan adds the routing
weights' f (b·s·k, their gradient is a partial sum) and, where K/V heads are
fewer than tp, the K/V weights' gradient sums.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

import torch

from ._common import parser, section_head, write_doc
from .megatron_manual import megatron_optimum

HEADING = "## MoE experts: communication per training step"
COMMAND = "python -m benchmarks.moe_comm"
TPS = (2, 4)


def build(family: str, quick: bool):
    import transformers as tf
    h, layers, inter = (64, 2, 128) if quick else (1024, 4, 2816)
    common = dict(hidden_size=h, num_hidden_layers=layers, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=4096, max_position_embeddings=256,
                  num_experts_per_tok=2, use_cache=False)
    if family == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=inter, num_local_experts=8, **common)
    else:
        cfg = tf.Qwen2MoeConfig(moe_intermediate_size=inter, shared_expert_intermediate_size=inter,
                                intermediate_size=inter, num_experts=8, decoder_sparse_step=1,
                                mlp_only_layers=[], **common)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(cfg), cfg


def rules_without_moves(tmp: Path) -> Path:
    """The bundled rules with ``partial_through`` and ``partial_sums`` emptied: g and f
    stay at the GEMMs."""
    from shardplan.planner.rules import _bundled_dir
    text = (_bundled_dir() / "megatron.toml").read_text()
    text, n = re.subn(r"(?m)^partial_through = \{.*\}$", "partial_through = {}", text)
    text, m = re.subn(r"(?m)^partial_sums = \[.*\]$", "partial_sums = []", text)
    assert n == m == 1, "the rule file's partial_through / partial_sums lines moved"
    path = tmp / "no_moves.toml"
    path.write_text(text)
    return path


def step_bytes(plan) -> tuple[int, int]:
    """(collectives, bytes) of one forward and backward, without verify's logits gather."""
    cs = [c for c in plan.collectives if c.purpose != "gather_output"]
    return len(cs), sum(c.bytes for c in cs)


def main(argv=None) -> None:
    args = parser(__doc__, "a 64-wide model").parse_args(argv)
    import shardplan
    b, s = (2, 16) if args.quick else (4, 256)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        peer_rules = rules_without_moves(Path(tmp))
        for family in ("mixtral", "qwen2_moe"):
            model, cfg = build(family, args.quick)
            ids = torch.zeros(b, s, dtype=torch.long, device="meta")
            for tp in TPS:
                ours = shardplan.plan(model, tp, example_inputs={"input_ids": ids, "labels": ids})
                peer = shardplan.plan(model, tp, example_inputs={"input_ids": ids, "labels": ids},
                                      rules=str(peer_rules))
                opt = megatron_optimum(cfg.num_hidden_layers, b, s, cfg.hidden_size)
                size = torch.empty((), dtype=cfg.dtype or torch.float32).element_size()
                opt_n = sum(len(v) for v in opt.values())
                opt_b = sum(e for v in opt.values() for _, e in v) * size
                (n1, b1), (n2, b2) = step_bytes(ours), step_bytes(peer)
                rows.append((family, tp, n1, b1, n2, b2, opt_n, opt_b))
                print(f"{family} tp={tp}: shardplan {n1} collectives {b1 / 2**20:.1f} MiB; "
                      f"g/f beside the GEMMs {n2} {b2 / 2**20:.1f} MiB; Megatron {opt_n} "
                      f"{opt_b / 2**20:.1f} MiB", flush=True)
    load_after = os.getloadavg()
    mib = lambda x: f"{x / 2**20:.1f}"  # noqa: E731
    lines = section_head(HEADING, COMMAND, load_before, load_after) + [
        f"HF Mixtral and Qwen2-MoE, hidden {1024 if not args.quick else 64}, "
        f"{'4' if not args.quick else '2'} layers, 8 experts with top-2, 8 heads, vocab 4096, "
        f"batch {b} x sequence {s}, fp32, built on meta and planned (the plan's collectives "
        "are what every rank runs; the logits' gather for `gather_output` left out).", "",
        "| model | tp | shardplan: collectives, MiB | g and f beside the experts' GEMMs: "
        "collectives, MiB | Megatron optimum: collectives, MiB | bytes / optimum: shardplan, "
        "beside the GEMMs |",
        "|---|---:|---:|---:|---:|---:|"]
    for family, tp, n1, b1, n2, b2, on, ob in rows:
        lines.append(f"| {family} | {tp} | {n1}, {mib(b1)} | {n2}, {mib(b2)} | {on}, {mib(ob)} | "
                     f"{b1 / ob:.2f}, {b2 / ob:.2f} |")
    lines += ["", "Above the optimum: the routing weights' f (b·s·k per MoE layer) and, for "
              "Qwen2-MoE, the shared expert's gate's f (b·s): the gradients of replicated "
              "tensors multiplying a partial sum. With the g and f beside the grouped GEMMs, "
              "each MoE layer moves k = 2 times the bytes (and Qwen2-MoE's shared expert has "
              "a g of its own).", ""]
    section = "\n".join(lines)
    print(section)
    if not (args.quick or args.no_write):
        write_doc(HEADING, section)


if __name__ == "__main__":
    sys.exit(main())
