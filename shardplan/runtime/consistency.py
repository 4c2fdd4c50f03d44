"""Cheap checks that ranks agree: same model before sharding, same replicas after.

Each rank reduces every tensor to a fingerprint (float64 sum and sum of
squares), rank 0's fingerprints are broadcast, and every rank compares; a
flag all-reduce makes every rank raise together, naming the first tensor
that differs.
"""

from __future__ import annotations

import torch

from ..errors import CommunicationError
from .comm import Group


def fingerprints(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(n, 2) float64: sum and sum of squares of each tensor (meta tensors give zeros)."""
    rows = []
    for t in tensors:
        if t.is_meta:
            rows.append(torch.zeros(2, dtype=torch.float64))
            continue
        x = t.detach().to(torch.float64).cpu()
        rows.append(torch.stack([x.sum(), x.square().sum()]))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)


def assert_same_across(group: Group, named: dict[str, torch.Tensor], *, what: str,
                       fix: str) -> None:
    """Raise ``CommunicationError`` on every rank if any tensor differs from rank 0's."""
    if group.size == 1 or not named:
        return
    names = list(named)
    mine = fingerprints([named[n] for n in names]).to(group.device)
    ref = group.broadcast(mine, 0, site="consistency check")
    differs = ~torch.isclose(mine, ref, rtol=1e-12, atol=0.0).all(dim=1)
    first = int(differs.nonzero()[0]) if differs.any() else len(names)
    worst = group.all_reduce(torch.tensor([-first], dtype=torch.float64, device=group.device),
                             "max", site="consistency check")
    index = int(-worst.cpu().item())
    if index < len(names):
        raise CommunicationError(f"{what}: {names[index]!r} differs between ranks",
                                 where=names[index], fix=fix)


def check_replicas(sharded) -> None:
    """Are the replicated parameters of a parallelized model still identical on every rank?

    Replicas drift apart silently when a gradient is not all-reduced where it
    should be; call this every N steps (the training entry point does).
    """
    from ..layouts import Replicate
    named = {n: p for n, p in sharded.named_parameters()
             if isinstance(sharded.layouts.get(n), Replicate)}
    assert_same_across(sharded.group, named, what="replicated parameters drifted",
                       fix="a gradient is missing its all-reduce, or ranks stepped differently; "
                           "report the parameter with its plan (sharded.plan.report())")
