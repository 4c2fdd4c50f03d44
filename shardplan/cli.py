"""The ``shardplan`` command: look at a plan, check it, compare plans, run the demo.

    shardplan plan llama-70b --tp 8              # a bundled preset, built on meta
    shardplan plan mypkg.models:build --tp 4 --json plan.json --html plan.html
    shardplan verify gpt-tiny --tp 2             # sharded == unsharded, on CPU
    shardplan diff plan-tp4.json plan-tp8.json
    shardplan demo                               # train at tp=2 on gloo vs unsharded
    shardplan generate gpt-tiny --tp 2 --prompt "1 2 3" --max-new-tokens 8
    shardplan export-hf ck/step-00000100 out/ --config hf_folder/   # a checkpoint -> HF
    shardplan bench                              # the benchmarks (source checkout)

TARGET is a bundled preset name (see ``shardplan.models.PRESETS``), an
import string ``package.module:factory`` whose ``factory()`` returns an
``nn.Module``, or a Hugging Face ``config.json``. Exit status: 0 success, 1 verification failed, 2 bad target or
a shardplan error (the message says what and how to fix it).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from .errors import ShardplanError, TargetError
from .models import PRESETS
from .planner.stages import SCHEDULES as STAGE_SCHEDULES
from .targets import build_target


def _positive(name: str):
    """The argparse type of a size argument called ``name``: an integer of at least 1."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {n}")
        return n
    return parse


_RULES_HELP = "the rule set: a bundled name or a .toml rule file (default: megatron)"
_SP_HELP = ("hold the activations between the parallel regions on 1/tp of the sequence "
            "(reduce-scatter/all-gather instead of all-reduce)")


def _cmd_plan(args) -> int:
    from .planner.plan import plan
    p = plan(build_target(args.target, meta=True), args.tp, strict=args.strict,
             sequence_parallel=args.sequence_parallel, batch=args.batch, seq=args.seq,
             dp=args.dp, dp_replicate=args.dp_replicate, dp_shard=args.dp_shard,
             fsdp=args.fsdp, recompute=args.recompute, dtype=args.dtype,
             optimizer=None if args.optimizer == "none" else args.optimizer,
             gpu_memory=args.gpu_memory, rules=args.rules, pp=args.pp, schedule=args.schedule,
             microbatches=args.microbatches, virtual_stages=args.virtual_stages)
    print(p.report())
    for path, text in ((args.json, p.to_json), (args.html, p.to_html)):
        if path:
            with open(path, "w") as f:
                f.write(text())
            print(f"\nplan written to {path}")
    return 0


def _cmd_diff(args) -> int:
    from .planner.plan import Plan
    plans = []
    for path in (args.a, args.b):
        try:
            with open(path) as f:
                plans.append(Plan.from_json(f.read()))
        except (OSError, ValueError) as e:
            raise TargetError(f"cannot read plan {path}: {str(e).splitlines()[0]}") from e
    print(plans[0].diff(plans[1]))
    return 0


def _cmd_verify(args) -> int:
    from .verify import verify
    report = verify(build_target(args.target, meta=False), args.tp,
                    sequence_parallel=args.sequence_parallel, rules=args.rules)
    print(report)
    return 0 if report.ok else 1


def _cmd_export_hf(args) -> int:
    from .checkpoint import export_hf
    export_hf(args.checkpoint, args.out, config=args.config, shard_bytes=args.shard_mb * 2**20)
    print(f"wrote {args.out}")
    return 0


def _bench(rest: list[str]) -> int:
    """Runs ``python -m benchmarks`` of the source checkout (benchmarks are not installed)."""
    import subprocess
    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "__main__.py").is_file():
        raise TargetError("the benchmarks live in shardplan's source checkout (benchmarks/); "
                          "install with `pip install -e .` from a clone to run them")
    return subprocess.call([sys.executable, "-m", "benchmarks", *rest], cwd=root)


def _cmd_demo(args) -> int:
    from .train import demo
    return demo.run(demo.config_from_args(args))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="shardplan", description="Automatic Megatron tensor parallelism for PyTorch models.",
        epilog=f"TARGET: a bundled preset ({', '.join(PRESETS)}), package.module:factory, "
               "or a Hugging Face config.json.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plan", help="print the plan for TARGET at --tp (built on meta: no memory)")
    p.add_argument("target", metavar="TARGET")
    p.add_argument("--tp", type=_positive("tp"), required=True, help="tensor-parallel size")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON to FILE")
    p.add_argument("--html", metavar="FILE",
                   help="also write the plan as a self-contained HTML page to FILE")
    p.add_argument("--strict", action="store_true",
                   help="fail (LayoutError) where the rules cannot place an op, "
                        "instead of keeping that region replicated")
    p.add_argument("--sequence-parallel", action="store_true", help=_SP_HELP)
    p.add_argument("--rules", default="megatron", metavar="RULES", help=_RULES_HELP)
    m = p.add_argument_group("training memory (estimated when --batch and --seq are given)")
    m.add_argument("--batch", type=_positive("batch"), help="sequences per rank per step")
    m.add_argument("--seq", type=_positive("seq"), help="sequence length")
    m.add_argument("--dp-replicate", type=_positive("dp-replicate"),
                   help="data-parallel replicas, each holding all of its shards (default 1)")
    m.add_argument("--dp-shard", type=_positive("dp-shard"),
                   help="FSDP2 shards per replica: parameters, gradients and optimizer state "
                        "divided by it (default 1; with --dp-replicate: HSDP)")
    m.add_argument("--dp", type=_positive("dp"),
                   help="data-parallel size, an alias: --dp-shard with --fsdp, else "
                        "--dp-replicate")
    m.add_argument("--fsdp", action="store_true",
                   help="shard parameters, gradients and optimizer state over --dp-shard "
                        "(or --dp) with FSDP2")
    m.add_argument("--recompute", action="store_true", help="recompute every block in backward")
    m.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="parameter and activation dtype (default: the model's)")
    m.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw")
    m.add_argument("--gpu-memory", metavar="SIZE", help="say whether the peak fits, e.g. 80GB")
    s = p.add_argument_group("pipeline stages (estimated when --pp is given)")
    s.add_argument("--pp", type=_positive("pp"),
                   help="pipeline stages: the blocks cut by FLOPs, each rank within --gpu-memory")
    s.add_argument("--schedule", default="1f1b", choices=list(STAGE_SCHEDULES),
                   help="the pipeline schedule (default 1f1b)")
    s.add_argument("--microbatches", type=_positive("microbatches"),
                   help="microbatches a batch is cut into (default: --pp)")
    s.add_argument("--virtual-stages", type=_positive("virtual-stages"),
                   help="stages per rank of --schedule interleaved (default 2)")
    p.set_defaults(run=_cmd_plan)

    v = sub.add_parser("verify",
                       help="check sharded == unsharded on simulated CPU ranks (exit 1 if not)")
    v.add_argument("target", metavar="TARGET")
    v.add_argument("--tp", type=_positive("tp"), required=True, help="tensor-parallel size")
    v.add_argument("--sequence-parallel", action="store_true", help=_SP_HELP)
    v.add_argument("--rules", default="megatron", metavar="RULES", help=_RULES_HELP)
    v.set_defaults(run=_cmd_verify)

    d = sub.add_parser("diff", help="what changed between two plans (JSON from plan --json)")
    d.add_argument("a", metavar="A.json")
    d.add_argument("b", metavar="B.json")
    d.set_defaults(run=_cmd_diff)

    e = sub.add_parser("export-hf", help="write a checkpoint.save directory as a Hugging Face "
                                         "folder that from_pretrained loads (one process)")
    e.add_argument("checkpoint", help="the checkpoint directory (e.g. a --save step-*)")
    e.add_argument("out", help="the folder to write (replaced atomically)")
    e.add_argument("--config", help="a Hugging Face folder whose config.json to copy")
    e.add_argument("--shard-mb", type=_positive("--shard-mb"), default=5120,
                   help="the largest weight file, in MiB (default: 5120)")
    e.set_defaults(run=_cmd_export_hf)

    sub.add_parser("bench", help="run the benchmarks and update docs/benchmarks.md "
                                 "(arguments go to python -m benchmarks; bench --help lists them)")

    from . import generate_cli
    g = sub.add_parser("generate", help="generate from TARGET (or an HF save_pretrained folder) "
                                        "sharded at --tp, on simulated ranks or under torchrun")
    generate_cli.add_arguments(g, _positive("tp"))
    g.set_defaults(run=generate_cli.run)

    from .train import demo
    m = sub.add_parser("demo", help=demo.DESCRIPTION)
    demo.add_arguments(m)
    m.set_defaults(run=_cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # everything after it belongs to python -m benchmarks
        try:
            return _bench(argv[1:])
        except TargetError as e:
            print(f"shardplan: error: {e}", file=sys.stderr)
            return 2
    args = parser().parse_args(argv)
    # torch's own pytree deprecation, raised inside torch when a graph is deep-copied
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    try:
        return args.run(args)
    except TargetError as e:
        print(f"shardplan: error: {e}", file=sys.stderr)
    except ShardplanError as e:
        print(f"shardplan: {type(e).__name__}: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
