"""Plan layout strings ("R", "P", "S(0|32+32+32)", ...) read back into their parts,
for the presenters (HTML page, DTensor / Hugging Face export)."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedLayout:
    """A layout string ("R", "P", "S(0)", "S(0|32+32+32)", "S(0|pad50260)", "S(0|x2)") as parts."""

    kind: str  # "R" | "P" | "S" | "?"
    dim: int | None = None
    blocks: tuple[int, ...] | None = None
    padded: int | None = None
    replicas: int = 1
    text: str = ""


_SHARD = re.compile(r"^S\((-?\d+)((?:\|[^|)]*)*)\)$")


def parse_layout(text: str) -> ParsedLayout:
    """Parse a ``Plan`` layout string; unknown forms give ``kind="?"`` (never raise)."""
    text = text.strip()
    if text in ("R", "P"):
        return ParsedLayout(text, text=text)
    m = _SHARD.match(text)
    if not m:
        return ParsedLayout("?", text=text)
    blocks, padded, replicas = None, None, 1
    for part in filter(None, m.group(2).split("|")):
        if part.startswith("pad") and part[3:].isdigit():
            padded = int(part[3:])
        elif part.startswith("x") and part[1:].isdigit():
            replicas = int(part[1:])
        elif re.fullmatch(r"\d+(\+\d+)*", part):
            blocks = tuple(int(b) for b in part.split("+"))
        else:
            return ParsedLayout("?", text=text)
    return ParsedLayout("S", int(m.group(1)), blocks, padded, replicas, text)
