"""Rule sets: the Megatron strategy and per-op layout rules, loaded as data.

A rule set is a TOML file (see ``rules/megatron.toml``), parsed and
validated; nothing in it is executed. ``load_rules("megatron")`` loads a
bundled set, ``load_rules(path)`` a user's.
"""

from __future__ import annotations

import importlib.resources
import re
import sys
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from .errors import RuleError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_SIG = re.compile(r"^(\.\.\.)?[a-z]*(,(\.\.\.)?[a-z]*)*->(\.\.\.)?[a-z]*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Opener(_Strict):
    op: str
    weight: int
    factor: str


class VocabEmbedding(_Strict):
    op: str
    weight: int
    indices: int
    min_rows_per_column: float = 1.0


class VocabLoss(_Strict):
    op: str
    logits: int
    target: int
    weight: int
    reduction: int
    ignore_index: int
    label_smoothing: int


class Strategy(_Strict):
    open: list[Opener]
    vocab_embedding: VocabEmbedding | None = None
    vocab_loss: VocabLoss | None = None
    pad_vocabulary: bool = True
    random: dict[str, int] = {}  # op -> position of its probability argument


class Einsum(_Strict):
    sig: str
    partial: bool = False
    shardable: str | None = None  # letters that may be sharded; "." = the "..." dims

    @field_validator("sig")
    @classmethod
    def _parse(cls, v: str) -> str:
        v = v.replace(" ", "")
        if not _SIG.match(v):
            raise ValueError(f"bad signature {v!r}: expected like '...k,nk,n->...n'")
        return v

    @property
    def operands(self) -> list[str]:
        return self.sig.split("->")[0].split(",")

    @property
    def output(self) -> str:
        return self.sig.split("->")[1]


class Reduce(_Strict):
    dim: str  # "N" (argument N holds the dims), "last:N", or "all"


class Ops(_Strict):
    elementwise: list[str] = []
    identity: list[str] = []
    reshape: list[str] = []
    permute: list[str] = []
    expand: list[str] = []
    split: list[str] = []
    slice: list[str] = []
    concat: list[str] = []
    inspect: list[str] = []
    size: list[str] = []


class RuleSet(_Strict):
    name: str
    version: int
    strategy: Strategy
    einsum: dict[str, Einsum] = {}
    ops: Ops = Ops()
    reduce: dict[str, Reduce] = {}

    def kind(self, op: str) -> str | None:
        """The rule kind covering ``op`` (an ATen overload name), if any."""
        if op in self.einsum:
            return "einsum"
        if op in self.reduce:
            return "reduce"
        for kind in Ops.model_fields:
            if op in getattr(self.ops, kind):
                return kind
        return None


def _bundled_dir():
    """rules/ as installed into the package, or beside it in a source checkout."""
    try:
        return importlib.resources.files("shardplan.rules")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "rules"


def load_rules(rules: str | Path | RuleSet = "megatron") -> RuleSet:
    """A bundled rule set by name, or a rule file by path."""
    if isinstance(rules, RuleSet):
        return rules
    return _load(str(rules))


@lru_cache(maxsize=None)
def _load(rules: str) -> RuleSet:
    path = Path(rules)
    if path.suffix != ".toml":
        bundled = _bundled_dir() / f"{rules}.toml"
        if not bundled.is_file():
            raise RuleError(f"no bundled rule set named {rules!r}",
                            fix="use 'megatron' or the path of a .toml rule file")
        text, where = bundled.read_text(), f"bundled rules {rules!r}"
    else:
        try:
            text, where = path.read_text(), str(path)
        except OSError as e:
            raise RuleError(f"cannot read rule file: {e}", where=str(path)) from e
    try:
        return RuleSet.model_validate(tomllib.loads(text))
    except tomllib.TOMLDecodeError as e:
        raise RuleError(f"rule file does not parse: {e}", where=where,
                        fix="fix the TOML syntax at that line") from e
    except ValidationError as e:
        raise RuleError(f"rule file is not a valid rule set:\n{e}", where=where,
                        fix="compare with the bundled rules/megatron.toml") from e
