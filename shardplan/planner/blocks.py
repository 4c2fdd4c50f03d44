"""Block indices in dotted names, and lists of identical blocks folded into one.

A block index is an all-digit part of a module or parameter path:
``layers.3.attn.wq.weight`` is block 3 of the list ``layers``. The planner
stamps a captured middle block onto blocks 1..N-2 (``index_in``, ``with_index``);
the presenters fold identical blocks into one line or box (``runs`` for
consecutive blocks, ``fold`` and ``pattern`` for ``*`` patterns,
``span_text`` for their index ranges). Names only: nothing here knows a plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Iterable, TypeVar

T = TypeVar("T")

_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def pattern(name: str) -> str:
    """``name`` with every block index replaced by ``*``: ``layers.*.attn.wq``."""
    return _INDEX.sub(".*", name)


def indices(name: str) -> tuple[int, ...]:
    """The block indices in ``name``, outermost first."""
    return tuple(int(i) for i in _INDEX.findall(name))


def split_first(name: str) -> tuple[str, int, str] | None:
    """``(list path, index, rest)`` of the outermost block: ``("layers", 3, "attn.wq")``."""
    m = _INDEX.search(name)
    if m is None:
        return None
    return name[:m.start()], int(m.group(1)), name[m.end() + 1:]


def index_in(name: str, list_path: str) -> int | None:
    """The index of the block of list ``list_path`` that ``name`` lies in, if any."""
    head = list_path + "."
    if not name.startswith(head):
        return None
    first, _, _ = name[len(head):].partition(".")
    return int(first) if first.isdigit() and first == str(int(first)) else None


def with_index(name: str, list_path: str, index: int) -> str:
    """``name`` moved to block ``index`` of list ``list_path`` (``name`` must lie in one)."""
    head = list_path + "."
    _, dot, rest = name[len(head):].partition(".")
    return f"{head}{index}{dot}{rest}"


def instances(pat: str, names: Iterable[str]) -> list[str]:
    """The names that ``pattern`` folds into ``pat``."""
    rx = re.compile("^" + re.escape(pat).replace(r"\*", r"\d+") + "$")
    return [n for n in names if rx.match(n)]


@dataclass
class Run(Generic[T]):
    """Consecutive blocks ``first..last`` that are alike; ``item`` stands for all of them."""

    first: int
    last: int
    item: T

    @property
    def count(self) -> int:
        return self.last - self.first + 1


def runs(blocks: Iterable[tuple[int, Hashable, T]]) -> list[Run[T]]:
    """Fold ``(index, signature, item)`` triples, in order: a block whose index follows
    the previous run's last and whose signature equals it joins that run."""
    out: list[Run[T]] = []
    last_sig = None
    for index, sig, item in blocks:
        if out and sig == last_sig and index == out[-1].last + 1:
            out[-1].last = index
            continue
        out.append(Run(index, index, item))
        last_sig = sig
    return out


@dataclass
class Fold(Generic[T]):
    """Items whose names differ only in block indices and that are alike otherwise."""

    name: str  # the pattern (``*`` for indices), or the one item's own name
    indices: list[tuple[int, ...]] | None  # each item's block indices; None: a single item
    item: T  # the first item


def fold(items: Iterable[T], name: Callable[[T], str],
         key: Callable[[T], Hashable]) -> list[Fold[T]]:
    """Group ``items`` by (``pattern(name(item))``, ``key(item)``), in first-appearance order."""
    groups: dict = {}
    for it in items:
        n = name(it)
        groups.setdefault((pattern(n), key(it)), []).append((n, it))
    out = []
    for (pat, _), members in groups.items():
        if len(members) == 1:
            out.append(Fold(members[0][0], None, members[0][1]))
        else:
            out.append(Fold(pat, [indices(n) for n, _ in members], members[0][1]))
    return out


def span_text(numbers: Iterable[int]) -> str:
    """``"0-79, 83"``: sorted distinct numbers as ranges."""
    nums = sorted(set(numbers))
    spans: list[tuple[int, int]] = []
    for i in nums:
        if spans and i == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], i)
        else:
            spans.append((i, i))
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)
