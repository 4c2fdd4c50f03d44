"""Rule sets: the Megatron strategy and per-op layout rules, loaded as data.

A rule set is a TOML file (see ``shardplan/rules/megatron.toml``), parsed and
validated; nothing in it is executed. ``load_rules("megatron")`` loads a
bundled set, ``load_rules(path)`` a user's. Beyond its schema, a rule set must
be of a version this shardplan reads, name only ATen ops this torch has, list
each op under one registered kind (``kinds.KINDS``) that can read its
arguments, and give every opener an einsum signature holding its factor.
"""

from __future__ import annotations

import importlib.resources
import re
import sys
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import RuleError
from .kinds import KINDS
from ..torch_compat import OpOverloadPacket

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_SIG = re.compile(r"^(\.\.\.)?[a-z]*(,(\.\.\.)?[a-z]*)*->(\.\.\.)?[a-z]*$")
_REDUCE_DIM = re.compile(r"^(\d+|last:\d+|all)$")
VERSIONS = (1,)  # the rule-file versions this shardplan reads


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Opener(_Strict):
    op: str
    weight: int
    factor: str = Field(pattern=r"^[a-z]$")


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
    # op -> the operand positions it is linear in: a partial sum read there stays partial
    partial_through: dict[str, list[int]] = {}
    # sums: partial when every operand is (their g's become one)
    partial_sums: list[str] = []


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
    # over a split dim: "sum" (this rank's sum is a summand of the whole one), "mean"
    # (this rank's mean over 1/tp of the elements, divided by tp, is one) or "max" (the
    # max of the ranks' maxima, for an input that needs no gradient); None: none of these
    distributed: Literal["sum", "mean", "max"] | None = None

    @field_validator("dim")
    @classmethod
    def _parse(cls, v: str) -> str:
        if not _REDUCE_DIM.match(v):
            raise ValueError(f"bad reduce dim {v!r}: expected 'N' (argument N holds the dims), "
                             "'last:N' (the last len(argument N) dims) or 'all'")
        return v


class RuleSet(_Strict):
    name: str
    version: int
    strategy: Strategy
    einsum: dict[str, Einsum] = {}
    ops: dict[str, list[str]] = {}  # kind name (kinds.KINDS) -> the ops it covers
    reduce: dict[str, Reduce] = {}

    def kind(self, op: str) -> str | None:
        """The rule kind covering ``op`` (an ATen overload name), if any."""
        if op in self.einsum:
            return "einsum"
        if op in self.reduce:
            return "reduce"
        for kind, ops in self.ops.items():
            if op in ops:
                return kind
        return None


def _bundled_dir():
    """The bundled rule files (package data of ``shardplan.rules``)."""
    return importlib.resources.files("shardplan.rules")


def load_rules(rules: str | Path | RuleSet = "megatron") -> RuleSet:
    """A bundled rule set by name, or a rule file by path."""
    if isinstance(rules, RuleSet):
        _check(rules, f"rule set {rules.name!r}")
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
            raise RuleError(f"cannot read rule file: {e}", where=str(path),
                            fix="check the path (relative paths start from the working "
                                "directory), or pass a bundled rule set's name, e.g. "
                                "'megatron'") from e
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RuleError(f"rule file does not parse: {e}", where=where,
                        fix="fix the TOML syntax at that line") from e
    _check_version(data.get("version"), where)  # before the schema, which may differ
    try:
        ruleset = RuleSet.model_validate(data)
    except ValidationError as e:
        raise RuleError(f"rule file is not a valid rule set:\n{e}", where=where,
                        fix="compare with the bundled shardplan/rules/megatron.toml") from e
    _check(ruleset, where)
    return ruleset


def _check_version(version, where: str) -> None:
    if isinstance(version, int) and version not in VERSIONS:
        raise RuleError(f"rule file of version {version}; this shardplan reads version "
                        f"{' or '.join(map(str, VERSIONS))}", where=where,
                        fix="write the rules for a supported version (compare with the bundled "
                            "shardplan/rules/megatron.toml), or use the shardplan release they "
                            "were written for")


def _check(rules: RuleSet, where: str) -> None:
    """What the schema cannot see: version, op names, one kind per op, openers."""
    _check_version(rules.version, where)
    strategy = rules.strategy
    named = [o.op for o in strategy.open] + list(strategy.random) + list(strategy.partial_through) \
        + strategy.partial_sums
    named += [s.op for s in (strategy.vocab_embedding, strategy.vocab_loss) if s is not None]
    tabled = {"einsum", "reduce"}  # kinds whose ops carry parameters, in their own tables
    for kind in rules.ops:
        if kind not in KINDS or kind in tabled:
            raise RuleError(f"[ops] lists an unknown kind {kind!r}", where=where,
                            fix="use one of " + ", ".join(sorted(set(KINDS) - tabled)) +
                                " (einsum and reduce ops have their own tables)")
    tables: dict[str, Iterable[str]] = {"einsum": rules.einsum, "reduce": rules.reduce, **rules.ops}
    kinds: dict[str, list[str]] = {}  # op -> the kinds listing it
    for kind, ops in tables.items():
        for op in dict.fromkeys(ops):
            kinds.setdefault(op, []).append(kind)
    for op in dict.fromkeys(named + list(kinds)):
        _check_op_name(op, where)
    for op, listed in kinds.items():
        if len(listed) > 1:
            raise RuleError(f"{op} is listed under {len(listed)} kinds: {' and '.join(listed)}",
                            where=where,
                            fix=f"keep {op} under the one kind that describes it and delete "
                                "the other entries")
        _check_readable(op, listed[0], where)
    for op, einsum in rules.einsum.items():
        letters = set(einsum.sig) - set(".,->")
        stray = sorted(set(einsum.shardable or "") - letters - {"."})
        if stray:
            raise RuleError(f"einsum rule of {op}: shardable {einsum.shardable!r} names "
                            f"{', '.join(map(repr, stray))}, not a factor of {einsum.sig!r}",
                            where=where,
                            fix="list in shardable only letters of the signature ('.' for the "
                                "'...' dims)")
    for o in strategy.open:
        es = rules.einsum.get(o.op)
        if es is None:
            raise RuleError(f"opener {o.op} (strategy.open) has no einsum signature",
                            where=where,
                            fix=f'add "{o.op}" = {{ sig = "..." }} under [einsum] (see '
                                "shardplan/rules/megatron.toml), or remove it from strategy.open")
        if not 0 <= o.weight < len(es.operands):
            raise RuleError(f"opener {o.op}: weight = {o.weight}, but its einsum signature "
                            f"{es.sig!r} has {len(es.operands)} operands", where=where,
                            fix="set weight to the position of the weight among the operands, "
                                "counting from 0")
        if o.factor not in es.operands[o.weight] or o.factor not in es.output:
            raise RuleError(f"opener {o.op}: factor {o.factor!r} is not a dim of both its weight "
                            f"({es.operands[o.weight]!r}) and its output ({es.output!r}) in "
                            f"{es.sig!r}", where=where,
                            fix="set factor to the letter of the output features that the "
                                "column-parallel split cuts, e.g. 'n' in '...k,nk,n->...n'")


def _check_op_name(op: str, where: str) -> None:
    """An ``aten.`` name must be an ATen overload of this torch: a misspelt one never matches."""
    parts = op.split(".")
    if parts[0] != "aten":
        return
    packet = getattr(torch.ops.aten, parts[1], None) if len(parts) > 1 else None
    if not isinstance(packet, OpOverloadPacket):
        raise RuleError(f"{op} is not an ATen operator of torch {torch.__version__}", where=where,
                        fix="spell the op as torch.export writes it, aten.<op>.<overload> "
                            "(e.g. aten.linear.default), or delete the entry")
    if len(parts) != 3 or parts[2] not in packet.overloads():
        overloads = ", ".join(f"aten.{parts[1]}.{o}" for o in packet.overloads()
                              if not o.endswith("out"))  # export never writes out= variants
        what = f"{op} names no overload" if len(parts) == 2 else \
            f"{op} is not an overload of aten.{parts[1]}"
        raise RuleError(what, where=where, fix=f"name one overload: {overloads}")


def _check_readable(op: str, kind: str, where: str) -> None:
    """The kind an op is listed under must be able to read its arguments."""
    overload = _overload(op)
    if overload is None or KINDS[kind].reads(overload):
        return
    able = [k for k, obj in KINDS.items() if obj.reads(overload)]
    raise RuleError(f"{op} is listed under {kind}, which cannot read its arguments",
                    where=where,
                    fix=(f"list it under a kind that reads it ({', '.join(able)})" if able else
                         "no kind reads it: delete the entry (an unlisted op keeps its region "
                         "replicated)"))


def _overload(op: str):
    """The OpOverload named ``ns.op.overload``, if this torch has it."""
    ns, _, rest = op.partition(".")
    name, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, ns, None), name, None)
    return getattr(packet, overload, None) if overload and packet is not None else None
