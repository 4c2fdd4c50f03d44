"""Agreeing across ranks: a step that fails on one rank raises on every rank."""

from __future__ import annotations

import torch

from ..errors import CheckpointError

_MESSAGE_BYTES = 2048


def agree(sharded, what: str, fn):
    """Run ``fn`` on this rank; raise on every rank if it failed on any.

    One tiny all-gather of success flags; on failure a second one carries
    each failed rank's message, so every rank reports the root cause.
    """
    err = None
    result = None
    try:
        result = fn()
    except Exception as e:  # every rank must reach the exchange below
        err = e
    group, device = sharded.group, _device(sharded)
    flag = torch.tensor([0 if err is None else 1], dtype=torch.int32, device=device)
    failed = [r for r, f in enumerate(group.all_gather(flag, 0).tolist()) if f]
    if not failed:
        return result
    text = b"" if err is None else str(err).encode()[:_MESSAGE_BYTES]
    buf = torch.zeros(1, _MESSAGE_BYTES, dtype=torch.uint8)
    if text:
        buf[0, :len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    messages = group.all_gather(buf.to(device), 0).cpu()
    if err is not None:
        if isinstance(err, CheckpointError):
            raise err
        raise CheckpointError(f"{what} failed on rank {group.rank}: {type(err).__name__}: {err}",
                              fix="see the cause above (disk space, permissions, path)") from err
    first = bytes(messages[failed[0]].tolist()).rstrip(b"\0").decode(errors="replace")
    raise CheckpointError(f"{what} failed on rank{'s' * (len(failed) > 1)} "
                          f"{', '.join(map(str, failed))}: {first}",
                          fix=f"rank {failed[0]}'s error is quoted above; its log has the rest")


def _device(sharded) -> torch.device:
    for t in sharded.parameters():
        if not t.is_meta:
            return t.device
    return torch.device("cpu")
