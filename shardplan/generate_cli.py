"""``shardplan generate``: text (or token ids) from a sharded model.

    shardplan generate gpt-tiny --tp 2 --prompt "1 2 3" --max-new-tokens 8
    shardplan generate ./hf_folder --tp 2 --prompt "Hello" --sample --seed 0
    torchrun --nproc-per-node 2 -m shardplan.cli generate ./hf_folder --tp 2 --prompt "Hello"

TARGET is what the other commands take (a preset, ``package.module:factory``)
or a folder written by ``save_pretrained`` (config.json + weights, loaded
sliced per rank). ``--checkpoint`` loads a full checkpoint (one file, an
index, or their folder) into a preset or factory; without one they keep
their random initialization (seed 0). Without torchrun, ``--tp`` simulated
ranks run in this process. The prompt is text where TARGET's folder has a
tokenizer, else token ids separated by spaces or commas.
"""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext
from pathlib import Path

import torch

from .errors import TargetError


def add_arguments(ap: argparse.ArgumentParser, tp_type) -> None:
    ap.add_argument("target", metavar="TARGET")
    ap.add_argument("--tp", type=tp_type, required=True, help="tensor-parallel size")
    ap.add_argument("--prompt", required=True,
                    help="text (with a tokenizer in TARGET's folder) or token ids: '1 2 3'")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--checkpoint", metavar="PATH",
                    help="full checkpoint for a preset or factory: .safetensors, index or folder")
    ap.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")


def run(args) -> int:
    tokenizer = _tokenizer(args.target)
    ids = _prompt_ids(args.prompt, tokenizer)
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        import torch.distributed as dist
        from .runtime.comm import as_group
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        out = _on_rank(as_group(), args, ids)
        if dist.get_rank() != 0:
            return 0
    else:
        from .ranks import SimulatedRanks
        if Path(args.target).is_dir():  # transformers' lazy imports are not thread-safe
            from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
        out = SimulatedRanks(args.tp).run(_on_rank_ctx, args, ids)[0]
    print(" ".join(str(int(t)) for t in out[0]))
    if tokenizer is not None:
        print(tokenizer.decode(out[0]))
    return 0


def _on_rank_ctx(ctx, args, ids):
    return _on_rank(ctx.group, args, ids)


def _on_rank(group, args, ids: torch.Tensor) -> torch.Tensor:
    sharded = _sharded(group, args, ids)
    return sharded.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            generator=torch.Generator().manual_seed(args.seed))


def _sharded(group, args, ids):
    import shardplan
    from .checkpoint import load_full_state_dict, load_pretrained, parameters_on_meta
    from .targets import build_target
    if group.size != args.tp:
        raise TargetError(f"--tp {args.tp} but {group.size} ranks are running")
    if Path(args.target).is_dir():
        return load_pretrained(args.target, group=group, example_inputs={"input_ids": ids})
    loads = args.checkpoint is not None  # then parameters wait on meta, buffers are computed
    with torch.random.fork_rng(devices=[]), parameters_on_meta() if loads else nullcontext():
        torch.manual_seed(0)
        model = build_target(args.target, meta=False).eval()
    sharded = shardplan.parallelize(model, group=group, example_inputs=ids, check_model=not loads)
    if loads:
        load_full_state_dict(sharded, args.checkpoint)
    return sharded.eval()


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _tokenizer(target: str):
    folder = Path(target)
    if not folder.is_dir() or not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return None
    try:
        import transformers
        return transformers.AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError, ImportError):
        return None


def _prompt_ids(prompt: str, tokenizer) -> torch.Tensor:
    if tokenizer is not None:
        return tokenizer(prompt, return_tensors="pt")["input_ids"]
    try:
        ids = [int(t) for t in prompt.replace(",", " ").split()]
    except ValueError:
        raise TargetError(f"--prompt {prompt!r}: without a tokenizer the prompt is token ids, "
                          "e.g. '1 2 3'") from None
    if not ids:
        raise TargetError("--prompt is empty")
    return torch.tensor([ids])
