"""Generation at tp 1, 2 and 4 on gloo: decode latency per token and prefill throughput of
``ShardedModule.generate`` (K/V cache split by heads) against the unsharded model and Hugging
Face's own tensor parallelism, K/V-cache bytes per rank against theory, and loading a
checkpoint of several files per rank against one process loading everything.

    python -m benchmarks.generate                  # from the repo root; writes docs/benchmarks.md
    python -m benchmarks.generate --quick          # tp 1 and 2, 2 rounds, prints only
    python -m benchmarks.generate --tp 1 2 4 --rounds 5 --prompt 40 --new 24

The model is an HF Llama with random weights (seed 0; eos off, so every run makes
``--new`` tokens), saved by ``save_pretrained(max_shard_size=...)`` into several
safetensors files plus their index. For each tp, one command starts tp gloo worker
processes (``shardplan.ranks.RealRanks(tp)``, one torch thread each); each worker:

- loads the folder as ``load_pretrained`` does (its two phases timed apart: build with
  parameters on meta + ``parallelize``, then ``load_full_state_dict``), sampling its
  anonymous and file-backed resident memory every millisecond while loading (the
  first thing a fresh worker does, so the growth is the load's own);
- generates once untimed, which builds the decode step (``ShardedModule.decode_step``: one
  capture); a fallback to recomputing the prefix (its warning) stops the benchmark;
- counts the K/V cache tensors of that decode step on this rank (``kv_cache_bytes``);
- for tp >= 2 loads ``from_pretrained(tp_plan="auto", device_mesh=...)``: HF's own tensor
  parallelism (DTensor), which needs ``accelerate`` (``pip install accelerate``; without
  it that contender is left out and the section says so).

Timed rounds: each round runs, per contender, ``generate(prompt, max_new_tokens=1)``
(prefill: one forward on the prompt and one pick) and ``generate(prompt,
max_new_tokens=1 + new)``; decode latency per token is their difference / ``new``,
prefill throughput is prompt tokens / the first. The default prompt (40) and new (24)
keep both calls in one cache bucket (64 slots), so both run the same decode step, and
make decoding most of the second call, so the difference is not lost in noise. tp
contenders run in an order rotated each round, each after a barrier, timed as the slower
rank; then, while the workers idle, the parent process times the unsharded model (one
thread) with shardplan's cached loop (``shardplan.generate.generate`` with the plain
model's ``decode_step``) and with HF's ``generate`` (its dynamic KV cache). Every
contender's tokens are compared with HF's on the unsharded model.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks.step_time

import torch  # noqa: E402

from ._common import command_line, parser, section_head, spread, write_doc  # noqa: E402

HEADING = "## Generation and checkpoint loading, tp 1/2/4 on gloo"
COMMAND = "python -m benchmarks.generate"
DEFAULTS = dict(tp=[1, 2, 4], rounds=5, prompt=40, new=24)
LLAMA = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1408, vocab_size=8192, max_position_embeddings=512)
SHARD_SIZE = "20MB"  # save_pretrained's max_shard_size: the checkpoint in several files

SHARDPLAN, HF_TP = "shardplan", "HF tp_plan"
CACHED, HF_UNSHARDED = "unsharded, shardplan cached loop", "unsharded, HF generate"

_STATE: dict = {}  # per worker: the contenders and the prompt


# ----------------------------------------------------------------- the model and its files

def llama():
    import transformers
    cfg = transformers.LlamaConfig(**LLAMA, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


def prompt_ids(length: int) -> torch.Tensor:
    return torch.randint(0, LLAMA["vocab_size"], (1, length),
                         generator=torch.Generator().manual_seed(1))


def save_checkpoint(folder: Path) -> int:
    """The Llama in several safetensors files under ``folder``; returns their bytes."""
    llama().save_pretrained(folder, max_shard_size=SHARD_SIZE)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


# ----------------------------------------------------------------- memory while loading

def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_growth(fn):
    """(fn's result, seconds, peak growth of RssAnon, of RssFile while it ran).

    RssAnon is the process's own memory; RssFile the checkpoint pages it has mapped in
    (what it read), sampled every millisecond."""
    fields = ("RssAnon", "RssFile")
    base = [_status(f) for f in fields]
    peak, done = list(base), threading.Event()

    def sample():
        while not done.is_set():
            for i, f in enumerate(fields):
                peak[i] = max(peak[i], _status(f))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    try:
        out = fn()
    finally:
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
    for i, f in enumerate(fields):
        peak[i] = max(peak[i], _status(f))
    return out, seconds, peak[0] - base[0], peak[1] - base[1]


# ----------------------------------------------------------------- on each worker

def _load_shardplan(group, folder: str, ids: torch.Tensor):
    """``load_pretrained``'s two phases, timed apart: (sharded, build+plan s, load s,
    anon growth, file growth while loading, bytes held)."""
    import torch.distributed as dist
    import transformers

    import shardplan
    from shardplan.checkpoint import load_full_state_dict, parameters_on_meta

    t0 = time.perf_counter()
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(folder)).eval()
    sharded = shardplan.parallelize(model, group=group, example_inputs={"input_ids": ids},
                                    check_model=False)
    plan_s = time.perf_counter() - t0
    dist.barrier()  # the load phase starts together: no waiting for a slower plan
    _, load_s, anon, file = peak_growth(lambda: load_full_state_dict(sharded, folder))
    held = sum(t.nbytes for t in sharded.state_dict().values())
    return sharded.eval(), plan_s, load_s, anon, file, held


def _load_hf_tp(folder: str, tp: int):
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (tp,))
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto",
                                                              device_mesh=mesh)
    return model.eval(), time.perf_counter() - t0


def has_accelerate() -> bool:
    import importlib.util
    return importlib.util.find_spec("accelerate") is not None


def warm_cached(sharded, ids: torch.Tensor, new: int):
    """Generate once untimed (building the decode step); the step, or an error if
    ``ShardedModule.generate`` fell back to recomputing the prefix."""
    from shardplan.kvcache import cache_length
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded.generate(ids, max_new_tokens=1 + new)
    fallback = [str(w.message) for w in caught if "no K/V cache" in str(w.message)]
    if fallback:
        raise RuntimeError(f"ShardedModule.generate ran without its K/V cache: {fallback}")
    # the step generate made for this length's bucket (made once: this returns it)
    return sharded.decode_step(ids.shape[0], cache_length(sharded.source, ids.shape[1] + new))


def kv_cache_bytes(decoder) -> int:
    """Bytes of the K/V cache tensors this rank's decode step holds (non-persistent
    buffers, not in its state_dict)."""
    return sum(t.nbytes for name, t in decoder.rank_tensors.items() if "_cache_" in name)


def kv_theory(tp: int, batch: int, slots: int) -> int:
    """2 (K and V) x layers x batch x slots x K/V heads per rank x head dim x 4 bytes; with
    fewer K/V heads than tp, a head shared by a group of ranks counts once per rank."""
    c = LLAMA
    kv = c["num_key_value_heads"]
    return 2 * c["num_hidden_layers"] * batch * slots * (kv // min(tp, kv)) \
        * (c["hidden_size"] // c["num_attention_heads"]) * 4


def _setup(ctx, folder: str, prompt: int, new: int, hf_tp: bool) -> dict:
    """On each worker: load the contenders, build and measure the cache; what was measured."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    ids = prompt_ids(prompt)
    sharded, plan_s, load_s, anon, file, held = _load_shardplan(ctx.group, folder, ids)
    made = {SHARDPLAN: sharded}
    out = dict(plan_s=plan_s, load_s=load_s, anon=anon, file=file, held=held)
    t0 = time.perf_counter()
    decoder = warm_cached(sharded, ids, new)
    out["step_s"] = time.perf_counter() - t0
    out["kv_bytes"], out["kv_batch"], out["kv_slots"] = \
        kv_cache_bytes(decoder), decoder.source.batch, decoder.source.max_len
    if hf_tp:
        made[HF_TP], out["hf_tp_load_s"] = _load_hf_tp(folder, ctx.world_size)
    _STATE.clear()
    _STATE.update(contenders=made, ids=ids)
    return out


def _hf_generate(model, ids, n: int) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)


def _unsharded_step(model, ids: torch.Tensor, n: int):
    """The plain model's decode step for this generation (the bucket the sharded model
    picks for it), made once per bucket."""
    from shardplan.kvcache import cache_length, decode_step
    key = (ids.shape[0], cache_length(model, ids.shape[1] + n - 1))
    steps = _UNSHARDED.setdefault("steps", {})
    if key not in steps:
        steps[key] = decode_step(model, *key)
    return steps[key]


def run_contender(name: str, model, ids, new: int) -> dict:
    """Prefill (one new token) and a full run (1 + ``new``), timed."""
    def gen(n):
        if name in (HF_TP, HF_UNSHARDED):
            return _hf_generate(model, ids, n)
        if name == CACHED:
            from shardplan.generate import generate
            return generate(model, ids, max_new_tokens=n, step=_unsharded_step(model, ids, n))
        return model.generate(ids, max_new_tokens=n)
    with torch.no_grad():
        t0 = time.perf_counter()
        gen(1)
        t1 = time.perf_counter()
        tokens = gen(1 + new)
        t2 = time.perf_counter()
    return {"prefill": t1 - t0, "full": t2 - t1, "tokens": tokens}


def _round(ctx, order: list[str], new: int) -> dict:
    import torch.distributed as dist
    out = {}
    for name in order:
        dist.barrier()
        out[name] = run_contender(name, _STATE["contenders"][name], _STATE["ids"], new)
    return out


def _load_one_process(ctx, folder: str) -> dict:
    """HF's ``from_pretrained`` of the whole folder in one fresh process."""
    import transformers
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    model, seconds, anon, file = peak_growth(
        lambda: transformers.AutoModelForCausalLM.from_pretrained(folder))
    return dict(load_s=seconds, anon=anon, file=file,
                held=sum(t.nbytes for t in model.state_dict().values()))


# ----------------------------------------------------------------- in the parent

def measure(tp: int, folder: Path, args, ranks, reference) -> dict:
    """Load at ``tp``, then interleaved rounds of the tp contenders and the unsharded ones."""
    hf_tp = tp >= 2 and has_accelerate()
    setup = ranks.run(_setup, str(folder), args.prompt, args.new, hf_tp)
    names = [SHARDPLAN] + ([HF_TP] if hf_tp else [])
    ids = prompt_ids(args.prompt)
    runs = {n: [] for n in [*names, CACHED, HF_UNSHARDED]}
    wrong = set()
    for i in range(1 + args.rounds):
        k = i % len(names)
        per_rank = ranks.run(_round, names[k:] + names[:k], args.new)
        done = {}
        for name in names:
            slow = max(per_rank, key=lambda r: r[name]["full"])[name]
            done[name] = dict(slow, prefill=max(r[name]["prefill"] for r in per_rank))
            if any(not torch.equal(r[name]["tokens"], reference) for r in per_rank):
                wrong.add(name)
        for name in (CACHED, HF_UNSHARDED):
            done[name] = run_contender(name, _UNSHARDED["model"], ids, args.new)
            if not torch.equal(done[name]["tokens"], reference):
                wrong.add(name)
        if i >= 1:  # the first round warms up
            for name, r in done.items():
                runs[name].append(r)
        print(f"  tp {tp} {'warm-up' if i == 0 else f'round {i}'}: "
              + ", ".join(f"{n} {1e3 * (r['full'] - r['prefill']) / args.new:.1f}"
                          for n, r in done.items()) + " ms/token", file=sys.stderr, flush=True)
    return {"setup": setup, "runs": runs, "wrong": sorted(wrong), "hf_tp": hf_tp}


_UNSHARDED: dict = {}


def decode_ms(r: dict, new: int) -> float:
    return 1e3 * (r["full"] - r["prefill"]) / new


def timing_table(results: dict, args) -> str:
    lines = ["| tp | contender | decode, ms/token | prefill, tokens/s "
             "| decode / unsharded cached loop | decode / unsharded HF generate "
             "| prefill speed / unsharded cached loop | tokens |",
             "|---:|---|---:|---:|---:|---:|---:|---|"]
    f2 = lambda x: f"{x:.2f}"  # noqa: E731
    for tp, res in results.items():
        runs = res["runs"]
        for name, rs in runs.items():
            dec = [decode_ms(r, args.new) for r in rs]
            pre = [args.prompt / r["prefill"] for r in rs]
            vs = [spread([d / decode_ms(u, args.new) for d, u in zip(dec, runs[p])], f2)
                  for p in (CACHED, HF_UNSHARDED)]
            speed = spread([u["prefill"] / r["prefill"] for r, u in zip(rs, runs[CACHED])], f2)
            ok = "differ" if name in res["wrong"] else "equal"
            label = f"{tp} (peer)" if name in (CACHED, HF_UNSHARDED) else tp
            lines.append(f"| {label} | {name} | {spread(dec)} | {spread(pre, lambda x: f'{x:,.0f}')} "
                         f"| {vs[0]} | {vs[1]} | {speed} | {ok} |")
    return "\n".join(lines)


def summary(results: dict, one: dict, args) -> list[str]:
    """Per-round ratios of shardplan against HF's tensor parallelism, and the load phases."""
    f2 = lambda x: f"{x:.2f}"  # noqa: E731
    out = []
    for tp, res in results.items():
        runs = res["runs"]
        if HF_TP in runs:
            dec = [decode_ms(a, args.new) / decode_ms(b, args.new)
                   for a, b in zip(runs[SHARDPLAN], runs[HF_TP])]
            pre = [b["prefill"] / a["prefill"] for a, b in zip(runs[SHARDPLAN], runs[HF_TP])]
            out.append(f"- tp {tp}: shardplan / HF tp_plan, decode time per token "
                       f"{spread(dec, f2)}; prefill speed {spread(pre, f2)}.")
    plan = [r["plan_s"] for res in results.values() for r in res["setup"]]
    load = [r["load_s"] for res in results.values() for r in res["setup"]]
    step = [r["step_s"] for res in results.values() for r in res["setup"]]
    out.append(f"- Loading: build + plan (export capture) {spread(plan)} s per rank, reading "
               f"the rank's slices {spread(load, f2)} s; HF's `from_pretrained` in one process "
               f"{one['load_s']:.2f} s. The first `generate` (untimed in the table: it builds the "
               f"decode step, capture and plan, then generates) {spread(step)} s per rank.")
    return out


def load_table(results: dict, one: dict, ckpt_bytes: int) -> str:
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    lines = ["| loader | build + plan, s | load, s | peak anonymous growth, MiB "
             "| checkpoint pages mapped, MiB | tensors held, MiB | held / checkpoint |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for tp, res in results.items():
        s = res["setup"]
        for rank, r in enumerate(s):
            lines.append(f"| shardplan tp={tp}, rank {rank} | {r['plan_s']:.2f} | {r['load_s']:.2f} "
                         f"| {mib(r['anon'])} | {mib(r['file'])} | {mib(r['held'])} "
                         f"| {r['held'] / ckpt_bytes:.2f} |")
        if res["hf_tp"]:
            lines.append(f"| HF tp_plan tp={tp} (slowest rank; load only) | - "
                         f"| {max(r['hf_tp_load_s'] for r in s):.2f} | - | - | - | - |")
    lines.append(f"| HF from_pretrained, one process | - | {one['load_s']:.2f} | {mib(one['anon'])} "
                 f"| {mib(one['file'])} | {mib(one['held'])} | {one['held'] / ckpt_bytes:.2f} |")
    return "\n".join(lines)


def kv_table(results: dict) -> str:
    lines = ["| tp | batch x cache slots | K/V cache bytes per rank (every rank) | theory "
             "| measured / theory (every rank) |",
             "|---:|---:|---|---:|---|"]
    for tp, res in results.items():
        s = res["setup"]
        batch, slots = s[0]["kv_batch"], s[0]["kv_slots"]
        assert all((r["kv_batch"], r["kv_slots"]) == (batch, slots) for r in s)
        theory = kv_theory(tp, batch, slots)
        got = [r["kv_bytes"] for r in s]
        lines.append(f"| {tp} | {batch} x {slots} | {', '.join(f'{b:,}' for b in got)} "
                     f"| {theory:,} | {', '.join(f'{b / theory:.3f}' for b in got)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = parser(__doc__, "tp 1 and 2, 2 rounds")
    ap.add_argument("--tp", type=int, nargs="+", help=f"tp sizes (default {DEFAULTS['tp']})")
    ap.add_argument("--rounds", type=int, help=f"timed rounds (default {DEFAULTS['rounds']})")
    ap.add_argument("--prompt", type=int, default=DEFAULTS["prompt"], help="prompt tokens")
    ap.add_argument("--new", type=int, default=DEFAULTS["new"], help="decoded tokens timed")
    args = ap.parse_args(argv)
    args.tp = args.tp or ([1, 2] if args.quick else DEFAULTS["tp"])
    args.rounds = args.rounds or (2 if args.quick else DEFAULTS["rounds"])
    warnings.filterwarnings("ignore")
    from shardplan.ranks import RealRanks

    load_before = os.getloadavg()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        ckpt_bytes = save_checkpoint(folder)
        files = len(list(folder.glob("*.safetensors")))
        model = _UNSHARDED["model"] = llama()
        reference = _hf_generate(model, prompt_ids(args.prompt), 1 + args.new)
        with RealRanks(1, timeout=600) as ranks:
            one = ranks.run(_load_one_process, str(folder))[0]
        results = {}
        for tp in args.tp:
            with RealRanks(tp, timeout=600) as ranks:
                results[tp] = measure(tp, folder, args, ranks, reference)
    load_after = os.getloadavg()

    n_params = sum(p.numel() for p in model.parameters())
    cache_slots = next(iter(results.values()))["setup"][0]["kv_slots"]
    body = [timing_table(results, args), "", *summary(results, one, args), "",
            load_table(results, one, ckpt_bytes), "", kv_table(results)]
    text = "\n".join(body)
    print(text)
    wrong = {tp: res["wrong"] for tp, res in results.items() if res["wrong"]}
    if wrong:
        print(f"PROBLEM: tokens differ from the unsharded model's: {wrong}", file=sys.stderr)
    if args.quick or args.no_write:
        return 1 if wrong else 0
    cmd = command_line(COMMAND, {"--tp": (args.tp, DEFAULTS["tp"]),
                                 "--rounds": (args.rounds, DEFAULTS["rounds"]),
                                 "--prompt": (args.prompt, DEFAULTS["prompt"]),
                                 "--new": (args.new, DEFAULTS["new"])})
    cfg = ", ".join(f"{k} {v}" for k, v in LLAMA.items())
    no_hf = [] if has_accelerate() else [
        "HF's tensor parallelism is not in the table: `from_pretrained(tp_plan=...)` needs "
        "`accelerate`, which is not installed here (`pip install accelerate`).", ""]
    section = "\n".join(section_head(HEADING, cmd, load_before, load_after) + [
        f"HF Llama, random weights ({cfg}; {n_params / 1e6:.1f}M parameters, fp32), saved by "
        f"`save_pretrained(max_shard_size=\"{SHARD_SIZE}\")` into {files} files "
        f"({ckpt_bytes / 2**20:.1f} MiB) and their index. One prompt of {args.prompt} tokens, "
        f"{args.new} decoded tokens timed, greedy. tp ranks are gloo processes "
        "(`RealRanks(tp)`), one torch thread each; the unsharded peers run in the parent "
        "process with one thread between the tp contenders' turns. On this 2-core machine, "
        "tp=4 runs 4 processes on 2 cores.", "",
        "Contenders: `shardplan` is `load_pretrained`'s model and `ShardedModule.generate`: "
        "its decode step (`ShardedModule.decode_step`, built by an untimed first call; the run "
        "stops if it falls back to recomputing the prefix) runs the prompt once, then one "
        "token per step, each rank holding its K/V heads of the cache, and rank 0 broadcasting "
        "each token; `HF tp_plan` is `from_pretrained(tp_plan=\"auto\")` (DTensor; "
        "transformers needs `accelerate` for it: the `hf` extra installs it) and HF's "
        "`generate` with its KV cache; `unsharded, shardplan cached loop` (the fair peer: the "
        "algorithm shardplan runs, unsharded) is `shardplan.generate.generate` on the plain "
        "model with its `decode_step` of the same cache length; `unsharded, HF generate` is "
        "HF's `generate` with its dynamic KV cache.", "", *no_hf,
        f"{args.rounds} timed rounds after one warm-up. Decode, ms/token: (time of generating "
        f"1 + {args.new} tokens - time of generating 1) / {args.new}; prefill, tokens/s: "
        "prompt tokens / time of generating 1 token (both calls use the same cache length, "
        f"{cache_slots} slots, so the same decode step). Cells: median (min–max) over the rounds; "
        "the ratio columns are medians (min–max) of per-round ratios against the unsharded "
        "peers timed in the same round. `tokens`: every rank's tokens against HF's greedy "
        "`generate` on the unsharded model.", "",
        timing_table(results, args), "", *summary(results, one, args), "",
        "Loading the checkpoint per rank. shardplan: `load_pretrained`'s two phases (build "
        "with `parameters_on_meta` + `parallelize`, which captures; then "
        "`load_full_state_dict`), the first thing a fresh worker process does; memory sampled "
        "every millisecond during the load phase. `peak anonymous growth` is the process's own "
        "memory (RssAnon); `checkpoint pages mapped` is RssFile growth, the bytes of the "
        "memory-mapped files this rank touched, i.e. what it read. The peer is HF's "
        "`from_pretrained` of the whole folder in one fresh process. The files are in the "
        "page cache (just written): load times are not disk reads. Pages are 4 KiB and this "
        f"model's rows {LLAMA['hidden_size'] * 4} bytes, so a rank's slice of a row-parallel "
        "weight (columns of every row) touches every page of it, and a fault maps neighbouring "
        "cached pages too: the pages mapped exceed the rank's share where the bytes it copies "
        "(`tensors held`) do not.", "",
        load_table(results, one, ckpt_bytes), "",
        "K/V cache bytes per rank of the decode step `ShardedModule.generate` ran above (this "
        f"Llama: {LLAMA['num_hidden_layers']} layers, {LLAMA['num_key_value_heads']} K/V heads "
        f"of dim {LLAMA['hidden_size'] // LLAMA['num_attention_heads']}, fp32; the tensors "
        "named `_cache_` that the rank's step binds), on every rank, against 2 x layers x batch "
        "x cache slots x K/V heads per rank x head dim x 4 bytes, where K/V heads per rank is "
        "K/V heads / min(tp, K/V heads) (with fewer K/V heads than tp, a group of ranks holds "
        "one head, each rank a copy; `tests/test_generate.py` checks that case at tp=4 with 2 "
        "K/V heads):", "",
        kv_table(results), ""])
    write_doc(HEADING, section)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
