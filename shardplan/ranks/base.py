"""The interface both rank runners implement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConfigurationError
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


def check_world_size(world_size) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigurationError(f"world_size must be >= 1, got {world_size!r}",
                                 fix="pass the number of ranks to run as a positive integer, "
                                     "e.g. 2")


def grace(timeout: float) -> float:
    """How long to wait past ``timeout`` so the collectives' own timeouts report first."""
    return min(2.0, max(0.5, 0.1 * timeout))


def root_cause(errors: dict[int, BaseException]) -> BaseException:
    """The error to report of several (by rank): a rank's own error before the
    ``secondary`` ones it caused in its peers (``runtime.comm``), then the lowest rank."""
    return errors[min(errors, key=lambda r: (getattr(errors[r], "secondary", False), r))]
