"""Optimizer state in a sharded checkpoint: its tensors keyed by parameter FQN (an
elementwise state follows its parameter's layout), its hyperparameters as JSON."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..layouts import Replicate, Shard
from .entries import Entry
from .files import dtype_name, dtype_of, read_tensor


@dataclass
class _OptimTensor:
    key: str
    tensor: torch.Tensor
    layout: Replicate | Shard
    shape: tuple[int, ...]
    fqn: str


def _to_json(v, where: str):
    """A hyperparameter or optimizer value as JSON (tensors as tagged lists)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_to_json(x, where) for x in v]
    if isinstance(v, torch.Tensor) and v.numel() <= 64:
        return {"__tensor__": v.tolist(), "dtype": dtype_name(v.dtype)}
    raise CheckpointError(f"{where} = {type(v).__name__} cannot be saved as JSON", where=where,
                          fix="use numbers, strings, lists or small tensors")


def _from_json(v, like=None):
    """Inverse of ``_to_json``; lists become tuples where the current value is one."""
    if isinstance(v, dict) and "__tensor__" in v:
        return torch.tensor(v["__tensor__"], dtype=dtype_of(v["dtype"], "tensor value"))
    if isinstance(v, list):
        items = [_from_json(x) for x in v]
        return tuple(items) if isinstance(like, tuple) else items
    return v


def optimizer_state(optimizer, entries: list[Entry]) -> tuple[dict, list[_OptimTensor]]:
    """(the optimizer's index record, its state tensors), keyed by parameter FQN."""
    by_id = {id(e.tensor): e for e in entries}
    sd = optimizer.state_dict()
    param_of = {}
    groups = []
    for gi, (saved, group) in enumerate(zip(sd["param_groups"], optimizer.param_groups)):
        fqns = []
        for i, p in zip(saved["params"], group["params"]):
            e = by_id.get(id(p))
            if e is None:
                raise CheckpointError(
                    f"param_groups[{gi}] of the optimizer holds a parameter of shape "
                    f"{list(p.shape)} that is not one of the sharded module's",
                    where=type(optimizer).__name__,
                    fix="build the optimizer from sharded.parameters(), after parallelize")
            param_of[i] = e
            fqns.append(e.fqn)
        hyper = {k: _to_json(v, f"param_groups[{gi}][{k!r}]") for k, v in saved.items()
                 if k != "params"}
        groups.append({**hyper, "params": fqns})
    state, tensors = {}, []
    for i, st in sd["state"].items():
        e = param_of[i]
        record = {}
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                key = f"optim/{e.fqn}/{name}"
                if tuple(v.shape) == tuple(e.tensor.shape):  # elementwise: the parameter's layout
                    tensors.append(_OptimTensor(key, v, e.layout, e.shape, e.fqn))
                else:
                    tensors.append(_OptimTensor(key, v, Replicate(), tuple(v.shape), e.fqn))
                record[name] = {"tensor": key}
            else:
                record[name] = {"value": _to_json(v, f"optimizer state {e.fqn}[{name!r}]")}
        state[e.fqn] = record
    kind = type(optimizer)
    return {"type": f"{kind.__module__}.{kind.__qualname__}", "param_groups": groups,
            "state": state}, tensors


def optimizer_load(optimizer, record: dict | None, entries: list[Entry], f, file: Path,
                    index: dict) -> dict:
    """The optimizer's ``state_dict`` rebuilt from a checkpoint for its current param order."""
    name = type(optimizer).__name__
    if record is None:
        raise CheckpointError(f"{file.parent} holds no optimizer state", where=str(file.parent),
                              fix="save with save_sharded(..., optimizer=opt), "
                                  "or load without optimizer=")
    kind = type(optimizer)
    if record["type"] != f"{kind.__module__}.{kind.__qualname__}":
        raise CheckpointError(f"the checkpoint holds {record['type']} state, the optimizer is "
                              f"{kind.__module__}.{kind.__qualname__}", where=name,
                              fix="load into the same optimizer class it was saved from")
    saved = record["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint has {len(saved)} param groups, the optimizer "
                              f"{len(optimizer.param_groups)}", where=name,
                              fix="build the optimizer with the same param groups as when saved")
    fqn_of = {id(e.tensor): e.fqn for e in entries}
    sd: dict = {"state": {}, "param_groups": []}
    i = 0
    for gi, (group, sg) in enumerate(zip(optimizer.param_groups, saved)):
        fqns = [fqn_of.get(id(p)) for p in group["params"]]
        if None in fqns:
            raise CheckpointError(f"param_groups[{gi}] of the optimizer holds a parameter that is "
                                  "not one of the sharded module's", where=name,
                                  fix="build the optimizer from sharded.parameters()")
        if sorted(fqns) != sorted(sg["params"]):
            diff = sorted(set(fqns) ^ set(sg["params"]))
            raise CheckpointError(f"param_groups[{gi}] holds other parameters than when saved "
                                  f"(e.g. {diff[:3]})", where=name,
                                  fix="build the optimizer with the same param groups as when saved")
        ids = []
        for fqn in fqns:
            st = record["state"].get(fqn)
            if st is not None:
                sd["state"][i] = {
                    k: (read_tensor(f, v["tensor"], file, index["tensors"][v["tensor"]]["local_shape"])
                        if "tensor" in v else _from_json(v["value"]))
                    for k, v in st.items()}
            ids.append(i)
            i += 1
        hyper = {k: _from_json(v, group.get(k)) for k, v in sg.items() if k != "params"}
        sd["param_groups"].append({**hyper, "params": ids})
    return sd
