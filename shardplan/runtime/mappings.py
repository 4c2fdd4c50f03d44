"""Megatron's communication mappings: one collective each, forward beside backward.

Every function takes the tensor and a ``Group`` (see ``comm.as_group``) and
returns a new tensor; each is an autograd Function whose two directions are
each other's adjoint:

    function                      forward                 backward
    copy_to_region      (f)       identity                all-reduce
    reduce_from_region  (g)       all-reduce              identity
    scatter_to_region             keep own last-dim slice all-gather last dim
    gather_from_region            all-gather last dim     keep own slice
    gather_from_sequence          all-gather seq dim      reduce-scatter seq dim
    reduce_scatter_to_sequence    reduce-scatter seq dim  all-gather seq dim
    max_over_ranks                all-reduce (max)        none (a constant: no gradient)

``linears_on_gathered_sequence`` runs the linears reading one all-gathered
sequence, keeping only this rank's shard for backward and all-gathering it
again there, once for all of them. ``sum_gradients`` is f for several tensors,
their gradients summed in one flat all-reduce (sequence parallelism's norm
weights and biases).

The sequence mappings take the sequence dim (``dim``, default 0: Megatron's
sequence-first layout; a batch-first ``[B, T, C]`` passes 1).

Identity directions never communicate. ``site`` names the position in the
model for the ledger; by default it is the caller's source line, and the
backward collective reports the forward call's site.

Under ``torch.compile`` the same functions trace into the graph (the group
issues functional collectives); each records its collectives of both
directions in the ledger at forward time (``ledger.traced``).
"""

from __future__ import annotations

import torch

from ..errors import DivisibilityError
from . import ledger
from .comm import as_group, caller_site


def site_or_caller(site: str | None) -> str | None:
    """``site``, or the caller's line when a ledger is listening (it costs a frame walk)."""
    return site if site is not None or not ledger.recording() else caller_site()


def _own_slice(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's contiguous slice of ``t`` along ``dim``."""
    if t.shape[dim] % group.size:
        raise DivisibilityError(
            f"cannot split dim {dim} of size {t.shape[dim]} over {group.size} ranks",
            fix=f"the split dimension must be a multiple of tp={group.size}")
    return t.chunk(group.size, dim)[group.rank].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_reduce(grad, direction="backward", site=ctx.site), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        return group.all_reduce(x, direction="forward", site=site)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return _own_slice(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad, -1, direction="backward", site=ctx.site), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group = group
        return group.all_gather(x, -1, direction="forward", site=site)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.group, -1), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, site):
        ctx.group, ctx.dim, ctx.site = group, dim, site
        return group.all_gather(x, dim, direction="forward", site=site)

    @staticmethod
    def backward(ctx, grad):
        return (ctx.group.reduce_scatter(grad, ctx.dim, direction="backward", site=ctx.site),
                None, None, None)


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, stacked, site):
        ctx.group, ctx.dim, ctx.stacked, ctx.site = group, dim, stacked, site
        return group.reduce_scatter(x, dim, stacked=stacked, direction="forward", site=site)

    @staticmethod
    def backward(ctx, grad):
        return (ctx.group.all_gather(grad, ctx.dim, stacked=ctx.stacked, direction="backward",
                                     site=ctx.site), None, None, None, None)


def _apply(fn, x: torch.Tensor, group, site: str | None, records, *args) -> torch.Tensor:
    """``fn.apply(x, group, *args, site)``; compiled, first records ``fn``'s collectives:
    ``(kind, direction, x is one rank's part)`` each."""
    group = as_group(group)
    if not torch.compiler.is_dynamo_compiling():
        return fn.apply(x, group, *args, site_or_caller(site))
    site = site or "compiled"  # no frame walk in a traced graph
    for kind, direction, per_rank in records:
        if direction == "forward" or (x.requires_grad and torch.is_grad_enabled()):
            ledger.traced(x, kind, group.size, group.size if per_rank else 1, direction, site)
    return fn.apply(x, group, *args, site)


def copy_to_region(x: torch.Tensor, group, *, site: str | None = None) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce of the gradient backward.

    Place it once on a replicated tensor entering a tensor-parallel region.
    """
    return _apply(_CopyToRegion, x, group, site, (("all_reduce", "backward", False),))


def reduce_from_region(x: torch.Tensor, group, *, site: str | None = None) -> torch.Tensor:
    """Megatron's g: all-reduce forward (``Partial`` -> replicated), identity backward."""
    return _apply(_ReduceFromRegion, x, group, site, (("all_reduce", "forward", False),))


def max_over_ranks(x: torch.Tensor, group, *, site: str | None = None) -> torch.Tensor:
    """The elementwise max over the ranks of a tensor that needs no gradient (a softmax's
    shift over a split dim)."""
    group = as_group(group)
    if x.requires_grad:
        raise ValueError("max_over_ranks of a tensor that needs a gradient: its backward "
                         "would need the ranks' argmax; detach it first")
    if torch.compiler.is_dynamo_compiling():
        ledger.traced(x, "all_reduce", group.size, 1, "forward", site or "compiled", "max")
    return group.all_reduce(x, "max", direction="forward", site=site_or_caller(site))


def scatter_to_region(x: torch.Tensor, group, *, site: str | None = None) -> torch.Tensor:
    """Keep this rank's slice of the last dim; backward all-gathers the gradient."""
    return _apply(_ScatterToRegion, x, group, site, (("all_gather", "backward", False),))


def gather_from_region(x: torch.Tensor, group, *, site: str | None = None) -> torch.Tensor:
    """All-gather the last dim; backward keeps this rank's slice of the gradient."""
    return _apply(_GatherFromRegion, x, group, site, (("all_gather", "forward", True),))


def gather_from_sequence(x: torch.Tensor, group, *, dim: int = 0,
                         site: str | None = None) -> torch.Tensor:
    """All-gather along the sequence dim ``dim``; backward reduce-scatters the gradient."""
    return _apply(_GatherFromSequence, x, group, site,
                  (("all_gather", "forward", True), ("reduce_scatter", "backward", True)), dim)


def reduce_scatter_to_sequence(x: torch.Tensor, group, *, dim: int = 0, stacked: bool = False,
                               site: str | None = None) -> torch.Tensor:
    """Sum over ranks and keep this rank's slice of the sequence dim ``dim``; backward
    all-gathers. ``stacked``: ``x``'s tokens are in the order a stacked gather left them
    (``Group.all_gather``), and so is the gradient backward returns."""
    return _apply(_ReduceScatterToSequence, x, group, site,
                  (("reduce_scatter", "forward", False), ("all_gather", "backward", False)),
                  dim, stacked)


class _LinearsOnGatheredSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, group, dim, stacked, site, *weights_and_biases):
        pairs = list(zip(weights_and_biases[::2], weights_and_biases[1::2]))
        ctx.save_for_backward(shard, *(w for w, _ in pairs))
        ctx.group, ctx.dim, ctx.stacked, ctx.site = group, dim, stacked, site
        ctx.biases = [b is not None for _, b in pairs]
        ctx.gathers = x is None
        if ctx.gathers:
            x = group.all_gather(shard, dim, stacked=stacked, direction="forward", site=site)
        return tuple(torch.nn.functional.linear(x, w, b) for w, b in pairs)

    @staticmethod
    def backward(ctx, *grads):
        shard, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad
        need_x, wb = needs[1] if ctx.gathers else needs[0], needs[6:]
        need_w = any(wb[::2])
        where = dict(stacked=ctx.stacked, direction="backward", site=ctx.site)
        # Megatron's overlap: the re-gather runs while the input's gradient is computed,
        # the input gradient's reduce-scatter while the weights' are
        regather = ctx.group.all_gather_start(shard, ctx.dim, **where) if need_w else None
        flat = [g.reshape(-1, g.shape[-1]) for g in grads]  # [tokens, out]
        grad_x = (_input_grad(flat, weights).view(*grads[0].shape[:-1], shard.shape[-1])
                  if need_x else None)
        x = regather.wait().reshape(-1, shard.shape[-1]) if need_w else None
        scatter = (ctx.group.reduce_scatter_start(grad_x, ctx.dim, **where)
                   if ctx.gathers and need_x else None)
        out = []
        for g2, need_w, need_b, bias in zip(flat, wb[::2], wb[1::2], ctx.biases):
            out.append(g2.t().matmul(x.to(g2.dtype)) if need_w else None)
            out.append(g2.sum(0) if need_b and bias else None)
        if ctx.gathers:
            return (None, scatter and scatter.wait(), None, None, None, None, *out)
        return (grad_x, None, None, None, None, None, *out)


def _input_grad(flat_grads, weights) -> torch.Tensor:
    """``sum(g @ w)``: the gradient of the linears' shared input ``[tokens, in]``, each
    GEMM after the first adding into the first's result."""
    total = None
    for g, w in zip(flat_grads, weights):
        w = w.to(g.dtype)  # under autocast forward ran in the grads' dtype
        total = g.mm(w) if total is None else total.addmm_(g, w)
    return total


def linears_on_gathered_sequence(x: torch.Tensor | None, shard: torch.Tensor, weights_and_biases,
                                 group, *, dim: int, stacked: bool = False,
                                 site: str | None = None) -> tuple:
    """``linear(x, w, b)`` for each ``(w, b)`` pair (``b`` may be None), where ``x`` is
    ``shard`` all-gathered along ``dim``: backward keeps ``shard`` (1/tp of the tokens)
    instead of ``x`` and all-gathers it once, when every output's gradient is ready, for
    all the weights' gradients; ``x``'s gradient flows back through its gather.

    ``x=None``: the gather is done here (its only readers are these linears), and so is
    backward's reduce-scatter of ``x``'s gradient. Backward overlaps its collectives with
    its GEMMs as Megatron does: the re-gather runs while ``x``'s gradient is computed,
    that gradient's reduce-scatter while the weights' are (``Group.all_gather_start``).
    ``stacked`` (only with ``x=None``): the gather leaves the tokens in the ranks' order
    (``Group.all_gather``), so do the outputs, and so must their gradients come."""
    if stacked and x is not None:
        raise ValueError("stacked: the linears must gather the shard themselves (x=None)")
    group = as_group(group)
    if not torch.compiler.is_dynamo_compiling():
        return _LinearsOnGatheredSequence.apply(x, shard, group, dim, stacked, site_or_caller(site),
                                                *weights_and_biases)
    site = site or "compiled"  # the collectives eager records, recorded here (see _apply)
    grads = torch.is_grad_enabled()
    for kind, direction, runs in (
            ("all_gather", "forward", x is None),
            ("all_gather", "backward", grads and any(w.requires_grad
                                                     for w in weights_and_biases[::2])),
            ("reduce_scatter", "backward", grads and x is None and shard.requires_grad)):
        if runs:
            ledger.traced(shard, kind, group.size, group.size, direction, site)
    return _LinearsOnGatheredSequence.apply(x, shard, group, dim, stacked, site,
                                            *weights_and_biases)


class _SumGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, site, *tensors):
        ctx.group, ctx.site = group, site
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        total = ctx.group.all_reduce(flat, direction="backward", site=ctx.site)
        return (None, None, *(p.view_as(g) for p, g in
                              zip(total.split([g.numel() for g in grads]), grads)))


def sum_gradients(tensors, group, *, site: str | None = None) -> tuple:
    """f of several tensors at once: identity forward; backward sums their gradients over
    the group with one all-reduce of one flat buffer, once the last of them is ready."""
    group = as_group(group)
    if torch.compiler.is_dynamo_compiling():
        site = site or "compiled"
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            ledger.traced(tensors[0].new_empty(sum(t.numel() for t in tensors)), "all_reduce",
                          group.size, 1, "backward", site)
        return _SumGradients.apply(group, site, *tensors)
    return _SumGradients.apply(group, site_or_caller(site), *tensors)


f = copy_to_region
g = reduce_from_region
