"""Ranks that agree: on an error (the one protocol), on the model, on replicas.

``agree(group, what, fn)`` is how shardplan makes every rank of a group raise
together: each rank runs ``fn``, one tiny all-gather of success flags tells
every rank who failed, and a second one (only then) carries each failed
rank's message, so the ranks that did not fail raise an error quoting the
root cause instead of waiting in the next collective. Their error is marked
``secondary`` (``runtime.comm``), so the rank runners report the failed
rank's own error first. The model and replica checks below and the
trainer's world-wide replica check go through it.

The checks: each rank reduces every tensor to a fingerprint (float64 sum and
sum of squares), rank 0's fingerprints are broadcast, every rank compares,
and ``agree`` makes every rank raise, naming the first tensor that differs.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
from torch.distributed.tensor import DTensor

from ..errors import CommunicationError, ShardplanError
from .comm import Group

T = TypeVar("T")

#: how much of a failed rank's message travels to its peers
MESSAGE_BYTES = 2048


def agree(group: Group, what: str, fn: Callable[[], T], *,
          error: type[ShardplanError] = CommunicationError,
          fix: str = "see the cause above") -> T:
    """``fn()`` on this rank; if it raised on any rank of ``group``, raise on every rank.

    A failed rank re-raises its own error when it is a ``ShardplanError``,
    else an ``error`` naming ``what``, the rank and ``fix``, from it. The other
    ranks raise a secondary ``error`` quoting the lowest failed rank's message.
    Collective: every rank of ``group`` must call it with the same ``what``.
    """
    err: Exception | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # every rank must reach the exchange below
        err = e
    flag = torch.tensor([0 if err is None else 1], dtype=torch.int32, device=group.device)
    failed = [r for r, f in enumerate(group.all_gather(flag, 0, site=what).tolist()) if f]
    if not failed:
        return result
    text = b"" if err is None else str(err).encode()[:MESSAGE_BYTES]
    buf = torch.zeros(1, MESSAGE_BYTES, dtype=torch.uint8)
    if text:
        buf[0, :len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    messages = group.all_gather(buf.to(group.device), 0, site=what).cpu()
    if err is not None:
        if isinstance(err, ShardplanError):
            raise err
        raise error(f"{what} failed on rank {group.rank}: {type(err).__name__}: {err}",
                    fix=fix) from err
    first = bytes(messages[failed[0]].tolist()).rstrip(b"\0").decode(errors="replace")
    peer = error(f"{what} failed on rank{'s' * (len(failed) > 1)} "
                 f"{', '.join(map(str, failed))}: {first}",
                 fix=f"rank {failed[0]}'s error is quoted above; its log has the rest")
    peer.secondary = True
    raise peer


def fingerprints(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(n, 2) float64: sum and sum of squares of each tensor (meta tensors give zeros)."""
    rows = []
    for t in tensors:
        if isinstance(t, DTensor):  # FSDP2's shard: this rank's part
            t = t.to_local()
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

    def compare():
        if differs.any():
            name = names[int(differs.nonzero()[0])]
            raise CommunicationError(f"{what}: {name!r} differs between ranks",
                                     where=name, fix=fix)

    agree(group, "consistency check", compare)


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
