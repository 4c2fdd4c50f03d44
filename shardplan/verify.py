"""verify: does the sharded model compute what the unsharded one does?

Checks the inputs' dtypes and token ids against the captured graph first (naming
the module and source line), then runs the model unsharded and, on simulated
ranks in this process, sharded; compares every rank's outputs and loss, and every
parameter gradient: each rank's copy of a replicated one, and a shard's gathered
value through every member of its replica groups (K/V heads shared by ranks). When they differ, replays both graphs node by node
and names the first node whose value diverges.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn as nn
from pydantic import BaseModel

from .planner.capture import IN_SPEC, capture, module_of, source_of
from .planner.graph import op_name
from .planner.inputs import check_dtypes, check_model_arg, check_token_ids, example_args
from .layouts import Partial, Shard
from .ranks import SimulatedRanks
from .planner.rules import load_rules
from .planner.token_order import GATHERED_ORDER
from .sharded import ShardedModule
from .torch_compat import pytree, tree_flatten_spec


class Difference(BaseModel):
    name: str
    max_abs: float
    max_rel: float


class VerifyReport(BaseModel):
    """Max differences between the simulated sharded run and the unsharded run."""

    model: str
    tp: int
    ok: bool
    atol: float
    rtol: float
    outputs: list[Difference]
    loss: Difference
    grads: list[Difference]
    first_divergent_node: str | None = None

    def worst(self) -> Difference:
        return max([*self.outputs, self.loss, *self.grads], key=lambda d: d.max_abs)

    def __str__(self) -> str:
        w = self.worst()
        head = "OK" if self.ok else "MISMATCH"
        text = (f"{head}: {self.model} at tp={self.tp}: {len(self.outputs)} outputs, loss and "
                f"{len(self.grads)} gradients; worst {w.name}: abs {w.max_abs:.2e}, "
                f"rel {w.max_rel:.2e} (atol {self.atol:g}, rtol {self.rtol:g})")
        if self.first_divergent_node:
            text += f"\nfirst divergent node: {self.first_divergent_node}"
        return text


def verify(model: nn.Module, tp: int, *, example_inputs=None, loss_fn=None,
           rules="megatron", atol: float = 1e-5, rtol: float = 1e-4,
           train: bool = False, sequence_parallel: bool = False) -> VerifyReport:
    """Compare ``parallelize(model, tp)`` on simulated ranks with ``model`` itself.

    ``loss_fn(output) -> scalar`` defaults to the model's own scalar output
    (a language model's loss), else the mean square of its floating outputs.
    The comparison runs in eval mode (dropout draws differ between runs);
    ``train=True`` compares in training mode, for models without dropout.
    ``sequence_parallel`` verifies the sequence-parallel plan.
    """
    check_model_arg(model, tp)
    args, kwargs = example_args(model, example_inputs)
    ruleset = load_rules(rules)
    model = copy.deepcopy(model).train(train)
    captured = capture(model, args, kwargs)
    check_dtypes(captured.gm)  # the real kernels would reject these with no module named
    check_token_ids(captured.gm, args, kwargs)
    ref = copy.deepcopy(model)
    out = ref(*args, **kwargs)
    loss = _loss(out, loss_fn)
    loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}

    def rank(ctx, record: bool):
        sharded = ShardedModule(copy.deepcopy(model), ctx.group, ruleset, example=(args, kwargs),
                                gather_output=True, strict=False, captured=copy.deepcopy(captured),
                                sequence_parallel=sequence_parallel)
        values = _replay(sharded.graph_module, args, kwargs) if record else None
        o = sharded(*args, **kwargs)
        l_ = _loss(o, loss_fn)
        l_.backward()
        grads = {n: p.grad for n, p in sharded.named_parameters(remove_duplicate=False)}
        return _detach(o), l_.detach(), grads, sharded.layouts, values, sharded.annotation

    results = SimulatedRanks(tp).run(rank, False)
    # every rank's outputs and loss, every replica's gradient: one wrong rank fails
    want_outs = _tensors(out)
    outs = []
    for i, want in enumerate(want_outs):
        got = [(r, _tensors(res[0])) for r, res in enumerate(results)]
        outs.append(worst([_diff(f"output[{i}] on rank {r}", t[i], want) if i < len(t)
                           else _missing(f"output[{i}] on rank {r}") for r, t in got],
                          atol, rtol))
    if any(len(_tensors(res[0])) != len(want_outs) for res in results):
        outs.append(_missing("outputs (count differs)"))
    loss_diff = worst([_diff(f"loss on rank {r}", res[1], loss.detach())
                       for r, res in enumerate(results)], atol, rtol)
    grads = []
    for name, g in ref_grads.items():
        lay = results[0][3].get(name)
        parts = [r[2].get(name) for r in results]
        if any(p is None for p in parts):
            grads.append(_missing(name))
            continue
        grads.append(worst([_diff(f"grad {name}{where}", full, g)
                            for where, full in every_copy(lay, parts, g.shape)], atol, rtol))
    ok = all(_close(d, atol, rtol) for d in [*outs, loss_diff, *grads])
    report = VerifyReport(model=type(model).__name__, tp=tp, ok=ok, atol=atol, rtol=rtol,
                          outputs=outs, loss=loss_diff, grads=grads)
    if not ok:
        ref_values = _replay(copy.deepcopy(captured.gm), args, kwargs)
        recorded = SimulatedRanks(tp).run(rank, True)
        report.first_divergent_node = _first_divergence(ref_values, recorded, atol, rtol)
    return report


def every_copy(lay, parts: list[torch.Tensor], shape) -> list[tuple[str, torch.Tensor]]:
    """Every rank's view of one parameter's full tensor, as ``(where, tensor)``.

    A replicated tensor: each rank's copy. A shard: the full tensor from every
    combination a replica group allows (``Shard(..., replicas=r)``: ranks j, j + r,
    ... for each j < r), so no member of a replica group goes unchecked.
    """
    if isinstance(lay, Shard):
        copies = max(lay.block_replicas())
        return [(f" (replica {j})" if copies > 1 else "",
                 lay.unshard(parts, shape[lay.dim], j)) for j in range(copies)]
    return [(f" on rank {r}", p) for r, p in enumerate(parts)]


def worst(diffs: list[Difference], atol: float, rtol: float) -> Difference:
    """The difference that fails the tolerance (if any does), else the largest."""
    return max(diffs, key=lambda d: (not _close(d, atol, rtol), d.max_abs))


def _missing(name: str) -> Difference:
    return Difference(name=name, max_abs=float("inf"), max_rel=float("inf"))


def _loss(out, loss_fn):
    if loss_fn is not None:
        return loss_fn(out)
    leaves = _tensors(out)
    scalars = [t for t in leaves if t.dim() == 0 and t.is_floating_point()]
    if scalars:
        return scalars[0]
    return sum(t.float().square().mean() for t in leaves if t.is_floating_point())


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _detach(tree):
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)


def _diff(name, a: torch.Tensor, b: torch.Tensor) -> Difference:
    if a.shape != b.shape:
        return Difference(name=f"{name} (shape {tuple(a.shape)} vs {tuple(b.shape)})",
                          max_abs=float("inf"), max_rel=float("inf"))
    a, b = a.double(), b.double()
    same = (a == b) | (a.isnan() & b.isnan())  # equal infinities and NaNs do not differ
    d = torch.where(same, 0.0, (a - b).abs())
    scale = torch.where(b.isfinite(), b.abs(), 0.0).max().clamp_min(1e-12)
    m = d.max().item() if d.numel() else 0.0
    return Difference(name=name, max_abs=m, max_rel=m / scale.item())


def _close(d: Difference, atol, rtol) -> bool:
    return d.max_abs <= atol or d.max_rel <= rtol


class _Recorder(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict[str, object] = {}

    def run_node(self, n):
        v = super().run_node(n)
        if not n.meta.get(GATHERED_ORDER):  # its tokens are in the ranks' order, not the model's
            self.values[n.name] = _detach(v)
        return v


def _replay(gm: fx.GraphModule, args, kwargs) -> dict:
    flat = tree_flatten_spec((args, kwargs), gm.meta[IN_SPEC])
    rec = _Recorder(gm)
    with torch.no_grad():
        rec.run(*flat)
    return rec.values


def _first_divergence(ref: dict, ranks: list, atol, rtol) -> str | None:
    ann = ranks[0][5]
    per_rank = [r[4] for r in ranks]
    for node, out in ann.outcomes.items():
        name = node.name
        if name not in ref or any(name not in v for v in per_rank):
            continue
        want = ref[name]
        if not isinstance(want, torch.Tensor):
            continue
        parts = [v[name] for v in per_rank]
        lay = out.out
        if isinstance(lay, Partial) and out.bias is not None:
            continue  # its bias moved after g: checked at its consumers
        if isinstance(lay, Partial):
            got = sum(parts[1:], parts[0])
        elif isinstance(lay, Shard):
            got = lay.unshard(parts, want.shape[lay.dim])
        else:
            got = parts[0]
        if not _close(_diff(name, got, want), atol, rtol):
            where = source_of(node)
            return f"{name} ({op_name(node)} in {module_of(node) or 'the top level'}" + \
                (f", {where})" if where else ")")
    return None
