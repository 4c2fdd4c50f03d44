"""N ranks as N threads of this process.

On CPU, autograd runs a backward pass on the thread that calls it, so
collectives inside backward rendezvous like those in forward. The threads
share torch's default CPU generator: code whose result depends on random
numbers drawn inside the ranks (dropout) belongs on ``RealRanks``. They also
share every object they are given: give each rank its own copy of a model
(``copy.deepcopy``), or its replicated parameters are one object on all ranks.
"""

from __future__ import annotations

import threading

from ..errors import CommunicationError
from ..runtime.comm import Rendezvous, ThreadGroup
from .base import RankContext, Ranks


class SimulatedRanks(Ranks):
    def __init__(self, world_size: int, timeout: float = 120.0):
        self.world_size, self.timeout = world_size, timeout

    def run(self, fn, *args):
        n = self.world_size
        rv = Rendezvous(n, timeout=self.timeout)
        results: list = [None] * n
        errors: list[BaseException | None] = [None] * n

        def body(rank: int) -> None:
            try:
                ctx = RankContext(rank, n, ThreadGroup(rank, rv))
                results[rank] = fn(ctx, *args)
            except BaseException as e:  # reported below, in the caller's thread
                e.add_note(f"[simulated rank {rank}]")
                errors[rank] = e
                rv.abort()

        threads = [threading.Thread(target=body, args=(r,), daemon=True,
                                    name=f"shardplan-rank{r}") for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout)
        if any(t.is_alive() for t in threads):
            rv.abort()
            raise CommunicationError(
                f"simulated ranks did not finish within {self.timeout}s",
                fix="a rank is stuck outside a collective; raise the timeout or check fn")
        _raise_first(errors)
        return results


def _raise_first(errors: list[BaseException | None]) -> None:
    """Raise the root cause: a rank's own error before its peers' broken barriers."""
    failed = [e for e in errors if e is not None]
    if not failed:
        return
    own = [e for e in failed if not isinstance(e, CommunicationError)]
    raise (own or failed)[0]
