"""Moving g and f along ops linear in the tensor they reduce, to where it is smallest.

MoE experts run on tokens sorted by expert, k copies of each token (top-k):
their input is gathered from b*s tokens into b*s*k rows, and their output is
weighted, put back in token order and summed over the k. All of that is
linear in the experts' output (and the gather in their input), so the sum
over ranks commutes with it: g is issued after the sum over the k (b*s*h
elements, not b*s*k*h) and f before the gather, as Megatron's MoE layer does.
An op is linear in the operands the rule set lists
(``strategy.partial_through``). A move is made only where the tensor gets
strictly smaller, so a dense layer's g and f stay where they were.
"""

from __future__ import annotations

import torch.fx as fx

from ..layouts import Partial, Shard
from .graph import args_of, numel, op_name, operands
from .kinds import Context, Outcome, Role


def _users(node: fx.Node, ctx: Context) -> list[fx.Node]:
    """The users that read the values (not just the metadata) of ``node``."""
    return [u for u in node.users if ctx.kind_of(u) != "inspect"]


def _linear_in(node: fx.Node, a: fx.Node, ctx: Context) -> tuple | None:
    """The operand path at which ``node`` reads ``a``, if it is linear there and reads
    ``a`` nowhere else."""
    positions = ctx.rules.strategy.partial_through.get(op_name(node), [])
    paths = [p for p, b in operands(node) if b is a]
    return paths[0] if len(paths) == 1 and paths[0] in [(i,) for i in positions] else None


def reach(node: fx.Node, layouts: dict, outcomes: dict, ctx: Context) -> list[fx.Node]:
    """Every op after partial ``node`` that its partial sum can flow through: each the
    one reader of the one before, linear in it, its other operands not split. A bias is
    added after g, so past a biased ``node`` only ops that change nothing (a dropout of
    probability 0 or not training) let it flow."""
    chain, cur = [], node
    biased = outcomes[node].bias is not None
    while True:
        users = _users(cur, ctx)
        if len(users) != 1 or users[0].op != "call_function":
            break
        nxt = users[0]
        path = _linear_in(nxt, cur, ctx)
        if path is None or any(isinstance(layouts.get(b), (Shard, Partial))
                               for p, b in operands(nxt) if p != path):
            break
        if biased and not _identity(nxt):
            break
        chain.append(nxt)
        cur = nxt
    return chain


def _identity(node: fx.Node) -> bool:
    """A dropout that drops nothing: probability 0, or not training."""
    if op_name(node) != "aten.dropout.default":
        return False
    args = args_of(node)
    return args.get("p") == 0 or args.get("train") is False


def defer_g(node: fx.Node, layouts: dict, outcomes: dict, ctx: Context) -> list[fx.Node]:
    """The ops after partial ``node`` its g moves past: ``reach`` up to the smallest
    tensor on the way ([] when nothing gets smaller)."""
    chain = reach(node, layouts, outcomes, ctx)
    sizes = [numel(n) for n in chain]
    if not sizes or min(sizes) >= numel(node):
        return []
    return chain[:sizes.index(min(sizes)) + 1]


def pass_partials(layouts: dict, outcomes: dict, ctx: Context) -> tuple[set, dict]:
    """Make every chain ``defer_g`` finds partial (in ``layouts`` and ``outcomes``); the
    nodes whose partial sum flows on to their user, unreduced, and each sum of partial
    sums -> the row-parallel partials in it whose bias is added after its g."""
    passed = set()

    def flow(node, chain):
        for prev, n in zip([node, *chain], chain):
            passed.add(prev)
            layouts[n] = Partial()
            outcomes[n] = Outcome(Partial(), rule="linear in a partial sum: g after it")

    # a distributed reduction's partial (a statistic; a max is no sum) is reduced where it is
    partials = [n for n, lay in layouts.items() if isinstance(lay, Partial)
                and outcomes[n].role is not Role.DISTRIBUTED]
    for node in partials:
        if node not in passed and isinstance(layouts.get(node), Partial):
            flow(node, defer_g(node, layouts, outcomes, ctx))
    # partial sums that flow into one sum (an MoE layer's experts and its shared expert):
    # one g, after the sum, instead of one each
    # a sum -> by operand path: (the partial node, the chain from it to the sum)
    joins: dict[fx.Node, dict[tuple, tuple[fx.Node, list[fx.Node]]]] = {}
    for node in [n for n, lay in layouts.items() if isinstance(lay, Partial) and n not in passed
                 and outcomes[n].role is not Role.DISTRIBUTED]:
        chain = reach(node, layouts, outcomes, ctx)  # none past a bias: it is added after g
        end = chain[-1] if chain else node
        users = _users(end, ctx)
        if len(users) == 1 and op_name(users[0]) in ctx.rules.strategy.partial_sums:
            paths = [p for p, b in operands(users[0]) if b is end]
            if len(paths) == 1:
                joins.setdefault(users[0], {})[paths[0]] = (node, chain)
    biases: dict[fx.Node, list[fx.Node]] = {}
    for total, parts in joins.items():
        if len(parts) == len(operands(total)) >= 2:
            for node, chain in parts.values():
                flow(node, [*chain, total])
            layouts[total] = Partial()
            outcomes[total] = Outcome(Partial(), rule="sum of partial sums: one g after it")
            biased = [n for n, _ in parts.values() if outcomes[n].bias is not None]
            if biased:  # their biases are added after this g, so it moves no further
                biases[total] = biased
            else:
                flow(total, defer_g(total, layouts, outcomes, ctx))
    return passed, biases


def earlier_f(consumer: fx.Node, path: tuple, a: fx.Node, requires_grad: dict,
              ctx: Context) -> tuple[fx.Node, tuple]:
    """Where the f of replicated ``a`` entering a region at ``(consumer, path)`` goes:
    ``(the tensor it wraps, the edge it is read on)``. Back through ops linear in their
    input whose other operands need no gradient, each read only by the next, to the
    smallest tensor on the way (``(a, (consumer, path))`` when none is smaller)."""
    best, cur, edge = (a, (consumer, path)), a, (consumer, path)
    while cur.op == "call_function" and _users(cur, ctx) == [edge[0]]:
        src = cur.args[0] if cur.args and isinstance(cur.args[0], fx.Node) else None
        if src is None or _linear_in(cur, src, ctx) != (0,) or any(
                requires_grad.get(b) for p, b in operands(cur) if p != (0,)):
            break
        edge, cur = (cur, (0,)), src
        if numel(cur) < numel(best[0]):
            best = (cur, edge)
    return best
