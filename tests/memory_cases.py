"""Per-rank peak memory while loading a full checkpoint into a meta-built sharded model."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

import shardplan
from shardplan import checkpoint
from shardplan.models import build

CONFIG = dict(vocab_size=4096, block_size=64, n_layer=8, n_head=8, n_embd=512)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def load_peak(ctx, file: str) -> tuple[int, int]:
    """(peak growth of anonymous memory while loading, bytes this rank holds afterwards).

    Anonymous memory, sampled every millisecond: the file's pages that the
    memory map touches are page cache, not the process's own memory.
    """
    model = build("gpt-tiny", device="meta", **CONFIG)
    sharded = shardplan.parallelize(model, group=ctx.group,
                                    example_inputs=torch.zeros(2, 8, dtype=torch.long))
    before = _status("RssAnon")
    peak, done = [before], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _status("RssAnon"))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        checkpoint.load_full_state_dict(sharded, file)
    finally:
        done.set()
        sampler.join()
    peak[0] = max(peak[0], _status("RssAnon"))
    held = sum(p.numel() * p.element_size() for p in sharded.parameters())
    return peak[0] - before, held
