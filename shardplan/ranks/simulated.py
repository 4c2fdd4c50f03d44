"""N ranks as N threads of this process.

On CPU, autograd runs a backward pass on the thread that calls it, so
collectives inside backward rendezvous like those in forward. The threads
share torch's default CPU generator: code whose result depends on random
numbers drawn inside the ranks (dropout) belongs on ``RealRanks``. They also
share every object they are given: give each rank its own copy of a model
(``copy.deepcopy``), or its replicated parameters are one object on all ranks.
The ranks of one ``run()`` share their captures: a rank capturing a model of
the same structure, called the same way, as another rank did gets a copy of
that capture reading its own model's tensors (``planner.shared_capture``).
When the calling thread is ``sharing`` a share, the runs use that one instead:
captures then carry over from run to run (see ``CaptureShare`` on when that is
safe).

``timeout`` bounds each collective's wait for the other ranks (the error
names the collective and the ranks that never arrived); ``run()`` gives up
when no rank has entered, left or finished a collective or ``fn`` for
``timeout`` (plus a short grace), as when a rank is stuck outside collectives.
"""

from __future__ import annotations

import threading
import time

from ..errors import CommunicationError
from ..planner.shared_capture import CaptureShare, active, sharing
from ..runtime.comm import Rendezvous, ThreadGroup
from .base import RankContext, Ranks, check_world_size, grace, root_cause


class SimulatedRanks(Ranks):
    def __init__(self, world_size: int, timeout: float = 120.0):
        check_world_size(world_size)
        self.world_size, self.timeout = world_size, timeout

    def run(self, fn, *args):
        n = self.world_size
        rv = Rendezvous(n, timeout=self.timeout)
        results: list = [None] * n
        errors: dict[int, BaseException] = {}
        share = active() or CaptureShare()

        def body(rank: int) -> None:
            try:
                ctx = RankContext(rank, n, ThreadGroup(rank, rv))
                with sharing(share):
                    results[rank] = fn(ctx, *args)
                rv.returned.add(rank)
            except BaseException as e:  # reported below, in the caller's thread
                e.add_note(f"[simulated rank {rank}]")
                errors[rank] = e
                rv.abort(rank)
            rv.progress = time.monotonic()

        threads = [threading.Thread(target=body, args=(r,), daemon=True,
                                    name=f"shardplan-rank{r}") for r in range(n)]
        for t in threads:
            t.start()
        limit = self.timeout + grace(self.timeout)
        for t in threads:
            while t.is_alive() and time.monotonic() - rv.progress < limit:
                t.join(max(0.01, rv.progress + limit - time.monotonic()))
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        if stuck:
            rv.abort()
            raise CommunicationError(
                f"simulated ranks {stuck} did not finish: no rank entered or left a collective "
                f"for {self.timeout:g}s",
                fix="a rank is stuck outside a collective (in fn); raise the timeout for slow work")
        if errors:
            raise root_cause(errors)
        return results
