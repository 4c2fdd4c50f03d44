"""The interface both rank runners implement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..runtime.comm import Group


@dataclass
class RankContext:
    """What a function running on one rank gets to know about it."""

    rank: int
    world_size: int
    group: Group  # the group of all ranks of this runner


class Ranks:
    """Runs a function on every rank; results come back in rank order."""

    world_size: int

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        raise NotImplementedError

    def close(self) -> None:
        """Release workers, if any."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
