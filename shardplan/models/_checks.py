"""Checks the bundled model configs run on construction: sizes that build a model."""

import math

from ..errors import ConfigurationError


def counts(config, positive: tuple[str, ...], non_negative: tuple[str, ...] = ()) -> None:
    """Each named field an integer, >= 1 for ``positive``, >= 0 for ``non_negative``."""
    for names, low in ((positive, 1), (non_negative, 0)):
        for name in names:
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigurationError(
                    f"{type(config).__name__}: {name}={value!r} is not an integer >= {low}",
                    where=type(config).__name__, fix=f"pass {name} as an integer >= {low}")


def divides(config, whole: str, part: str) -> None:
    """Field ``part`` divides field ``whole``."""
    w, p = getattr(config, whole), getattr(config, part)
    if w % p:
        small = [d for d in range(1, math.isqrt(w) + 1) if w % d == 0]
        fitting = ", ".join(map(str, sorted({*small, *(w // d for d in small)})))
        raise ConfigurationError(
            f"{type(config).__name__}: {whole}={w} is not divisible by {part}={p}",
            where=type(config).__name__,
            fix=f"pick {part} among the divisors of {whole} ({fitting}), or make {whole} a "
                f"multiple of {p}")


def require(config, ok: bool, what: str, fix: str) -> None:
    """A ConfigurationError about ``config`` unless ``ok``."""
    if not ok:
        name = type(config).__name__
        raise ConfigurationError(f"{name}: {what}", where=name, fix=fix)
