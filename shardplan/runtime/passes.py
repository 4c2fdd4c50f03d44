"""Inductor has one slot for a custom post-grad pass; ``PostGradPasses`` fills it
with several, run in order (shardplan's compile: ``runtime.onednn``'s GEMMs when
oneDNN is available, then ``runtime.overlap``'s reordering)."""

from __future__ import annotations

import hashlib

import torch.fx as fx

from ..torch_compat import CustomGraphPass


class PostGradPasses(CustomGraphPass):
    def __init__(self, *passes: CustomGraphPass):
        self.passes = passes

    def __call__(self, graph: fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> bytes:
        """Inductor's cache key: the passes' own, in order."""
        h = hashlib.sha256()
        for p in self.passes:
            u = p.uuid()
            h.update(u if isinstance(u, bytes) else str(u).encode())
        return h.digest()
