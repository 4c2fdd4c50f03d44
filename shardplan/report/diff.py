"""What changed between two plans: tp=4 vs tp=8, or a model before and after an edit.

``compare_plans(a, b)`` gives a ``PlanDiff`` (data); ``diff_plans(a, b)`` its text.
Compared:

- the mesh: the size of each dimension;
- parameters: layout (per mesh dim) and rank-local shape per name (added / removed /
  changed);
  blocks of a list whose parameters changed the same way are listed once
  (``layers.*.attention.wq.weight  [0-79, 80 blocks]``);
- decisions: the roles each module got (column / row / vocab_embedding / ...);
- collectives: counts and bytes per (purpose, kind, direction);
- memory per rank and unsharded;
- warnings added and removed.

A plan read from JSON of an earlier schema (one with ``tp`` and no mesh dims) compares
as a plan of tp alone (``plan.Plan``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from ..layouts import MeshDim, MeshLayout, MeshSizes
from ..planner import blocks
from .text import human

__all__ = ["compare_plans", "diff_plans", "PlanDiff", "ParamChange", "CollectiveChange",
           "RoleChange"]


@dataclass(frozen=True)
class ParamChange:
    """One parameter whose layout or local shape differs (``None`` side: absent there)."""

    name: str
    layout_a: str | None
    layout_b: str | None
    local_a: tuple[int, ...] | None
    local_b: tuple[int, ...] | None
    global_a: tuple[int, ...] | None = None
    global_b: tuple[int, ...] | None = None

    @property
    def kind(self) -> str:
        if self.layout_a is None:
            return "added"
        if self.layout_b is None:
            return "removed"
        return "changed"


@dataclass(frozen=True)
class CollectiveChange:
    """Collectives of one (purpose, kind, direction) in each plan."""

    purpose: str
    kind: str
    direction: str
    count_a: int
    count_b: int
    bytes_a: int
    bytes_b: int


@dataclass(frozen=True)
class RoleChange:
    """The decision roles of one module in each plan (empty: no decision there)."""

    module: str
    roles_a: tuple[str, ...]
    roles_b: tuple[str, ...]


@dataclass
class PlanDiff:
    """Every difference between plan ``a`` and plan ``b`` (``a`` is the "before")."""

    header_a: str
    header_b: str
    params: list[ParamChange] = field(default_factory=list)
    roles: list[RoleChange] = field(default_factory=list)
    collectives: list[CollectiveChange] = field(default_factory=list)
    memory_a: tuple[int, int] = (0, 0)  # (per rank, unsharded)
    memory_b: tuple[int, int] = (0, 0)
    warnings_added: list[str] = field(default_factory=list)
    warnings_removed: list[str] = field(default_factory=list)
    dims: tuple[MeshSizes, MeshSizes] = (MeshSizes.of(tp=1), MeshSizes.of(tp=1))
    tokens: tuple[int, int] = (0, 0)

    @property
    def tp(self) -> tuple[int, int]:
        return self.dims[0].tp, self.dims[1].tp

    @property
    def empty(self) -> bool:
        """True when the plans agree on everything compared (headers aside)."""
        return not (self.params or self.roles or self.changed_collectives
                    or self.memory_a != self.memory_b or self.warnings_added
                    or self.warnings_removed)

    @property
    def changed_collectives(self) -> list[CollectiveChange]:
        return [c for c in self.collectives if (c.count_a, c.bytes_a) != (c.count_b, c.bytes_b)]

    def render(self) -> str:
        return _render(self)

    __str__ = render


def _header(p) -> str:
    return f"{p.model} at {p.dims} (rules: {p.rules}, {p.tokens} tokens)"


def compare_plans(a, b) -> PlanDiff:
    """The structured difference between two ``Plan`` objects."""
    d = PlanDiff(header_a=_header(a), header_b=_header(b), dims=(a.dims, b.dims),
                 tokens=(a.tokens, b.tokens))
    pa = {p.name: p for p in a.params}
    pb = {p.name: p for p in b.params}
    for name in list(pa) + [n for n in pb if n not in pa]:
        x, y = pa.get(name), pb.get(name)
        if x and y and _layout(x) == _layout(y) and x.local_shape == y.local_shape \
                and x.global_shape == y.global_shape:
            continue
        d.params.append(ParamChange(
            name, _layout(x) if x else None, _layout(y) if y else None,
            tuple(x.local_shape) if x else None, tuple(y.local_shape) if y else None,
            tuple(x.global_shape) if x else None, tuple(y.global_shape) if y else None))
    ra, rb = _roles(a), _roles(b)
    for mod in list(ra) + [m for m in rb if m not in ra]:
        x, y = ra.get(mod, ()), rb.get(mod, ())
        if x != y:
            d.roles.append(RoleChange(mod, x, y))
    ca, cb = _collectives(a), _collectives(b)
    for key in sorted(set(ca) | set(cb)):
        (na, ba), (nb, bb) = ca.get(key, (0, 0)), cb.get(key, (0, 0))
        d.collectives.append(CollectiveChange(*key, na, nb, ba, bb))
    d.memory_a = (a.memory.param_bytes_per_rank, a.memory.param_bytes_unsharded)
    d.memory_b = (b.memory.param_bytes_per_rank, b.memory.param_bytes_unsharded)
    wa, wb = Counter(a.warnings), Counter(b.warnings)
    d.warnings_added = list((wb - wa).elements())
    d.warnings_removed = list((wa - wb).elements())
    return d


def diff_plans(a, b) -> str:
    """The difference between two plans as text (``compare_plans(a, b).render()``)."""
    return compare_plans(a, b).render()


def _layout(p) -> str:
    """A parameter's placement as compared and shown: its tp placement (``S(0)``) where
    the plan decides tp alone, else its mesh layout (``dp_shard=S(0),tp=S(0)``)."""
    only_tp = MeshLayout.parse(p.mesh_layout).names == (MeshDim.TP.value,)
    return p.layout if only_tp else p.mesh_layout


def _roles(p) -> dict[str, tuple[str, ...]]:
    out: dict[str, set] = OrderedDict()
    for dec in p.decisions:
        out.setdefault(dec.module, set()).add(dec.role)
    return {k: tuple(sorted(v)) for k, v in out.items()}


def _collectives(p) -> dict:
    out: dict = {}
    for c in p.collectives:
        n, b = out.get((c.purpose, c.kind, c.direction), (0, 0))
        out[(c.purpose, c.kind, c.direction)] = (n + 1, b + c.bytes)
    return out


# --------------------------------------------------------------------------- text

def _unpack(f: blocks.Fold):
    return f.name, f.indices, f.item


def _ranges(indices) -> str:
    """'0-79, 80 blocks' for [(0,), (1,), ... (79,)]; nested indices by their first number."""
    firsts = [i[0] for i in indices if i]
    if not firsts:
        return f"{len(indices)} blocks"
    text = blocks.span_text(firsts)
    return f"{text}, {len(indices)} blocks" if len(indices) > 1 else text


def _fmt_shape(s) -> str:
    return "-" if s is None else "(" + ", ".join(map(str, s)) + ("," if len(s) == 1 else "") + ")"


def _signed(n: int) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "±") + human(abs(n))


def _render(d: PlanDiff) -> str:
    lines = [f"plan diff: {d.header_a}  ->  {d.header_b}"]
    if d.empty:
        lines.append("\nno differences in parameters, decisions, communication, memory or warnings")
        return "\n".join(lines)
    if d.warnings_added or d.warnings_removed:
        lines.append("\nwarnings:")
        lines += [f"  + {w}" for w in d.warnings_added]
        lines += [f"  - {w}" for w in d.warnings_removed]
    (ra, ua), (rb, ub) = d.memory_a, d.memory_b
    a, b = d.dims
    resized = [f"{m}: {a.get(m, 1)} -> {b.get(m, 1)}" for m in MeshDim if a.get(m, 1) != b.get(m, 1)]
    if resized:
        lines.append("\n" + "\n".join(resized))
    lines.append("\nparameters per rank: "
                 f"{human(ra)} -> {human(rb)} ({_signed(rb - ra)}"
                 + (f", {rb / ra - 1:+.1%}" if ra else "") + ")")
    if ua != ub:
        lines.append(f"unsharded parameters: {human(ua)} -> {human(ub)} ({_signed(ub - ua)})")
    changed = d.changed_collectives
    if not changed:
        lines.append(f"\ncommunication per step: unchanged ({sum(c.count_a for c in d.collectives)} "
                     f"collectives, {human(sum(c.bytes_a for c in d.collectives))})")
    else:
        lines.append("\ncommunication per step (count, bytes):")
        for c in d.collectives:
            mark = " " if (c.count_a, c.bytes_a) == (c.count_b, c.bytes_b) else (
                "+" if c.count_a == 0 else "-" if c.count_b == 0 else "~")
            delta = f" ({_signed(c.bytes_b - c.bytes_a)})" if c.bytes_a != c.bytes_b else ""
            lines.append(f"  {mark} {c.direction:8} {c.kind:10} {c.purpose:13} "
                         f"{c.count_a:4} -> {c.count_b:<4}  {human(c.bytes_a):>11} -> "
                         f"{human(c.bytes_b):<11}{delta}".rstrip())
        ta = sum(c.bytes_a for c in d.collectives)
        tb = sum(c.bytes_b for c in d.collectives)
        lines.append(f"    total {sum(c.count_a for c in d.collectives)} -> "
                     f"{sum(c.count_b for c in d.collectives)} collectives, {human(ta)} -> {human(tb)}")
        if d.tokens[0] != d.tokens[1]:
            lines.append(f"    (example inputs: {d.tokens[0]} -> {d.tokens[1]} tokens; bytes scale with tokens)")
    if d.roles:
        lines.append("\ndecisions (roles per module):")
        rows = [(name, "/".join(r.roles_a) or "-", "/".join(r.roles_b) or "-",
                 f"[{_ranges(idx)}]" if idx else "")
                for name, idx, r in map(_unpack, blocks.fold(d.roles, lambda r: r.module,
                                                             key=lambda r: (r.roles_a, r.roles_b)))]
        w0, w1, w2 = (max(len(r[i]) for r in rows) for i in range(3))
        for r in rows:
            lines.append(f"  {r[0]:{w0}}  {r[1]:{w1}} -> {r[2]:{w2}}  {r[3]}".rstrip())
    if d.params:
        lines.append("\nparameters (layout, rank-local shape):")
        for kind in ("changed", "added", "removed"):
            items = [p for p in d.params if p.kind == kind]
            if not items:
                continue
            lines.append(f"  {kind}:")
            rows = []
            for name, idx, p in map(_unpack, blocks.fold(
                    items, lambda p: p.name,
                    key=lambda p: (p.layout_a, p.layout_b, p.local_a, p.local_b, p.global_a, p.global_b))):
                where = f"[{_ranges(idx)}]" if idx else ""
                if kind == "changed":
                    glob = "" if p.global_a == p.global_b else \
                        f"global {_fmt_shape(p.global_a)} -> {_fmt_shape(p.global_b)}"
                    rows.append((name, f"{p.layout_a} {_fmt_shape(p.local_a)}",
                                 f"{p.layout_b} {_fmt_shape(p.local_b)}", " ".join(filter(None, (glob, where)))))
                else:
                    lay, g, loc = ((p.layout_b, p.global_b, p.local_b) if kind == "added"
                                   else (p.layout_a, p.global_a, p.local_a))
                    rows.append((name, lay, f"{_fmt_shape(g)} -> {_fmt_shape(loc)}", where))
            w0 = max(len(r[0]) for r in rows)
            w1 = max(len(r[1]) for r in rows)
            w2 = max(len(r[2]) for r in rows)
            sep = "->" if kind == "changed" else "  "
            for r in rows:
                lines.append(f"    {r[0]:{w0}}  {r[1]:{w1}} {sep} {r[2]:{w2}}  {r[3]}".rstrip())
    return "\n".join(lines)
