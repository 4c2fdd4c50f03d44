"""Compiled graphs overlap each collective with the compute that does not need it.

Autograd orders a linear layer's backward as input gradient, then weight
gradient; the copy-to-region mapping's all-reduce of the input gradient comes
after both, and its wait right after it, so the reduction blocks while the
weight gradient could have run. Megatron's eager layers start that all-reduce
asynchronously before the weight gradient; compiled, inductor keeps the
traced order. ``OverlapCollectives`` is an inductor post-grad pass that, for
every functional collective, moves the nodes it does not depend on (since the
previous collective, wait or side effect) behind it, and every wait down to
just before the first node that reads its result. Gloo's worker thread then
reduces while this rank computes. Only the order changes, never the values,
and every rank reorders the same graph the same way, so the collectives are
still issued in one order on all ranks.
"""

from __future__ import annotations

import torch.fx as fx

from ..torch_compat import WAIT_TENSOR as _WAIT, CustomGraphPass, OpOverload, get_hash_for_files


def _is_collective(node: fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, OpOverload)
            and node.target.namespace == "_c10d_functional" and node.target is not _WAIT)


def _is_barrier(node: fx.Node) -> bool:
    """Nodes nothing is moved across: inputs, collectives, waits, side effects."""
    return (node.op != "call_function" or _is_collective(node) or node.target is _WAIT
            or node.is_impure())


def sink_waits(graph: fx.Graph) -> None:
    """Each wait just before the first node that reads the reduced tensor."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for wait in [n for n in graph.nodes if n.target is _WAIT]:
        if wait.users:
            first = min(wait.users, key=order.__getitem__)
            if first.prev is not wait:
                first.prepend(wait)


def raise_collectives(graph: fx.Graph) -> None:
    """Each collective right after its own inputs: the nodes since the last barrier
    that it does not depend on move behind it, in their order. (Inductor's post-grad
    graph has the functional collectives here; it makes them in-place afterwards, where
    no later reader of the input is left. An in-place one keeps its inputs' readers.)"""
    for coll in [n for n in graph.nodes if _is_collective(n)]:
        window = []  # newest first
        node = coll.prev
        while node.op != "root" and not _is_barrier(node):
            window.append(node)
            node = node.prev
        inside, needed = set(window), set()
        stack = list(coll.all_input_nodes)
        if coll.target._schema.is_mutable:  # an in-place collective: its inputs' readers stay before
            stack += [u for n in coll.all_input_nodes for u in n.users if u in inside]
        while stack:
            n = stack.pop()
            if n in inside and n not in needed:
                needed.add(n)
                stack.extend(n.all_input_nodes)
        at = coll
        for n in reversed(window):
            if n not in needed:
                at.append(n)
                at = n


class OverlapCollectives(CustomGraphPass):
    """Inductor's ``post_grad_custom_post_pass``: ``raise_collectives`` then ``sink_waits``."""

    def __call__(self, graph: fx.Graph) -> None:
        raise_collectives(graph)
        sink_waits(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
