"""Activation recomputation per block (Megatron's "full" recomputation).

A recomputed block keeps only its inputs from the forward pass and runs its
forward again during backward, trading one more forward (including its g
all-reduces) for the activations inside it. The rewritten graph is one flat
graph, so ``outline_blocks`` cuts it into one submodule per block (torch's
``split_module``; node order, and so the order of collectives, is kept) and
the sharded module wraps each block's submodule in ``Recomputed`` (FSDP2 cuts
the graph at the same boundaries: ``parallel.fsdp``).

Recomputed dropout must draw the masks of the first pass, in both random
streams: torch's checkpoint restores the default generators (the replicated
stream), and ``Recomputed`` restores the model-parallel one, which torch does
not know about.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from contextlib import contextmanager, nullcontext

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from .capture import module_of
from ..errors import ConfigurationError
from ..runtime.comm import Group
from ..runtime.random import tracker_for

PREFIX = "recompute_"


def block_names(model: nn.Module, recompute) -> list[str]:
    """FQNs of the modules ``recompute`` selects in ``model``.

    ``True``: every element of every ``nn.ModuleList`` (a Transformer's
    layers). Else an iterable of module FQNs or glob patterns
    (``"model.layers.*"``). A module inside another selected one is not
    selected again.
    """
    names = dict(model.named_modules())
    if recompute is True:
        chosen = [f"{parent}.{i}" if parent else i for parent, mod in names.items()
                  if isinstance(mod, nn.ModuleList) for i in mod._modules]
        if not chosen:
            raise ConfigurationError(
                f"recompute=True found no blocks: {type(model).__name__} has no nn.ModuleList",
                where=type(model).__name__,
                fix="name the modules to recompute, e.g. recompute=['encoder.*']")
    else:
        patterns = [recompute] if isinstance(recompute, str) else list(_patterns(recompute))
        chosen = [n for n in names if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        if not chosen:
            raise ConfigurationError(
                f"recompute={patterns} matches no module of {type(model).__name__}",
                where=type(model).__name__,
                fix="give module names as model.named_modules() spells them, e.g. 'layers.*'")
    chosen_set = set(chosen)
    return [n for n in chosen if not any(a in chosen_set for a in _ancestors(n))]


def _patterns(recompute) -> Iterable[str]:
    if not isinstance(recompute, Iterable) or not all(isinstance(p, str) for p in recompute):
        raise ConfigurationError(f"recompute={recompute!r} is neither a bool nor module names",
                                 fix="pass recompute=True (every block) or a list of module "
                                     "names/glob patterns")
    return recompute


def _ancestors(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def outline_blocks(gm: fx.GraphModule, blocks: list[str],
                   wrap: Callable[[fx.GraphModule, str], nn.Module]) -> fx.GraphModule:
    """``gm`` with the nodes of each block in one submodule, ``wrap(piece, block_fqn)``
    (``Recomputed``; FSDP's ``OwnedPiece``).

    A node belongs to the block whose module produced it; nodes the rewriter
    inserted (f, g, shard slices) carry no module and belong with the node
    before them. Everything between blocks stays outside, in plain
    submodules. The returned module holds ``gm``'s own submodules, so every
    parameter and buffer keeps its FQN (each alias of a tied one); blocks get
    them as inputs.
    """
    wanted = set(blocks)
    segment, label, labels = 0, None, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if "nn_module_stack" in node.meta:
            mod = module_of(node)
            now = next((a for a in (*_ancestors(mod), mod) if a in wanted), None)
        else:
            now = label  # inserted by the rewriter: with its predecessor
        if now != label or segment == 0:
            segment += 1
            label = now
        labels[node] = (segment, label)
    split = split_module(gm, gm, lambda n: labels[n][0], keep_original_order=True,
                         keep_original_node_name=True, partition_affix=PREFIX.rstrip("_"))
    split.graph.set_codegen(gm.graph._codegen)  # the call's pytree in and out (gm is done)
    split.recompile()
    for name in [n for n in split._modules if not n.startswith("submod_")]:
        delattr(split, name)  # copies holding only what the graph reads
    for name, child in gm.named_children():
        if not name.startswith("tp_"):
            split.add_module(name, child)
    for name, t in gm._parameters.items():
        split.register_parameter(name, t)
    for name, b in gm._buffers.items():
        split.register_buffer(name, b)
    for segment, label in set(labels.values()):
        if label is not None:
            name = f"submod_{PREFIX}{segment}"
            setattr(split, name, wrap(getattr(split, name), label))
    return split


class Recomputed(nn.Module):
    """Runs ``block`` under torch's non-reentrant checkpoint, restoring both random
    streams for the recomputation."""

    def __init__(self, block: nn.Module, name: str, group: Group):
        super().__init__()
        self.block, self.name, self.rank = block, name, group.rank

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.block(*args)
        return checkpoint(self.block, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=self._rng_contexts)

    def _rng_contexts(self):
        """(forward, recompute) contexts: the recomputation starts the model-parallel
        stream where the first forward started it."""
        tracker = tracker_for(self.rank)
        start = tracker.model_parallel_state()

        @contextmanager
        def replay():
            with tracker.model_parallel_at(start):
                yield
        return nullcontext(), replay()
