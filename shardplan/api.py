"""The three entry points: ``parallelize``, ``plan`` and ``verify``."""

from __future__ import annotations

import torch
import torch.nn as nn

from .consistency import assert_same_across
from .errors import CaptureError, ConfigurationError
from .ruleset import load_rules
from .runtime.comm import Group, as_group
from .sharded import ShardedModule


def parallelize(model: nn.Module, tp: int | None = None, *, group=None, mesh=None,
                example_inputs=None, rules="megatron", gather_output: bool = True,
                strict: bool = False, check_model: bool = True,
                recompute=False) -> ShardedModule:
    """Megatron tensor parallelism for ``model`` over a process group.

    Returns a module with the same call signature holding only this rank's
    shards; ``.plan`` says what was decided. ``group`` is a
    ``torch.distributed`` process group (default: the world) or a shardplan
    ``Group``; with ``mesh`` (a ``DeviceMesh``), its "tp" dimension.
    ``check_model`` first compares a checksum of every parameter across the
    ranks (one small broadcast and all-reduce): shards of different models
    would train silently wrong. ``recompute`` recomputes activations in
    backward per block instead of keeping them: ``True`` for every element of
    every ``nn.ModuleList`` (the layers), or module names / glob patterns.
    """
    check_model_arg(model)
    grp = _group(group, mesh)
    if tp is not None and tp != grp.size:
        raise ConfigurationError(
            f"tp={tp} but the process group has {grp.size} ranks",
            fix="pass tp equal to the group size, or a group (or mesh) of tp ranks")
    _check_devices(model)
    if check_model:
        assert_same_across(grp, dict(model.named_parameters()),
                           what=f"{type(model).__name__} is not the same model on every rank",
                           fix="build the model identically on every rank (same seed or the same "
                               "checkpoint) before parallelize, or pass check_model=False")
    example = example_args(model, example_inputs)
    sharded = ShardedModule(model, grp, load_rules(rules), example=example,
                            gather_output=gather_output, strict=strict, recompute=recompute)
    return sharded


def check_model_arg(model, tp=None) -> None:
    """An unsharded ``nn.Module`` and, when given, a positive integer tp."""
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"expected a torch.nn.Module, got {type(model).__name__}",
                                 fix="pass the model object (an nn.Module), not a function or class")
    if isinstance(model, ShardedModule):
        raise ConfigurationError("this model is already parallelized",
                                 where=type(model).__name__,
                                 fix="use the original, unsharded model once")
    if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
        raise ConfigurationError(f"tp must be a positive integer, got {tp!r}",
                                 fix="pass the tensor-parallel size, e.g. tp=8")


def _check_devices(model: nn.Module) -> None:
    devices = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        devices.setdefault(t.device, name)
    if len(devices) > 1:
        listed = ", ".join(f"{n} on {d}" for d, n in devices.items())
        raise ConfigurationError(
            f"{type(model).__name__} has tensors on several devices ({listed})",
            where=type(model).__name__,
            fix="move the whole model to one device (model.to(device)) before parallelize")


def _group(group, mesh) -> Group:
    if mesh is not None:
        names = mesh.mesh_dim_names or ()
        group = mesh.get_group("tp") if "tp" in names else mesh.get_group()
    return as_group(group)


def example_args(model: nn.Module, example_inputs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` to capture with: given, or token ids for a language model."""
    if example_inputs is not None:
        if isinstance(example_inputs, dict):
            return (), example_inputs
        if isinstance(example_inputs, torch.Tensor):
            return (example_inputs,), {}
        if isinstance(example_inputs, (tuple, list)):
            return tuple(example_inputs), {}
        raise CaptureError(
            f"example_inputs for {type(model).__name__} is a {type(example_inputs).__name__}",
            where=type(model).__name__,
            fix="pass a tensor, a tuple/list of positional arguments or a dict of keyword "
                "arguments, shaped as you call the model")
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise CaptureError(
            f"cannot infer example inputs for {type(model).__name__}: it has no token embedding",
            where=type(model).__name__,
            fix="pass example_inputs=(tensor, ...) shaped as you call the model")
    vocab = max(e.num_embeddings for e in embeddings)
    device = next(model.parameters()).device
    return (torch.randint(0, vocab, (2, 8), device=device),), {}
