"""Two ways to run all ranks of a group behind one interface.

``SimulatedRanks(n)`` runs n threads in this process over an in-process
collective backend (fast; what ``shardplan.verify`` uses). ``RealRanks(n)``
keeps n gloo worker processes alive (what proves the torch.distributed path).
Both run ``fn(ctx, *args)`` on every rank and return the per-rank results.
"""

from .base import RankContext, Ranks
from .real import RealRanks
from .simulated import SimulatedRanks

__all__ = ["RankContext", "Ranks", "RealRanks", "SimulatedRanks"]
