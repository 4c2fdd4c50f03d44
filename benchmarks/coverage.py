"""Coverage survey: every text model family transformers ships, planned and verified.

    python -m benchmarks.coverage             # the representative families; writes docs/coverage.md
    python -m benchmarks.coverage --all       # every causal-LM, masked-LM and seq2seq family
    python -m benchmarks.coverage --quick     # a handful of families; prints only
    python -m benchmarks.coverage --families gpt2,t5 --no-write
    python -m benchmarks.coverage --libraries  # only the other libraries' models (their section)

Each section ends by printing its five slowest ``plan`` calls (family, tp, seconds).

Each family is built from its own default config shrunk to a tiny size (hidden
64, 2 layers, 4 heads, 2 KV heads or 1 where the family is multi-query, vocab
256, 4 experts with top-2) with random weights and a fixed seed, in a fresh
child process with a time limit, so a hang or a crash cannot stop the survey.
The child times ``shardplan.plan`` and runs ``shardplan.verify`` at tp 2 and 4
on simulated ranks, and exports the tp 2 plan as an HF ``tp_plan`` and as DTensor
styles (``benchmarks.export_check``); the parent runs every export in its runtime
on one pool of 2 real gloo ranks, classifies each run and writes the table.

Models of other pip-installable libraries (``benchmarks.library_models``: the
``[libs]`` extra) are surveyed the same way, without the export (it is HF's), as
rows of their own in a section of their own: the default run writes both sections,
``--libraries`` rewrites that section alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import library_models
from ._common import ROOT, machine, parser

DOC = ROOT / "docs" / "coverage.md"
LIBRARY_HEADING = "## Other libraries"
COMMAND = "python -m benchmarks.coverage"
TPS = (2, 4)
VOCAB = 256
BATCH, SEQ = 2, 8
TIMEOUT_S = 360  # plan and verify at tp 2 and 4, and the tp 2 exports

#: the survey's default: the families the issue names, then a spread of the rest
REPRESENTATIVE = [
    "gpt2", "gptj", "gpt_neox", "opt", "bloom", "falcon", "llama", "mistral", "mixtral", "qwen2",
    "qwen2_moe", "gemma", "gemma2", "phi", "phi3", "stablelm", "cohere", "glm", "helium", "olmo",
    "olmo2", "bert", "roberta", "t5", "bart", "gpt_bigcode", "codegen", "persimmon", "mpt",
    "qwen3", "deepseek_v3", "dbrx", "gemma3_text", "deberta-v2", "mamba", "xglm", "gpt_neo",
    "qwen3_moe", "olmoe", "starcoder2", "gpt_oss", "deepseek_v2", "nemotron", "electra", "mbart",
]
QUICK = ["gpt2", "llama", "bert", "t5"]

OUTCOMES = ("equal+sharded", "equal+replicated", "refused", "crash", "mismatch", "not built")

# attribute name -> tiny value, set wherever the family's default config has the attribute
SHRINK = {
    **dict.fromkeys(["hidden_size", "n_embd", "d_model", "dim", "n_embed", "embed_dim",
                     "word_embed_proj_dim", "embedding_size"], 64),
    **dict.fromkeys(["num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers",
                     "encoder_layers", "decoder_layers"], 2),
    **dict.fromkeys(["num_attention_heads", "n_head", "num_heads", "n_heads",
                     "encoder_attention_heads", "decoder_attention_heads"], 4),
    **dict.fromkeys(["intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim",
                     "decoder_ffn_dim", "ffn_hidden_size", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "ffn_config_hidden"], 128),
    **dict.fromkeys(["max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"], 128),
    **dict.fromkeys(["head_dim", "d_kv", "kv_channels", "attention_head_size"], 16),
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"], 4),
    **dict.fromkeys(["num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_top_k"], 2),
    "vocab_size": VOCAB, "rotary_dim": 8, "q_lora_rank": 32, "kv_lora_rank": 32,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1,
    "n_group": 1, "topk_group": 1, "sliding_window": 64, "use_cache": False,
}
# sizes a family's default config leaves None although its modeling code reads them
# (DeepSeek-V2's top-k and expert groups): given the tiny value all the same
REQUIRED = {"num_experts_per_tok", "n_group", "topk_group"}
KV_HEADS = ["num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
            "kv_n_heads"]
NON_TEXT = re.compile(r"vision|audio|speech|image|visual|vq|text_config|encoder_config")
TOKEN_IDS = ["pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
             "sep_token_id", "cls_token_id", "mask_token_id"]
CROSS_ATTENTION = re.compile(r"cross|encoder_attn|EncDecAttention", re.I)
LAYER = re.compile(r"^(.*?\.)(\d+)\.")


# ----------------------------------------------------------------- enumerating families

def families() -> dict[str, tuple[str, str]]:
    """model type -> (task, model class name): seq2seq first (BART's causal LM is its decoder
    alone, with cross-attention weights it never uses), then causal LM, then masked LM."""
    from transformers.models.auto import modeling_auto as ma
    found: dict[str, tuple[str, str]] = {}
    for task, mapping in [("seq2seq", ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
                          ("causal", ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                          ("masked", ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES)]:
        for model_type, cls in mapping.items():
            found.setdefault(model_type, (task, cls if isinstance(cls, str) else cls[0]))
    return found


# ----------------------------------------------------------------- the child: one family

def tiny_config(model_type: str):
    """The family's default config with every known size attribute shrunk."""
    from transformers import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    attrs = cls().to_dict()
    nested = [k for k, v in attrs.items() if k.endswith("_config") and isinstance(v, dict)]
    composite = [k for k in nested if NON_TEXT.search(k)]
    if composite:
        raise NotBuilt(f"composite config ({', '.join(composite)}): a wrapper around a text "
                       "model, or needs non-text inputs")
    overrides = shrunk(attrs)
    for k in nested:  # a text model's own sub-configs (MPT's attn_config, DBRX's ffn_config)
        overrides[k] = {**attrs[k], **shrunk(attrs[k])}
    return cls(**overrides)


def shrunk(attrs: dict) -> dict:
    """Tiny values for the size attributes present in ``attrs`` (a config's ``to_dict()``)."""
    overrides = {k: v for k, v in SHRINK.items()
                 if attrs.get(k) is not None or (k in attrs and k in REQUIRED)}
    if attrs.get("qk_rope_head_dim") is not None and "head_dim" in overrides:
        overrides["head_dim"] = SHRINK["qk_rope_head_dim"]  # MLA: head_dim is the rotary part
    for k in KV_HEADS:
        if k in attrs:  # None (Nemotron's default) is read as a count too
            if attrs.get("kv_lora_rank") is not None:  # MLA expands K/V to every head
                overrides[k] = SHRINK["num_attention_heads"]
            else:  # keep multi-query families multi-query
                overrides[k] = 1 if attrs[k] == 1 else 2
    for k, v in attrs.items():
        if k == "layer_types" and isinstance(v, list):
            overrides[k] = v[:2]
        elif k == "attention_types" and isinstance(v, list):  # GPT-Neo: [[kinds, repeats]]
            overrides[k] = [[v[0][0], 1]]
        elif k in TOKEN_IDS and isinstance(v, int) and v >= VOCAB:
            overrides[k] = TOKEN_IDS.index(k) % 3
    return overrides


class NotBuilt(Exception):
    """The family cannot be built tiny, or needs inputs this survey does not make."""


def build(model_type: str, class_name: str):
    import torch
    import transformers
    cfg = tiny_config(model_type)
    cfg._attn_implementation = "eager"
    if model_type == "dbrx":  # its default config does not run: the modeling reads a
        # rope_theta its attention config lacks, and clamps with clip_qkv=None
        cfg.attn_config.rope_theta = cfg.rope_parameters["rope_theta"]
        cfg.attn_config.clip_qkv = 8.0  # the released DBRX's value
        # its default of 1 K/V head is not the released model's grouped-query attention
        # (8 K/V heads of 48): 2 of 4, as for the other grouped-query families
        cfg.attn_config.kv_n_heads = 2
    cls = getattr(transformers, class_name, None)
    if cls is None:
        raise NotBuilt(f"transformers exports no {class_name}")
    torch.manual_seed(0)
    try:
        model = cls._from_config(cfg)
    except ImportError as e:
        raise NotBuilt(f"needs a package: {_head(e)}") from e
    return model.float().eval()


def example_inputs(task: str) -> dict:
    import torch
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    inputs = {"input_ids": ids, "labels": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)}
    if task == "seq2seq":
        inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    return inputs


def run_family(model_type: str, task: str, class_name: str, export_dir: str | None = None) -> dict:
    """Build, then plan and verify at each tp (and export at tp 2 into ``export_dir``);
    a JSON-able result."""
    t0 = time.perf_counter()
    try:
        model = build(model_type, class_name)
        model(**example_inputs(task))  # eager forward: a model that cannot run is not built
    except Exception as e:  # noqa: BLE001 - any failure to build tiny is recorded with its reason
        reason = str(e) if isinstance(e, NotBuilt) else f"{type(e).__name__}: {_head(e)}"
        return {"family": model_type, "class": class_name, "not_built": reason}
    build_s = time.perf_counter() - t0
    def export(plan):
        from . import export_check
        return export_check.prepare(model, plan, example_inputs(task), Path(export_dir), class_name)

    runs = {tp: run_tp(model, tp, example_inputs(task), export if export_dir and tp == 2 else None)
            for tp in TPS}
    return {"family": model_type, "class": class_name, "build_s": build_s,
            "layers": _layer_counts(model), "runs": runs}


def run_library(name: str) -> dict:
    """``run_family`` for a model of another library (``library_models.MODELS[name]``)."""
    import importlib
    case = library_models.MODELS[name]
    base = {"family": name, "layers": {"layers": library_models.LAYERS, "cross": 0},
            "megatron": case.megatron_collectives()}
    try:
        importlib.import_module(case.package)
    except ImportError as e:
        return {**base, "not_built": f"{case.package} is not installed (the [libs] extra): {_head(e)}"}
    t0 = time.perf_counter()
    try:
        model = case.build()
        model(*case.inputs())  # eager forward: a model that cannot run is not built
    except Exception as e:  # noqa: BLE001 - any failure to build tiny is recorded with its reason
        return {**base, "not_built": f"{type(e).__name__}: {_head(e)}"}
    build_s = time.perf_counter() - t0
    return {**base, "build_s": build_s, "runs": {tp: run_tp(model, tp, case.inputs()) for tp in TPS}}


def run_tp(model, tp: int, inputs, export=None) -> dict:
    """Plan and verify at ``tp``; ``export(plan)`` adds the export outcomes."""
    import shardplan
    t0 = time.perf_counter()
    try:
        plan = shardplan.plan(model, tp, example_inputs=inputs)
    except Exception as e:  # noqa: BLE001
        return _error("plan", e, isinstance(e, shardplan.ShardplanError))
    out = {"plan_s": time.perf_counter() - t0, **plan_facts(model, plan)}
    if export is not None:
        out["export"] = export(plan)
    try:
        report = shardplan.verify(model, tp, example_inputs=inputs)
    except Exception as e:  # noqa: BLE001
        return {**out, **_error("verify", e, False)}
    w = report.worst()
    return {**out, "ok": report.ok, "worst": f"{w.name}: abs {w.max_abs:.1e}",
            "divergent": report.first_divergent_node}


def _error(stage: str, e: Exception, refused: bool) -> dict:
    return {"error": f"{type(e).__name__}: {_head(e)}", "stage": stage, "refused": refused}


def _head(e: Exception, n: int = 160) -> str:
    text = " ".join(str(e).split())
    return text[:n] + ("..." if len(text) > n else "")


def plan_facts(model, plan) -> dict:
    """What the plan says: bytes per rank, collectives, replicated GEMMs and why."""
    replicated = replicated_gemms(model, plan)
    reasons = _unique(_fold(f"{d.module}: {d.rule}") for d in plan.decisions
                      if d.role == "replicated" and any(d.module and r.startswith(d.module + ".")
                                                        for r in replicated))
    counted = [c for c in plan.collectives if c.purpose != "gather_output"]
    return {"bytes_per_rank": plan.memory.param_bytes_per_rank,
            "bytes_unsharded": plan.memory.param_bytes_unsharded,
            "collectives": len(counted),
            "extra_kinds": sorted({f"{c.kind} {c.direction} {c.purpose}" for c in counted
                                   if c.purpose not in ("f", "g", "vocab_loss")}),
            "replicated": replicated, "reasons": reasons[:2],
            "warnings": _unique(_fold(w) for w in plan.warnings)[:2]}


def _fold(text: str) -> str:
    """Layer indices and graph node names taken out, so that layers share one line."""
    text = re.sub(r"\.\d+\.", ".*.", " ".join(text.split()))
    return re.sub(r" at \w+ \(", " (", text)[:200]


def _unique(items) -> list[str]:
    return list(dict.fromkeys(items))


def replicated_gemms(model, plan) -> list[str]:
    """Weights of layer GEMMs (attention, MLP, experts; not norms, embeddings, routers: 2-D
    with a dim of the expert count; not a GEMM narrower than tp) left whole on every rank."""
    import torch.nn as nn
    n_experts = next((getattr(c, k) for c in _hf_configs(model) for k in (
        "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
        if isinstance(getattr(c, k, None), int)), None)
    owners = {f"{m}.{p}" if m else p: mod for m, mod in model.named_modules()
              for p, _ in mod.named_parameters(recurse=False)}
    narrow = narrower_than_tp(plan)
    out = []
    for entry in plan.params:
        mod = owners.get(entry.name)
        if (entry.layout != "R" or len(entry.global_shape) < 2 or not LAYER.match(entry.name)
                or isinstance(mod, nn.Embedding) or "norm" in type(mod).__name__.lower()
                or (len(entry.global_shape) == 2 and n_experts in entry.global_shape)
                or entry.name.rpartition(".")[0] in narrow):
            continue
        out.append(entry.name)
    return out


def _hf_configs(model) -> list:
    """An HF model's config and its own sub-configs (DBRX's ffn_config); none for a model
    of another library."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    from transformers import PretrainedConfig
    if not isinstance(config, PretrainedConfig):
        return []
    return [config, *(v for v in vars(config).values() if isinstance(v, PretrainedConfig))]


#: the plan's reason for a GEMM whose output does not split into tp parts
#: (``planner.layout_pass._too_narrow``)
TOO_NARROW = re.compile(r"^output size (\d+) does not divide by tp=(\d+)")


def narrower_than_tp(plan) -> set[str]:
    """Modules the plan keeps whole because their GEMM's output is narrower than tp (a
    1-wide gate): by design, as routers, by the plan's own reason for the decision."""
    out = set()
    for d in plan.decisions:
        m = TOO_NARROW.match(d.rule) if d.role == "replicated" else None
        if m and int(m.group(1)) < int(m.group(2)):
            out.add(d.module)
    return out


def _layer_counts(model) -> dict[str, int]:
    """Layers per block list, and how many of them hold cross-attention."""
    stacks: dict[str, set] = {}
    cross: set[str] = set()
    for name, _ in model.named_modules():
        m = LAYER.match(name + ".")
        if m and not LAYER.match(m.group(1)):  # the outermost numbered list only
            stacks.setdefault(m.group(1), set()).add(m.group(2))
            if CROSS_ATTENTION.search(name):
                cross.add(m.group(0))
    layers = sum(len(v) for v in stacks.values())
    return {"layers": layers, "cross": len(cross)}


# ----------------------------------------------------------------- the parent: classify, write

def megatron_collectives(layers: dict, task: str) -> int:
    """Megatron's count for the survey's step: 2 forward + 2 backward all-reduces per layer,
    3 + 4 for a layer with cross-attention (its K/V f on the encoder output); one g per
    vocab-parallel embedding lookup (2 in an encoder-decoder), one f for the LM head, 3 for
    the vocab-parallel cross-entropy."""
    lookups = 2 if task == "seq2seq" else 1
    return 4 * layers["layers"] + 3 * layers["cross"] + lookups + 1 + 3


def classify(run: dict) -> tuple[str, str]:
    """(outcome, detail) of one tp run."""
    if "error" in run:
        if run["refused"]:
            return "refused", run["error"]
        return "crash", f"{run['stage']}: {run['error']}"
    if not run["ok"]:
        where = f" at {run['divergent']}" if run.get("divergent") else ""
        return "mismatch", run["worst"] + where
    if run["replicated"]:
        why = "; ".join(run["reasons"] or run["warnings"]) or "the plan names no reason"
        return "equal+replicated", f"{_names(run['replicated'])} replicated ({why})"
    return "equal+sharded", ""


def _names(params: list[str]) -> str:
    """Parameter names with layer indices folded: ``layers.*.mlp.fc1.weight``."""
    folded = sorted({re.sub(r"\.\d+\.", ".*.", p) for p in params})
    return ", ".join(folded[:4]) + (f" (+{len(folded) - 4})" if len(folded) > 4 else "")


def tp2(result: dict) -> dict:
    """The tp 2 run (keys are strings once a child's result went through JSON)."""
    runs = result.get("runs", {})
    return runs.get(2) or runs.get("2") or {}


def export_cells(result: dict) -> str:
    """The tp 2 export outcomes: ``HF / DTensor``."""
    run = tp2(result)
    if "export" not in run:
        return ""
    return " / ".join(f"{'HF' if t == 'hf' else 'DTensor'}: {run['export'][t]}" for t in ("hf", "dtensor"))


def export_kind(outcome: str) -> str:
    """``runs equal`` / ``refused`` / ``WRONG`` / ``crash`` / ``exported`` (not yet run)."""
    return outcome.split(":", 1)[0]


def row(family: str, task: str, result: dict) -> list[str]:
    """One table row per family."""
    if "not_built" in result:
        return [family, "not built", result["not_built"], "", "", "", ""]
    cells = {tp: classify(run) for tp, run in result["runs"].items()}
    outcomes = " / ".join(o for o, _ in cells.values())
    details = {d: [] for _, d in cells.values() if d}  # a detail shared by both tps once
    for tp, (_, d) in cells.items():
        if d:
            details[d].append(f"tp{tp}")
    details = " ".join(f"{' and '.join(tps)}: {d}" for d, tps in details.items())
    want = result["megatron"] if "megatron" in result else megatron_collectives(result["layers"], task)
    share, comm, times = [], [], []
    for tp, run in result["runs"].items():
        if "plan_s" not in run:
            continue
        share.append(f"{run['bytes_per_rank'] / run['bytes_unsharded']:.2f}")
        extra = f" (+{', '.join(run['extra_kinds'])})" if run["extra_kinds"] else ""
        comm.append(f"{run['collectives']}/{want}{extra}")
        times.append(f"{run['plan_s']:.1f}")
    return [family, outcomes, details, export_cells(result), " / ".join(share), " / ".join(comm),
            " / ".join(times)]


def outcome_of(result: dict) -> str:
    """The family's summary outcome: its worst over the tps."""
    if "not_built" in result:
        return "not built"
    seen = [classify(run)[0] for run in result["runs"].values()]
    return max(seen, key=lambda o: ("equal+sharded", "equal+replicated", "refused", "mismatch",
                                    "crash").index(o))


def survey(selected: list[str], export: bool = True):
    """Each family in its own child process (a timeout or a dead child is a crash); yields
    the results so far after each family. Then every export runs in its runtime on one
    pool of real gloo ranks, and the results are yielded once more."""
    known = families()
    out = []
    with tempfile.TemporaryDirectory(prefix="coverage-export-") as tmp:
        for family in selected:
            task, class_name = known[family]
            t0 = time.perf_counter()
            folder = str(Path(tmp) / family) if export else None
            result = run_child(family, task, class_name, folder)
            result["wall_s"] = time.perf_counter() - t0
            out.append((family, task, result))
            print(f"{family:24} {outcome_of(result):18} {result['wall_s']:5.0f} s", file=sys.stderr,
                  flush=True)
            yield out
        if export:
            run_exports(out, tmp)
            yield out


def run_exports(results, tmp: str) -> None:
    """Run every exported tp 2 plan in its runtime (one real gloo launch for all)."""
    from . import export_check
    prepared = {family: Path(tmp) / family for family, _, r in results
                if any(v == "exported" for v in tp2(r).get("export", {}).values())}
    t0 = time.perf_counter()
    for (family, target), outcome in export_check.run_all(prepared).items():
        result = next(r for f, _, r in results if f == family)
        tp2(result)["export"][target] = outcome
    print(f"{'exports run':24} {len(prepared)} families {time.perf_counter() - t0:5.0f} s", file=sys.stderr,
          flush=True)


def survey_libraries(selected: list[str]):
    """``survey`` for the other libraries' models (no export); yields the results so far."""
    out = []
    for name in selected:
        t0 = time.perf_counter()
        result = run_child(name, "library", "", flag="--library-child")
        result["wall_s"] = time.perf_counter() - t0
        out.append((name, "library", result))
        print(f"{name:36} {outcome_of(result):18} {result['wall_s']:5.0f} s", file=sys.stderr,
              flush=True)
        yield out


def run_child(family: str, task: str, class_name: str, export_dir: str | None = None, *,
              flag: str = "--child") -> dict:
    """One family (``--child``) or library model (``--library-child``) in a child process."""
    payload = [family, task, class_name, export_dir] if flag == "--child" else family
    cmd = [sys.executable, "-m", "benchmarks.coverage", flag, json.dumps(payload)]
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return _dead(f"no result within {TIMEOUT_S} s")
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        tail = " ".join(r.stderr.strip().splitlines()[-1:])[:160]
        return _dead(f"child exited {r.returncode}: {tail}")
    return json.loads(lines[-1])


def _dead(why: str) -> dict:
    return {"runs": {tp: {"error": why, "stage": "child", "refused": False} for tp in TPS},
            "layers": {"layers": 0, "cross": 0}}


def summary(results) -> str:
    counts = {o: 0 for o in OUTCOMES}
    for _, _, r in results:
        counts[outcome_of(r)] += 1
    text = ", ".join(f"{n} {o}" for o, n in counts.items())
    for target, name in (("hf", "HF tp_plan export"), ("dtensor", "DTensor export")):
        kinds = [export_kind(tp2(r)["export"][target]) for _, _, r in results if "export" in tp2(r)]
        if kinds:
            shown = ["runs equal", "refused", "WRONG", "crash"] + (["exported"] if "exported" in kinds else [])
            text += f"; {name}: " + ", ".join(f"{kinds.count(k)} {k}" for k in shown)
    return text


def slowest(results, n: int = 5) -> str:
    """The ``n`` longest ``plan`` calls over every family and tp, slowest first:
    ``qwen3_5_text tp2 21.0 s, ...``."""
    times = sorted(((run["plan_s"], family, tp) for family, _, result in results
                    for tp, run in result.get("runs", {}).items() if "plan_s" in run),
                   reverse=True)
    return ", ".join(f"{family} tp{tp} {s:.1f} s" for s, family, tp in times[:n])


def table(results) -> str:
    lines = ["| family | outcome tp2 / tp4 | detail | export tp2: HF tp_plan / DTensor "
             "| params per rank / unsharded, tp2 / tp4 | collectives / Megatron, tp2 / tp4 "
             "| plan s, tp2 / tp4 |",
             "|---|---|---|---|---:|---|---:|"]
    for family, task, result in results:
        cells = [c.replace("|", "\\|") for c in row(family, task, result)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def document(results, selection: str, load: tuple, wall_s: float) -> str:
    import transformers
    return "\n".join([
        "# Coverage survey", "",
        "Every text model family the pinned transformers ships, built tiny with random weights, "
        "planned and verified by `shardplan` at tp 2 and 4 on simulated ranks. Regenerate it on "
        "every change to the engine, from the repository root:", "",
        "```sh", COMMAND + ("  # --all: every family" if selection != "all" else " --all"), "```",
        "",
        f"Machine: {machine()}; transformers {transformers.__version__}. Measured {datetime.date.today().isoformat()}, 1-minute load "
        f"{load[0]:.2f} before, {load[1]:.2f} after; the survey took {wall_s / 60:.0f} min.", "",
        f"Families: {selection}.", "",
        f"**Summary ({len(results)} families, worst outcome over tp 2 and 4): "
        f"{summary(results)}.**", "",
        "How to read it:", "",
        "- Each family's default config with hidden 64, 2 layers (2 + 2 in an encoder-decoder), "
        "4 heads, 2 KV heads (1 where the family defaults to multi-query; DBRX, whose "
        "default of 1 is not the released model's, 2), head dim 16, "
        f"intermediate 128, vocab {VOCAB}, 4 experts with top-2, eager attention, `use_cache=False`;"
        f" inputs `input_ids` and `labels` ({BATCH}x{SEQ}; `decoder_input_ids` for seq2seq).",
        "- `equal+sharded`: `verify` equal (outputs, loss, every gradient) and every layer GEMM "
        "weight (attention, MLP, experts; not norms, embeddings or routers) split. "
        "A GEMM whose output is narrower than tp (Qwen2-MoE's 1-wide `shared_expert_gate`) is "
        "held whole by design, as routers are: the plan's decision says so (`output size 1 does "
        "not divide by tp=2`), and the survey reads that reason, not the module's name. "
        "`equal+replicated`: equal, but the listed weights stay whole on every rank (the reason "
        "is the plan's decision or warning). `refused`: `plan` raised a `ShardplanError`. "
        "`crash`: any other exception, or an error while verifying. `mismatch`: `verify` not "
        "equal (worst difference, first divergent node). `not built`: the tiny model could not "
        "be built or run unsharded.",
        "- export tp2: the tp 2 plan exported by `to_hf_tp_plan` and `to_dtensor_plan` and run in "
        "its runtime on 2 real gloo ranks (`benchmarks/export_check.py`): HF by `from_pretrained` "
        "with the plan (`DistributedConfig(tp_plan=..., tp_size=2)`) on a `save_pretrained` folder, "
        "DTensor by `parallelize_module` on the unpatched model; logits (HF: also under `no_grad`), "
        "loss and every gradient compared. `runs equal`: "
        "every rank equal to the unsharded model, with exactly the plan's parameters split; "
        "`refused`: the exporter's `LayoutError` (its first problem); `WRONG` or `crash`: an export bug.",
        "- params per rank / unsharded: `plan.memory` bytes (1/tp is the ideal; replicated "
        "norms and small layers lift it).",
        "- collectives / Megatron: the plan's collectives for one forward and backward (the "
        "logits' gather for `verify` left out) against Megatron's count for the same step: "
        "4 all-reduces per layer (2 forward, 2 backward; 7 for a layer with cross-attention), "
        "one per vocab-parallel embedding lookup, one for the LM head's f, 3 for the "
        "vocab-parallel cross-entropy. Kinds other than f, g and the loss's are named.", "",
        table(results), ""])


def library_table(results) -> str:
    """``table`` for the other libraries' models: no export column (the export check is HF's)."""
    lines = ["| model | outcome tp2 / tp4 | detail | params per rank / unsharded, tp2 / tp4 "
             "| collectives / Megatron, tp2 / tp4 | plan s, tp2 / tp4 |",
             "|---|---|---|---:|---|---:|"]
    for name, task, result in results:
        cells = row(name, task, result)
        del cells[3]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def library_versions() -> str:
    from importlib import metadata
    out = []
    for dist in sorted({m.package.replace("_", "-") for m in library_models.MODELS.values()}):
        try:
            out.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            out.append(f"{dist} not installed")
    return ", ".join(out)


def library_section(results, selection: str, load: tuple, wall_s: float) -> str:
    lm = library_models
    return "\n".join([
        LIBRARY_HEADING, "",
        "Models of pip-installable libraries other than transformers (the `[libs]` extra), built "
        "tiny with random weights by `benchmarks/library_models.py`, planned and verified as "
        "above, each in a child process. Regenerate this section alone (the rest of the file is "
        "kept):", "",
        "```sh", COMMAND + " --libraries", "```", "",
        f"Machine: {machine()}; {library_versions()}. Measured "
        f"{datetime.date.today().isoformat()}, 1-minute load {load[0]:.2f} before, "
        f"{load[1]:.2f} after; the section took {wall_s / 60:.0f} min.", "",
        f"Models: {selection}.", "",
        f"**Summary ({len(results)} models, worst outcome over tp 2 and 4): "
        f"{summary(results)}.**", "",
        "How to read it:", "",
        f"- hidden {lm.HIDDEN}, {lm.LAYERS} layers, {lm.HEADS} heads (x-transformers' "
        "`decoder-gqa` and curated-transformers' Llama 2 KV heads, its Falcon 1), vocab "
        f"{lm.VOCAB}; inputs {lm.BATCH}x{lm.SEQ} token ids (curated-transformers: and a boolean "
        "attention mask, the last sequence padded by 2, passed through `MaskedCall`: the "
        f"library's `AttentionMask` is no tensor) or {lm.BATCH} images 3x{lm.IMAGE}x{lm.IMAGE} "
        f"in {lm.PATCH}x{lm.PATCH} patches ({lm.CLASSES} classes). These models compute no loss: "
        "`verify`'s loss is the mean square of the output.",
        "- outcomes, params per rank and plan s as above; no export column (the export check "
        "loads through transformers' `from_pretrained`).",
        "- collectives / Megatron: 4 all-reduces per layer (x-transformers lists attention and "
        "feed-forward as separate entries of `attn_layers.layers`: one layer is a pair), a g "
        "per vocab-parallel embedding lookup, an f before a column-parallel output head (a "
        "language model's logits, the ViT's classifier); no loss collectives.", "",
        library_table(results), ""])


def write_sections(hf: str | None = None, libraries: str | None = None) -> None:
    """docs/coverage.md from the HF survey and the other libraries' section; a section not
    given is kept as the file has it."""
    old = DOC.read_text() if DOC.exists() else ""
    old_hf, found, old_libraries = old.partition("\n" + LIBRARY_HEADING)
    parts = [old_hf if hf is None else hf,
             (LIBRARY_HEADING + old_libraries if found else "") if libraries is None else libraries]
    DOC.write_text("\n\n".join(p.strip("\n") for p in parts if p) + "\n")


def main(argv=None) -> int:
    ap = parser(__doc__, "a handful of families")
    ap.add_argument("--all", action="store_true", help="every family, not the representative set")
    ap.add_argument("--families", help="comma-separated model types (e.g. gpt2,t5)")
    ap.add_argument("--no-export", action="store_true", help="skip the export column (no gloo ranks)")
    ap.add_argument("--libraries", nargs="?", const="all",
                    help="only the other libraries' models (comma-separated names, e.g. "
                         "x-transformers:vit; all when none given); rewrites their section alone")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--library-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_family(*json.loads(args.child))))
        return 0
    if args.library_child:
        print(json.dumps(run_library(json.loads(args.library_child))))
        return 0
    write = not (args.quick or args.no_write)
    if args.libraries:
        chosen = (list(library_models.MODELS) if args.libraries == "all"
                  else args.libraries.split(","))
        unknown = [m for m in chosen if m not in library_models.MODELS]
        if unknown:
            ap.error(f"unknown library models: {', '.join(unknown)} "
                     f"(known: {', '.join(library_models.MODELS)})")
        survey_library_section(chosen, "all" if args.libraries == "all"
                               else f"selected ({args.libraries})", write)
        return 0
    known = families()
    if args.families:
        selected, selection = args.families.split(","), f"selected ({args.families})"
    elif args.quick:
        selected, selection = QUICK, "quick"
    elif args.all:
        selected, selection = sorted(known), "all"
    else:
        selected = [f for f in REPRESENTATIVE if f in known]
        selection = (f"a representative {len(selected)} of the {len(known)} causal-LM, masked-LM "
                     "and seq2seq families (`--all` surveys every one)")
    unknown = [f for f in selected if f not in known]
    if unknown:
        ap.error(f"unknown families: {', '.join(unknown)}")
    _rewritten_as_it_goes(survey(selected, not args.no_export), len(selected), selection,
                          document, lambda text: write_sections(hf=text) if write else None)
    if not (args.families or args.quick):  # the default run and --all: the libraries too
        survey_library_section(list(library_models.MODELS), "all", write)
    return 0


def survey_library_section(chosen: list[str], selection: str, write: bool) -> None:
    """Survey the other libraries' models; their section is rewritten after each one."""
    _rewritten_as_it_goes(survey_libraries(chosen), len(chosen), selection, library_section,
                          lambda text: write_sections(libraries=text) if write else None)


def _rewritten_as_it_goes(runs, total: int, selection: str, render, write) -> None:
    """Render each partial result of ``runs`` (results so far, ``total`` in the end) with
    the selection, the load before and now and the time taken; ``write`` each, print the
    last and its slowest plans."""
    load_before, t0 = os.getloadavg(), time.perf_counter()
    text, results = "", []
    for results in runs:
        done = "" if len(results) == total else f" (in progress: {len(results)} of {total} done)"
        text = render(results, selection + done, (load_before[0], os.getloadavg()[0]),
                      time.perf_counter() - t0)
        write(text)
    print(text)
    print(f"slowest plans: {slowest(results) or 'none planned'}")


if __name__ == "__main__":
    sys.exit(main())
