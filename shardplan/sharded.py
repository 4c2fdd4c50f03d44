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

from .capture import PLANNING_LOCK, Captured, capture
from .engine import Annotation, annotate
from .layouts import Replicate
from .plan import build_plan
from .errors import ConfigurationError
from .rewrite import bind, rewrite
from .ruleset import RuleSet
from .runtime.comm import Group
from .shards import local_tensors


class ShardedModule(nn.Module):
    """Holds this rank's shards; calls the rewritten graph for each call's signature."""

    def __init__(self, source: nn.Module, group: Group, rules: RuleSet, *,
                 example: tuple[tuple, dict], gather_output: bool, strict: bool,
                 captured: Captured | None = None):
        super().__init__()
        self._source = [source]  # a list hides it from nn.Module's registry
        self._group, self._rules = group, rules
        self._gather, self._strict = gather_output, strict
        self._graphs: dict = {}
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
        canon = {captured.aliases.get(k, k): v for k, v in self._layouts.items()}
        #: every parameter/buffer FQN (each alias of a tied weight) -> its layout
        self.layouts = {fqn: canon.get(c, Replicate()) for fqn, c in self._aliases.items()}
        for name, child in gm.named_children():
            if not name.startswith("tp_") and not name.startswith("_"):
                self.add_module(name, child)
        for name, t in gm._parameters.items():
            self.register_parameter(name, t)
        self.annotation = ann
        self.train(source.training)
        self._last = _key(args, kwargs, source.training)
        self._graphs[self._last] = gm

    @property
    def group(self) -> Group:
        return self._group

    @property
    def graph_module(self) -> fx.GraphModule:
        """The rewritten graph of the most recent way of calling (first: the example's)."""
        return self._graphs[self._last]

    @property
    def code(self) -> str:
        return self.graph_module.code

    def forward(self, *args, **kwargs):
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

    def _annotate(self, args, kwargs, training: bool, captured: Captured | None = None):
        if captured is None:
            source = self._source[0]
            device = _device_of(source)
            was = source.training
            source.train(training)
            try:
                captured = capture(source, _to(args, device), _to(kwargs, device))
            finally:
                source.train(was)
        return annotate(captured.gm, self._group.size, self._rules, strict=self._strict), captured

    def _finish(self, ann: Annotation, captured, args, kwargs) -> fx.GraphModule:
        target = _input_device(args, kwargs) or _device_of(self._source[0])
        gm = rewrite(ann, self._group, gather_output=self._gather, device=target)
        bind(gm, self._tensors)
        return gm


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
