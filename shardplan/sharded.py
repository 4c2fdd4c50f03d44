"""The module ``parallelize`` returns: one rewritten graph per way of calling it.

Users call one model several ways (with and without targets, train and eval,
batch 1 for inference). A capture bakes in its signature and mode, so the
sharded module captures each new way on first use and caches the rewritten
graph; every graph binds the same parameter shards.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from .planner.capture import PLANNING_LOCK, Captured, capture
from .planner.annotate import Annotation, annotate
from .planner.inputs import check_dtypes
from .layouts import Replicate, set_spec, spec_of
from .planner.plan import build_plan
from .parallel.fsdp import OwnedPiece, adopt_tree, apply_fsdp, install_owners, route_through_owners
from .planner.recompute import Recomputed, block_names, outline_blocks
from .errors import CheckpointError, ConfigurationError
from .planner.rewrite import bind, rewrite
from .planner.rules import RuleSet
from .runtime.comm import Group
from .planner.shards import local_tensors


class ShardedModule(nn.Module):
    """Holds this rank's shards; calls the rewritten graph for each call's signature."""

    is_parallelized = True  # parallelize/plan/verify refuse it as input

    def __init__(self, source: nn.Module, group: Group, rules: RuleSet, *,
                 example: tuple[tuple, dict], gather_output: bool, strict: bool,
                 recompute=False, fsdp_blocks: list[str] = (),
                 captured: Captured | None = None):
        super().__init__()
        self._source = [source]  # a list hides it from nn.Module's registry
        self._group, self._rules = group, rules
        self._gather, self._strict = gather_output, strict
        self._graphs: dict = {}
        #: FQNs of the blocks whose activations are recomputed in backward
        self.recomputed = block_names(source, recompute) if recompute else []
        #: FQNs of the blocks FSDP2 shards over the data-parallel ranks (``parallel.fsdp``)
        self.fsdp_blocks = list(fsdp_blocks)
        args, kwargs = example
        with PLANNING_LOCK:
            ann, captured = self._annotate(args, kwargs, source.training, captured)
            #: what was decided (``Plan``), for the example inputs
            self.plan = build_plan(source, captured, ann, rules, args, kwargs)
            self._layouts = dict(ann.params)
            self._aliases = captured.aliases
            self._tensors = local_tensors(source, self._layouts, self._aliases,
                                          group.rank, group.size)
            gm = self._finish(ann, captured, args, kwargs)
        for name, child in gm.named_children():
            if not name.startswith(("tp_", "_", "submod_")):
                self.add_module(name, child)
        for name, t in gm._parameters.items():
            self.register_parameter(name, t)
        if self.fsdp_blocks:
            install_owners(self, self.fsdp_blocks)
            adopt_tree(gm, self)
        self.annotation = ann
        self.train(source.training)
        self._last = _key(args, kwargs, source.training)
        self._graphs[self._last] = gm

    @property
    def group(self) -> Group:
        return self._group

    @property
    def layouts(self) -> dict:
        """Every parameter/buffer FQN (each alias of a tied weight) -> its placement over
        the TP group, as its tensor's spec says."""
        return {fqn: spec_of(t).layout["tp"] for fqn, t in self._tensors.items()}

    @property
    def graph_module(self) -> fx.GraphModule:
        """The rewritten graph of the most recent way of calling (first: the example's)."""
        return self._graphs[self._last]

    @property
    def code(self) -> str:
        return self.graph_module.code

    def forward(self, *args, **kwargs):
        self._check_materialized(args, kwargs)
        key = _key(args, kwargs, self.training)
        gm = self._graphs.get(key)
        if gm is None:
            with PLANNING_LOCK:
                ann, captured = self._annotate(args, kwargs, self.training)
                changed = {k for k in set(ann.params) | set(self._layouts)
                           if ann.params.get(k, Replicate()) != self._layouts.get(k, Replicate())}
                if changed:
                    raise ConfigurationError(
                        f"calling the model this way changes the layout of {sorted(changed)[:3]}",
                        fix="call the sharded model the way it was parallelized (example_inputs)")
                gm = self._graphs[key] = self._finish(ann, captured, args, kwargs)
        self._last = key
        return gm(*args, **kwargs)

    def shard_data_parallel(self, dp_mesh, options: dict) -> None:
        """FSDP2 over ``dp_mesh`` per block, then the root (``parallel.fsdp.apply_fsdp``);
        from then on this rank's parameters are its ``DTensor`` shards of its TP shards."""
        apply_fsdp(self, self.fsdp_blocks, dp_mesh, options)
        self._tensors.update(self.named_parameters(remove_duplicate=False))

    def load_local_(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set this rank's tensors by FQN (every alias of a tied one): copied in place
        where they exist; where they are still on ``meta`` the given tensors become the
        storage (no copy: loading costs one shard, not two)."""
        if self.fsdp_blocks:
            raise CheckpointError("a model sharded with FSDP2 loads only DCP checkpoints",
                                  fix="use shardplan.checkpoint.load_dcp(sharded, path)")
        for fqn, value in tensors.items():
            current = self._tensors[fqn]
            if current.is_meta or current.shape != value.shape:
                new = nn.Parameter(value.detach(), current.requires_grad) \
                    if isinstance(current, nn.Parameter) else value.detach()
                set_spec(new, spec_of(current))
                for alias, t in list(self._tensors.items()):
                    if t is current:
                        self._tensors[alias] = new
            else:
                with torch.no_grad():
                    current.copy_(value)
        for gm in self._graphs.values():
            bind(gm, self._tensors)
        for name, t in self._graphs[self._last]._parameters.items():
            self._parameters[name] = t

    def _check_materialized(self, args, kwargs) -> None:
        if not any(t.is_meta for t in self._tensors.values()):
            return
        if any(isinstance(x, torch.Tensor) and not x.is_meta for x in pytree.tree_leaves((args, kwargs))):
            missing = [n for n, t in self._tensors.items() if t.is_meta]
            raise CheckpointError(
                f"the sharded model was built on meta and {len(missing)} tensors were never "
                f"loaded (e.g. {missing[0]!r})",
                fix="load weights first: shardplan.checkpoint.load_full_state_dict(sharded, path) "
                    "or load_sharded(sharded, checkpoint_dir)")

    def _annotate(self, args, kwargs, training: bool, captured: Captured | None = None):
        if captured is None:
            source = self._source[0]
            device = _device_of(source)
            was = source.training
            source.train(training)
            try:
                captured = capture(source, _to(args, device), _to(kwargs, device))
                check_dtypes(captured.gm)
            finally:
                source.train(was)
        return annotate(captured.gm, self._group.size, self._rules, strict=self._strict), captured

    def _finish(self, ann: Annotation, captured, args, kwargs) -> fx.GraphModule:
        target = _input_device(args, kwargs) or _device_of(self._source[0])
        gm = rewrite(ann, self._group, gather_output=self._gather, device=target)
        outlined = self.fsdp_blocks or self.recomputed
        if outlined:
            gm = outline_blocks(gm, outlined, self._wrap)
        if not self.fsdp_blocks:
            bind(gm, self._tensors)
        elif not self._graphs:  # the first graph: its module tree becomes this module's
            bind(gm, self._tensors)
            gm = route_through_owners(gm)
        else:  # read the module tree FSDP2 manages
            gm = route_through_owners(gm)
            adopt_tree(gm, self)
        return gm

    def _wrap(self, piece: fx.GraphModule, block: str) -> nn.Module:
        if block in self.recomputed:
            piece = Recomputed(piece, block, self._group)
        return OwnedPiece(piece, block) if self.fsdp_blocks else piece


def _key(args, kwargs, training: bool):
    leaves, spec = pytree.tree_flatten((args, kwargs))
    sig = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append(("T", x.dtype, x.device.type, tuple(d == 1 for d in x.shape)))
        else:
            sig.append(("V", repr(x)))
    return training, str(spec), tuple(sig)


def _device_of(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def _input_device(args, kwargs) -> torch.device | None:
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            return x.device
    return None


def _to(tree, device: torch.device):
    """Example inputs on the model's device (meta models capture on meta inputs)."""
    if device.type != "meta":
        return tree
    return pytree.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, tree)
