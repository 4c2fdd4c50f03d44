"""Checks of the values users pass: a bad one raises ``ConfigurationError`` naming the
argument, its value, what is allowed and the fix (``fix``: advice other than "pass it
as one"). ``where`` names the entry point (``generate``, ``plan``). A bool is not
accepted as a number, nor a number as a bool."""

from __future__ import annotations

import math
from numbers import Real

from .errors import ConfigurationError


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(name: str, value, low: int, *, where: str, high: int | None = None,
            optional: bool = False, fix: str | None = None) -> None:
    """``value`` an int in ``[low, high)`` (no upper bound without ``high``), or None where
    ``optional``."""
    if optional and value is None:
        return
    if not is_int(value) or value < low or (high is not None and value >= high):
        allowed = f"in [{low}, {high})" if high is not None else f">= {low}"
        _refuse(name, value, f"an integer {allowed}", where, optional, fix)


def number(name: str, value, low: float, high: float = math.inf, *, where: str,
           low_open: bool = False, optional: bool = False, fix: str | None = None) -> None:
    """``value`` a finite real number (not a bool) in the interval from ``low`` (excluded
    where ``low_open``) to ``high`` (included), or None where ``optional``."""
    if optional and value is None:
        return
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > low if low_open else value >= low) and value <= high
    if not ok:
        interval = f"in {'(' if low_open else '['}{low}, {high}]" if high != math.inf else \
            f"{'>' if low_open else '>='} {low}"
        _refuse(name, value, f"a finite number {interval}", where, optional, fix)


def flag(name: str, value, *, where: str) -> None:
    """``value`` True or False."""
    if not isinstance(value, bool):
        _refuse(name, value, "True or False", where, False)


def choice(name: str, value, allowed, *, where: str, optional: bool = False,
           fix: str | None = None) -> None:
    """``value`` one of the names ``allowed``, or None where ``optional``."""
    if optional and value is None:
        return
    if not isinstance(value, str) or value not in allowed:
        _refuse(name, value, f"one of {', '.join(map(repr, allowed))}", where, optional, fix)


def _refuse(name: str, value, allowed: str, where: str, optional: bool,
            fix: str | None = None):
    allowed += " or None" if optional else ""
    raise ConfigurationError(f"{name}={value!r} is not {allowed}", where=where,
                             fix=fix or f"pass {name} as {allowed}")
