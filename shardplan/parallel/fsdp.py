"""FSDP2 over the data-parallel mesh dimensions, per block, on top of tensor parallelism.

``parallelize(model, mesh=mesh, fsdp=True)`` shards each block's TP-local
parameters over the data-parallel ranks with torch's ``fully_shard``, the
blocks first and the root last, so that only one block's parameters are
gathered at a time. The mesh is ``ParallelDims.fsdp_mesh``: dp_shard alone
(FSDP), or (dp_replicate, dp_shard), on which ``fully_shard`` is HSDP:
shards over dp_shard, replicated along dp_replicate, gradients
reduce-scattered over the shards and all-reduced over the replicas.

FSDP2 gathers a module's parameters in its forward pre-hook, frees them in
the post-hook and reduce-scatters their gradients from hooks on its output.
The rewritten graph is flat, so the blocks have to be made to run as module
calls again:

1. ``outline_blocks`` cuts the graph into one piece per block (as activation
   recomputation does); each piece becomes an ``OwnedPiece``;
2. ``route_through_owners`` makes the graph call the module at the block's
   FQN (a ``BlockOwner``: the block's own submodules and parameters, so
   every FQN stays) with the piece as first argument; the owner inserts its
   parameters, as they are at that moment, where the piece reads them;
3. ``apply_fsdp`` calls ``fully_shard`` on every owner, then the root.

A later call signature's graph gets its own pieces but calls the same
owners (``adopt_tree``). The TP layout stays attached to each parameter:
FSDP2's ``DTensor`` parameters get their ``ParallelSpec`` back
(``layouts.spec_of``), and their ``DTensor`` placement is the data-parallel
one, over the local TP shard.
"""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from ..errors import ConfigurationError
from ..layouts import set_spec, spec_of
from ..torch_compat import set_child, share_parameters

#: the ``fully_shard`` options ``fsdp=`` may carry
OPTIONS = ("mp_policy", "reshard_after_forward", "offload_policy")


class OwnedPiece(nn.Module):
    """One block's piece of the graph; ``slots`` are (argument position, FQN relative
    to the block) of the parameters and buffers its owner passes in."""

    def __init__(self, piece: nn.Module, block: str):
        super().__init__()
        self.piece, self.block = piece, block
        self.slots: tuple[tuple[int, str], ...] = ()

    def forward(self, *args):
        return self.piece(*args)


class BlockOwner(nn.Module):
    """The module at a block's FQN: owns the block's submodules (so its parameters keep
    their FQNs); its forward runs the piece of the graph it is given."""

    def __init__(self, container: nn.Module):
        super().__init__()
        self._modules.update(container._modules)
        self._parameters.update(container._parameters)
        self._buffers.update(container._buffers)

    def forward(self, piece: OwnedPiece, *activations):
        args = list(activations)
        for position, name in piece.slots:  # increasing positions
            owner, _, leaf = name.rpartition(".")
            args.insert(position, getattr(self.get_submodule(owner), leaf))
        return piece(*args)


def route_through_owners(gm: fx.GraphModule) -> fx.GraphModule:
    """Each ``OwnedPiece`` call of ``gm`` becomes a call of the module at its block's FQN,
    passing the piece and the activations; the parameter reads move into the owner."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), OwnedPiece):
            continue
        piece = gm.get_submodule(node.target)
        prefix = piece.block + "."
        slots, activations = [], []
        for i, arg in enumerate(node.args):
            if isinstance(arg, fx.Node) and arg.op == "get_attr" and arg.target.startswith(prefix):
                slots.append((i, arg.target[len(prefix):]))
            else:
                activations.append(arg)
        piece.slots = tuple(slots)
        with graph.inserting_before(node):
            call = graph.call_module(piece.block, (graph.get_attr(node.target), *activations))
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    gm.recompile()
    return gm


def install_owners(root: nn.Module, blocks: list[str]) -> None:
    """Replace the container module at each block FQN of ``root`` by its ``BlockOwner``."""
    for fqn in blocks:
        parent, _, leaf = fqn.rpartition(".")
        holder = root.get_submodule(parent) if parent else root
        holder.register_module(leaf, BlockOwner(holder.get_submodule(leaf)))


def adopt_tree(gm: fx.GraphModule, root: nn.Module) -> None:
    """Make ``gm`` read ``root``'s module tree and own parameters (where FSDP2 swaps
    sharded and gathered parameters) instead of its own copies."""
    for name in list(gm._modules):
        if name in root._modules:
            set_child(gm, name, root._modules[name])
    share_parameters(gm, root)


def fsdp_options(fsdp) -> dict:
    """``fully_shard`` keyword arguments from ``fsdp=`` (``True`` or a dict of options)."""
    if fsdp is True:
        return {}
    if isinstance(fsdp, dict) and set(fsdp) <= set(OPTIONS):
        return dict(fsdp)
    raise ConfigurationError(f"fsdp={fsdp!r} is neither True nor a dict of fully_shard options",
                             where="parallelize",
                             fix=f"pass fsdp=True or a dict with keys among {list(OPTIONS)}")


def apply_fsdp(sharded: nn.Module, blocks: list[str], dp_mesh, options: dict) -> None:
    """``fully_shard`` each block's owner over ``dp_mesh``, then the root; give every
    new ``DTensor`` parameter its tensor's ``ParallelSpec`` back."""
    from torch.distributed.fsdp import fully_shard
    specs = {fqn: spec_of(p) for fqn, p in sharded.named_parameters(remove_duplicate=False)}
    for fqn in blocks:
        fully_shard(sharded.get_submodule(fqn), mesh=dp_mesh, **options)
    fully_shard(sharded, mesh=dp_mesh, **options)
    for fqn, p in sharded.named_parameters(remove_duplicate=False):
        set_spec(p, specs[fqn])
