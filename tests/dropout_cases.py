"""Train-mode dropout in fuzz models, on real ranks: which stream every mask came from.

Simulated ranks are threads sharing torch's default generator, so dropout masks
there are not reproducible (docs/design.md, "Verification"); these run on
``RealRanks``. Each rank seeds ``shardplan.runtime.random`` with ``SEED``, plans
the fuzz model in train mode and replays its graph, recording every dropout's
input and output. ``check_streams`` then decides, from the data alone, which
stream each dropout had to draw from -- replicated when its input is the same on
every rank, model-parallel when the ranks hold different parts -- and redraws
each rank's masks from that stream (``SEED``, or Megatron's ``SEED + 2718 +
rank``) in graph order. The outputs must match bit for bit, the replicated
stream's masks must agree across ranks, and so must the model's output.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

import shardplan
from shardplan.runtime import graph_ops
from shardplan.runtime.random import manual_seed, model_parallel_seed, set_rng_tracker
from shardplan.verify import _replay

from fuzz_models import ModelCfg, build_model, example_inputs

SEED = 4321


def _is_dropout(gm, node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), graph_ops.ModelParallelRNG)
    return node.op == "call_function" and "dropout" in str(node.target)


def dropout_run(ctx, cfg: ModelCfg, broken: bool = False):
    """This rank's dropouts in graph order, ``(name, op, args, output)``, and the model's
    output; or the ShardplanError planning refused it with. ``broken`` puts the
    model-parallel stream's draws on the replicated stream (a mutation guard)."""
    model = build_model(cfg).train()
    inputs = example_inputs(cfg)
    real_forward = graph_ops.ModelParallelRNG.forward
    if broken:
        graph_ops.ModelParallelRNG.forward = lambda self, *a, **k: self.op(*a, **k)
    try:
        try:
            sharded = shardplan.parallelize(model, group=ctx.group, example_inputs=inputs)
        except shardplan.ShardplanError as e:
            return e
        gm = sharded.graph_module
        manual_seed(SEED, ctx.rank)  # after planning: the replay's draws start at the seed
        values = _replay(gm, (), inputs)
    finally:
        graph_ops.ModelParallelRNG.forward = real_forward
        set_rng_tracker(None)
    drops = []
    for node in gm.graph.nodes:
        if _is_dropout(gm, node):
            op = gm.get_submodule(node.target).op if node.op == "call_module" else node.target
            args = pytree.tree_map(lambda a: values[a.name] if isinstance(a, torch.fx.Node) else a,
                                   (node.args, dict(node.kwargs)))
            drops.append((node.name, str(op), args, values[node.name]))  # ops do not pickle
    out = next(values[n.name] for n in gm.graph.nodes if n.op == "output")
    return drops, out


def _resolve(name: str):
    """``"aten.dropout.default"`` -> ``torch.ops.aten.dropout.default``."""
    obj = torch.ops
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _first(args):
    return next(x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor))


def check_streams(results) -> set[str]:
    """Assert that every rank's dropout drew from the stream its input calls for (see the
    module docstring); return the streams seen ("replicated", "model-parallel")."""
    per_rank = [r[0] for r in results]
    names = [[d[0] for d in drops] for drops in per_rank]
    assert all(n == names[0] for n in names), f"the ranks' graphs differ: {names}"
    assert names[0], "no dropout in the sharded graph"
    seen = set()
    streams = [{"replicated": torch.Generator().manual_seed(SEED),  # each rank's own copies
                "model-parallel": torch.Generator().manual_seed(model_parallel_seed(SEED, r))}
               for r in range(len(results))]
    for i, name in enumerate(names[0]):
        ins = [_first(drops[i][2]) for drops in per_rank]
        same = all(x.shape == ins[0].shape and torch.equal(x, ins[0]) for x in ins)
        seen.add("replicated" if same else "model-parallel")
        for rank, drops in enumerate(per_rank):
            _, op, (args, kwargs), got = drops[i]
            op, stream = _resolve(op), "replicated" if same else "model-parallel"
            gen = streams[rank][stream]
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(gen.get_state())
                redrawn = op(*args, **kwargs)
                gen.set_state(torch.get_rng_state())
            assert torch.equal(_first(redrawn), _first(got)), \
                f"rank {rank}: {name} did not draw from the {stream} stream"
        if same:
            outs = [_first(drops[i][3]) for drops in per_rank]
            assert all(torch.equal(o, outs[0]) for o in outs), f"{name}: replicated masks differ"
    outs = [pytree.tree_leaves(r[1]) for r in results]
    for rank, out in enumerate(outs[1:], 1):
        assert all(torch.equal(a, b) for a, b in zip(out, outs[0])), f"rank {rank}'s output differs"
    return seen
