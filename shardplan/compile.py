"""``parallelize(..., compile=...)``: each rewritten graph under ``torch.compile``.

A sharded module hands every graph it makes to its ``GraphCompiler``, which
compiles it in place (``compile_graph``) and remembers the units per way of
calling; before a call it installs the model-parallel RNG tracker a compiled
graph reads but cannot install.
"""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from .errors import ConfigurationError
from .parallel.fsdp import OwnedPiece
from .planner.recompute import Recomputed
from .runtime.graph_ops import ModelParallelRNG
from .runtime.onednn import OneDnnGemms
from .runtime.overlap import OverlapCollectives
from .runtime.passes import PostGradPasses
from .runtime.random import tracker_for
from .runtime.region_random import DRAWS


class GraphCompiler:
    """Compiles a sharded module's graphs with one backend, as they are made."""

    def __init__(self, backend: str | bool):
        #: torch.compile's backend (``compile=True``: inductor)
        self.backend = "inductor" if backend is True else backend
        #: what ``compile_graph`` compiled for each way of calling (call key -> modules)
        self.units: dict = {}
        self.draws = False  # a compiled graph draws from the model-parallel stream

    def compile(self, key, gm: fx.GraphModule) -> None:
        """Compile ``gm``, the graph of the way of calling ``key``, in place."""
        self.units[key] = compile_graph(gm, self.backend)
        self.draws |= any(isinstance(m, ModelParallelRNG) for m in gm.modules())

    def before_call(self, rank: int) -> None:
        """Install this rank's RNG tracker: a compiled graph reads its state but cannot
        install one."""
        if self.draws:
            tracker_for(rank)


def compile_graph(gm: fx.GraphModule, backend: str) -> list[nn.Module]:
    """``torch.compile`` ``gm`` in place, each unit as one graph (``fullgraph``), and
    return the units: every block's piece when the graph is cut into blocks
    (recomputation or FSDP2: torchtitan's per-block compile, the glue between blocks
    and FSDP2's hooks stay eager), else the whole graph. Batch and sequence become
    dynamic on the first call with other sizes (one recompile). Dropout draws the
    masks eager draws: the model-parallel stream through ``region_random``, the
    replicated one through torch's generator (inductor's ``fallback_random``). Under
    inductor the forward and input-gradient GEMMs run on oneDNN (``runtime.onednn``)
    and each collective overlaps the compute that does not need it
    (``runtime.overlap``)."""
    fork = [name for name, m in gm.named_modules()
            if isinstance(m, ModelParallelRNG) and not m.traceable]
    if fork:
        raise ConfigurationError(
            f"compile: {fork[0]} runs {gm.get_submodule(fork[0]).op} on the model-parallel RNG "
            f"stream by swapping generators, which torch.compile cannot trace (only "
            f"{', '.join(DRAWS)} have a traceable form)",
            fix="remove that op from the rule file's random table, call eval(), or pass "
                "compile=False")
    units = [m.block for m in gm.modules() if isinstance(m, Recomputed)]
    units += [m.piece for m in gm.modules()
              if isinstance(m, OwnedPiece) and not isinstance(m.piece, Recomputed)]
    # inductor draws replicated-stream dropout from its own generator unless told to call
    # torch's: with the fallback a compiled model draws the masks an eager one draws;
    # forward and input-gradient GEMMs run on oneDNN (runtime/onednn.py); each
    # collective overlaps the compute that does not need it (runtime/overlap.py), in
    # the order that pass leaves (inductor's peak-memory reordering would undo it)
    passes = PostGradPasses(OneDnnGemms(), OverlapCollectives())
    options = ({"fallback_random": True, "post_grad_custom_post_pass": passes,
                "reorder_for_peak_memory": False} if backend == "inductor" else None)
    for unit in units or [gm]:
        unit.compile(fullgraph=True, backend=backend, options=options)
    return units or [gm]
