"""The plan as one self-contained HTML page: the model drawn as blocks.

``render_html(plan)`` returns a single HTML document (inline CSS and JS, no
network, no external fonts) that shows:

- the warnings, first;
- per-rank parameter memory as a bar against the unsharded model, split by
  layout;
- the pipeline's stages when the plan has them (blocks, parameters, FLOPs
  share, memory per rank, FITS / DOES NOT FIT, the bubble);
- the communication per step, grouped like the text report;
- the model as nested blocks by module path, identical consecutive blocks of
  a list drawn once ("layers 0–79 ×80"), every parameter coloured by its
  layout (replicated / column / row / vocab) with a small glyph of what rank 0
  holds, every decision's output layout (partial sums in their own colour),
  and the communication points between the blocks (f before a region, g
  after it) with kind, direction and bytes;
- the rule behind each decision on hover (``title``) and, on click, in a
  details panel.

The style and script are ``html.css`` and ``html.js`` beside this module
(package data), inlined into every page. The page works without JavaScript (everything but the details panel is
static HTML); the script only adds the panel, legend filtering, and marks the
document ``data-rendered="1"`` once it ran (``window.onerror`` writes any
script error into a ``#js-error`` element: tests look for both).
"""

from __future__ import annotations

import html
import json
import re
from importlib import resources
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from ..layouts import Partial, Placement, Replicate, Shard
from ..planner import blocks
from ..planner.purposes import PURPOSES
from .text import BUBBLE_FORMULA, count, human, stage_blocks

__all__ = ["render_html", "CATEGORIES"]

#: layout categories, in legend order: (key, label, colour, explanation)
CATEGORIES = [
    ("replicated", "replicated", "#94a3b8", "every rank holds the whole tensor (R)"),
    ("column", "column", "#3b82f6", "split on the output features: weight S(0), output S(-1)"),
    ("row", "row", "#f59e0b", "split on the input features: weight S(1), output a partial sum"),
    ("vocab", "vocab", "#8b5cf6", "split along the vocabulary (embedding, LM head, loss)"),
    ("partial", "partial", "#e11d48", "every rank holds a summand; g all-reduces it"),
]
_COLOUR = {k: c for k, _, c, _ in CATEGORIES}


# --------------------------------------------------------------------------- layouts

def describe_layout(text: str) -> str:
    """A layout string in words."""
    lay = Placement.parse(text)
    if isinstance(lay, Replicate):
        return "replicated: every rank holds the whole tensor"
    if isinstance(lay, Partial):
        return "partial: every rank holds a summand, the sum is the value"
    words = f"split on dim {lay.dim}"
    if lay.blocks:
        words += f", by blocks {'+'.join(map(str, lay.blocks))} (each rank holds its slice of every block)"
    if lay.padded:
        words += f", padded to {lay.padded}"
    if lay.blocked_replicas:
        words += f", each block's part held by {'/'.join(map(str, lay.replicas))} ranks"
    elif lay.replicas > 1:
        words += f", each part held by {lay.replicas} ranks"
    return words


# --------------------------------------------------------------------------- the module tree

@dataclass
class _Node:
    name: str
    path: str  # FQN of the (first) module this node stands for; "" for the model
    children: OrderedDict = field(default_factory=OrderedDict)
    params: list = field(default_factory=list)  # (short name, ParamEntry, alias_of | None)
    decisions: list = field(default_factory=list)
    collectives: list = field(default_factory=list)
    count: int = 1  # >1: identical consecutive blocks drawn once
    first: int | None = None
    last: int | None = None
    listname: str | None = None

    def child(self, name: str) -> _Node:
        if name not in self.children:
            self.children[name] = _Node(name, f"{self.path}.{name}" if self.path else name)
        return self.children[name]

    @property
    def own(self) -> bool:
        return bool(self.params or self.decisions)


def _module_of_param(name: str) -> str:
    return name.rpartition(".")[0]


def _build_tree(plan) -> _Node:
    root = _Node("", "")

    def node(path: str) -> _Node:
        n = root
        for part in filter(None, path.split(".")):
            n = n.child(part)
        return n

    for p in plan.params:
        node(_module_of_param(p.name)).params.append((p.name.rpartition(".")[2], p, None))
    for p in plan.params:
        for a in p.aliases:
            node(_module_of_param(a)).params.append((a.rpartition(".")[2], p, p.name))
    for d in plan.decisions:
        node(d.module).decisions.append(d)
    for c in plan.collectives:
        node(c.module).collectives.append(c)
    _collapse(root)
    return root


def _norm_rule(rule: str) -> str:
    """A rule's text without block indices and graph node numbers (for block identity)."""
    rule = re.sub(r"\.\d+\b", ".#", rule)
    return re.sub(r"\b([A-Za-z][A-Za-z_]*?)_\d+\b", r"\1", rule)


def _signature(n: _Node):
    return (
        tuple((s, p.layout, tuple(p.global_shape), tuple(p.local_shape), p.dtype, a is not None)
              for s, p, a in n.params),
        tuple((d.role, d.layout, _norm_rule(d.rule)) for d in n.decisions),
        tuple(sorted((c.kind, c.direction, c.purpose, c.bytes) for c in n.collectives)),
        tuple((k, _signature(v)) for k, v in n.children.items()),
    )


def _collapse(n: _Node) -> None:
    """Draw identical consecutive blocks of every list once (``count`` > 1)."""
    for c in n.children.values():
        _collapse(c)
    keys = list(n.children)
    if not keys or not all(k.isdigit() for k in keys):
        return
    out = OrderedDict()
    for run in blocks.runs((int(k), _signature(n.children[k]), n.children[k]) for k in keys):
        child = run.item
        child.first, child.last, child.count, child.listname = run.first, run.last, run.count, n.name
        out[str(run.first)] = child
    n.children = out


# --------------------------------------------------------------------------- categories

class _Colours:
    """Which layout category each parameter and decision falls in."""

    def __init__(self, plan):
        self.roles: dict[str, set] = {}
        for d in plan.decisions:
            self.roles.setdefault(d.module, set()).add(d.role)
        # an LM head: a column module whose output is gathered (or the loss's logits) with
        # the vocabulary's size on its split dim
        self.heads = {c.module for c in plan.collectives if c.purpose == "gather_output"}
        self.vocab_sizes = set()
        for p in plan.params:
            mods = [_module_of_param(p.name)] + [_module_of_param(a) for a in p.aliases]
            if any("vocab_embedding" in self.roles.get(m, ()) for m in mods) and p.global_shape:
                self.vocab_sizes.add(p.global_shape[0])
        self.param_cat = {p.name: self._param(p) for p in plan.params}

    def _param(self, p) -> str:
        lay = Placement.parse(p.layout)
        if not isinstance(lay, Shard):
            return "replicated" if isinstance(lay, Replicate) else "partial"
        mods = [_module_of_param(p.name)] + [_module_of_param(a) for a in p.aliases]
        roles = set().union(*(self.roles.get(m, set()) for m in mods))
        dim = lay.dim if lay.dim >= 0 else lay.dim + len(p.global_shape)
        if lay.padded or roles & {"vocab_embedding", "vocab_loss"}:
            return "vocab"
        if ("column" in roles and set(mods) & self.heads and p.global_shape
                and p.global_shape[dim] in self.vocab_sizes):
            return "vocab"
        if roles & {"row", "partial"} and not (roles & {"column"}):
            return "row"
        if "column" in roles and not roles & {"row", "partial"}:
            return "column"
        return "column" if dim == 0 else "row"

    def module(self, path: str, params) -> str:
        roles = self.roles.get(path, set())
        if roles & {"vocab_embedding", "vocab_loss"}:
            return "vocab"
        if "column" in roles:
            cats = {self.param_cat.get(p.name) for _, p, _ in params}
            return "vocab" if "vocab" in cats else "column"
        if roles & {"row", "partial"}:
            return "row"
        if roles == {"replicated"}:
            return "replicated"
        cats = [self.param_cat.get(p.name) for _, p, _ in params]
        return next((c for c in ("vocab", "column", "row") if c in cats), "replicated")

    @staticmethod
    def output(d, module_cat: str) -> str:
        lay = Placement.parse(d.layout)
        if isinstance(lay, Partial):
            return "partial"
        if isinstance(lay, Replicate):
            return "replicated"
        return "vocab" if module_cat == "vocab" or lay.padded else "column"


def _decision_layout(d) -> tuple[str, str]:
    """A decision's output layout as shown, and in words (``S(seq)`` for the ranks' tokens)."""
    if d.sequence:
        return (f"S(seq) {d.layout}", "sequence parallel: this rank's 1/tp of the tokens, "
                f"split on dim {Placement.parse(d.layout).dim}")
    return d.layout, describe_layout(d.layout)


# --------------------------------------------------------------------------- pieces

def _e(s) -> str:
    return html.escape(str(s), quote=True)


def _shape(s) -> str:
    return "(" + ", ".join(map(str, s)) + ")" if len(s) != 1 else f"({s[0]},)"


def _glyph(p, cat: str, tp: int) -> str:
    """A tiny SVG of the tensor: the part rank 0 holds filled, the other ranks' parts tinted."""
    lay = Placement.parse(p.layout)
    colour = _COLOUR[cat]
    two_d = len(p.global_shape) >= 2
    W, H = (30, 22) if two_d else (30, 8)
    out = [f'<svg class="glyph" width="{W}" height="{H}" viewBox="0 0 {W} {H}" aria-hidden="true">']
    if not isinstance(lay, Shard):
        out.append(f'<rect x="0.5" y="0.5" width="{W - 1}" height="{H - 1}" rx="2" fill="{colour}" '
                   f'fill-opacity="0.85"/>')
    else:
        ndim = len(p.global_shape)
        dim = lay.dim + ndim if lay.dim < 0 else lay.dim
        # which screen axis the sharded dim runs along: rows (vertical) for dim 0 of a matrix
        vertical = two_d and dim == ndim - 2
        full = lay.padded or (p.global_shape[dim] if p.global_shape else 1)
        segments = list(lay.blocks) if lay.blocks else [full]
        parts = max(1, tp // max(lay.block_replicas()))
        span = H - 1 if vertical else W - 1
        pos = 0.5
        total = float(sum(segments)) or 1.0
        out.append(f'<rect x="0.5" y="0.5" width="{W - 1}" height="{H - 1}" rx="2" fill="{colour}" '
                   f'fill-opacity="0.16" stroke="{colour}" stroke-opacity="0.5" stroke-width="0.6"/>')
        for k_seg, seg in enumerate(segments):
            seg_len = span * seg / total
            piece = seg_len / parts
            if vertical:
                out.append(f'<rect x="0.5" y="{pos:.2f}" width="{W - 1}" height="{piece:.2f}" '
                           f'fill="{colour}"/>')
            else:
                out.append(f'<rect x="{pos:.2f}" y="0.5" width="{piece:.2f}" height="{H - 1}" '
                           f'fill="{colour}"/>')
            if parts <= 16:
                for k in range(1, parts):
                    q = pos + k * piece
                    if vertical:
                        out.append(f'<line x1="0.5" x2="{W - 0.5}" y1="{q:.2f}" y2="{q:.2f}" '
                                   f'stroke="{colour}" stroke-opacity="0.45" stroke-width="0.4"/>')
                    else:
                        out.append(f'<line y1="0.5" y2="{H - 0.5}" x1="{q:.2f}" x2="{q:.2f}" '
                                   f'stroke="{colour}" stroke-opacity="0.45" stroke-width="0.4"/>')
            pos += seg_len
            if k_seg < len(segments) - 1:
                if vertical:
                    out.append(f'<line x1="0" x2="{W}" y1="{pos:.2f}" y2="{pos:.2f}" stroke="#0f172a" '
                               f'stroke-width="0.8"/>')
                else:
                    out.append(f'<line y1="0" y2="{H}" x1="{pos:.2f}" x2="{pos:.2f}" stroke="#0f172a" '
                               f'stroke-width="0.8"/>')
    out.append("</svg>")
    return "".join(out)


class _Page:
    def __init__(self, plan):
        self.plan = plan
        self.colours = _Colours(plan)
        self.details: dict[str, dict] = {}
        self.ids = 0

    # ------------------------------------------------------------------ details data
    def _detail_id(self, data: dict) -> str:
        self.ids += 1
        key = f"d{self.ids}"
        self.details[key] = data
        return key

    # ------------------------------------------------------------------ header parts
    def warnings(self) -> str:
        ws = self.plan.warnings
        if not ws:
            return ('<section id="warnings" class="warnings ok" data-count="0">'
                    '<strong>No warnings.</strong> Every region the rules could place is sharded.'
                    '</section>')
        items = "".join(f'<li class="warning">{_e(w)}</li>' for w in ws)
        return (f'<section id="warnings" class="warnings bad" data-count="{len(ws)}">'
                f'<h2>⚠ {len(ws)} warning{"s" if len(ws) != 1 else ""}</h2><ul>{items}</ul></section>')

    def memory(self) -> str:
        m = self.plan.memory
        total = max(m.param_bytes_unsharded, 1)
        by_cat = Counter()
        for p in self.plan.params:
            by_cat[self.colours.param_cat[p.name]] += p.bytes_per_rank
        segs, keys = [], []
        for k, label, colour, _ in CATEGORIES:
            b = by_cat.get(k, 0)
            if not b:
                continue
            pct = 100.0 * b / total
            segs.append(f'<div class="seg" style="width:{pct:.4f}%;background:{colour}" '
                        f'title="{_e(label)}: {_e(human(b))} per rank"></div>')
            keys.append(f'<span class="memkey"><i style="background:{colour}"></i>{_e(label)} '
                        f'{_e(human(b))}</span>')
        ratio = m.param_bytes_per_rank / total
        saved = m.param_bytes_unsharded - m.param_bytes_per_rank
        return (
            '<section id="memory" class="card">'
            '<h2>Parameters per rank</h2>'
            f'<div class="big">{_e(human(m.param_bytes_per_rank))} '
            f'<span class="muted">of {_e(human(m.param_bytes_unsharded))} unsharded '
            f'({ratio:.1%})</span></div>'
            f'<div class="membar" role="img" aria-label="per-rank parameter memory {ratio:.1%} of unsharded" '
            f'data-per-rank="{m.param_bytes_per_rank}" data-unsharded="{m.param_bytes_unsharded}">'
            f'{"".join(segs)}<div class="seg saved" style="flex:1" '
            f'title="not held by this rank: {_e(human(saved))}"></div></div>'
            '<div class="memscale"><span>0</span><span>unsharded model</span></div>'
            f'<div class="memkeys">{"".join(keys)}<span class="memkey"><i class="savedkey"></i>'
            f'held by other ranks {_e(human(saved))}</span></div>'
            '</section>')

    def pipeline(self) -> str:
        """The pipeline's stages (``plan.pipeline``): blocks, parameters, FLOPs share,
        memory per rank and whether it fits, and the schedule's bubble."""
        pipe = self.plan.pipeline
        if pipe is None:
            return ""
        rows = []
        for s in pipe.stages:
            state = s.param_bytes + s.grad_bytes + s.optimizer_bytes
            verdict = "" if s.fits is None else ("FITS" if s.fits else "DOES NOT FIT")
            rows.append(
                f'<tr class="stage-row" data-stage="{s.index}"><td>{s.index}</td>'
                f'<td>{s.pp_rank}</td><td>{_e(stage_blocks(s, pipe.layers))}</td>'
                f'<td class="num">{_e(count(s.params))}</td>'
                f'<td class="num">{_e(count(s.flops))}</td><td class="num">{s.time_share:.1%}</td>'
                f'<td class="num">{s.in_flight}</td><td class="num">{_e(human(s.activations))}</td>'
                f'<td class="num">{_e(human(state))}</td><td class="num">{_e(human(s.peak))}</td>'
                f'<td>{verdict}</td></tr>')
        v = f", v={pipe.virtual_stages} stages per rank" if pipe.virtual_stages > 1 else ""
        limit = "" if pipe.memory_limit is None else \
            f"; memory limit per rank {_e(human(pipe.memory_limit))}"
        return (
            '<section id="pipeline" class="card">'
            '<h2>Pipeline stages</h2>'
            f'<div class="muted small">pp={pipe.pp}, schedule {_e(pipe.schedule)}{_e(v)}, '
            f'{pipe.microbatches} microbatches; bubble {_e(BUBBLE_FORMULA[pipe.schedule])} = '
            f'{pipe.bubble:.1%} of the compute time{limit}</div>'
            '<table class="comm"><thead><tr><th>stage</th><th>rank</th><th>blocks</th>'
            '<th class="num">params/rank</th><th class="num">FLOPs/microbatch</th>'
            '<th class="num">time</th><th class="num">in flight</th>'
            '<th class="num">activations</th><th class="num">state</th>'
            '<th class="num">peak</th><th></th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></section>')

    def communication(self) -> str:
        groups, nbytes = Counter(), Counter()
        for c in self.plan.collectives:
            key = (c.direction, c.kind, c.purpose, c.elements_per_token)
            groups[key] += 1
            nbytes[key] += c.bytes
        rows = []
        for key in sorted(groups):
            direction, kind, purpose, per_tok = key
            row = PURPOSES[purpose]
            rows.append(
                f'<tr class="comm-row" data-purpose="{_e(purpose)}" title="{_e(row.text)}">'
                f'<td><span class="cpill {_e(purpose)}">{_e(row.label)}</span></td>'
                f'<td>{_e(direction)}</td><td>{groups[key]} × {_e(kind)}</td>'
                f'<td class="num">{per_tok:,.1f}</td><td class="num">{_e(human(nbytes[key]))}</td></tr>')
        total = sum(c.bytes for c in self.plan.collectives)
        return (
            '<section id="communication" class="card">'
            '<h2>Communication per training step</h2>'
            f'<div class="muted small">example inputs: {self.plan.tokens} tokens; bytes scale with tokens</div>'
            '<table class="comm"><thead><tr><th></th><th>direction</th><th>collectives</th>'
            '<th class="num">elements/token</th><th class="num">bytes</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody>'
            f'<tfoot><tr><td></td><td colspan="2">{len(self.plan.collectives)} collectives</td>'
            f'<td></td><td class="num">{_e(human(total))}</td></tr></tfoot></table>'
            f'{self.choices()}</section>')

    def choices(self) -> str:
        """Ops a region stopped at (reductions over a split dim, ops with no distributed
        form): run distributed, the region kept replicated, or the shard gathered there."""
        if not self.plan.choices:
            return ""
        ways = ("distributed", "replicated", "gathered")
        cost = lambda c, k: (f'{_e(human(c.costs[k]["moved"]))} + {_e(human(c.costs[k]["params"]))}'  # noqa: E731
                             if k in c.costs else "—")
        rows = "".join(
            f'<tr class="choice-row" data-chosen="{_e(c.chosen)}" title="{_e(c.source or "")}">'
            f'<td>{_e(c.module)}</td><td>{_e(", ".join(c.nodes))}</td><td><b>{_e(c.chosen)}</b></td>'
            + "".join(f'<td class="num">{cost(c, k)}</td>' for k in ways)
            + '</tr>' for c in self.plan.choices)
        return ('<h3>Reductions and other ops over a split dim</h3>'
                '<div class="muted small">cost of each way: bytes moved per step + parameter bytes '
                'per rank (captured graph); the cheapest is kept (ties: distributed, replicated, '
                'gathered)</div>'
                '<table class="choices"><thead><tr><th>module</th><th>ops</th><th>chosen</th>'
                + "".join(f'<th class="num">{w}</th>' for w in ways) + '</tr></thead>'
                f'<tbody>{rows}</tbody></table>')

    @staticmethod
    def legend() -> str:
        items = "".join(
            f'<button type="button" class="legend-item" data-cat="{k}" title="{_e(why)}">'
            f'<i style="background:{c}"></i>{_e(label)}</button>'
            for k, label, c, why in CATEGORIES)
        comm = ('<span class="legend-item static" title="f: backward all-reduce where a region starts">'
                '<span class="cpill f">f</span> before a region</span>'
                '<span class="legend-item static" title="g: forward all-reduce where a region ends">'
                '<span class="cpill g">g</span> after a region</span>')
        return (f'<section id="legend" class="legend"><span class="legend-title">Layout</span>{items}'
                f'<span class="legend-title">Communication</span>{comm}</section>')

    # ------------------------------------------------------------------ the blocks
    def blocks(self, root: _Node) -> str:
        inner = "".join(self._node(c, 0) for c in root.children.values())
        if root.own or root.collectives:
            inner += ('<div class="mod top"><div class="modtitle">model level '
                      '<span class="muted">(outside any submodule)</span></div>'
                      f'{self._own(root) if root.own else ""}{self._markers(root)}</div>')
        return f'<section id="blocks" class="blocks">{inner}</section>'

    def _title(self, n: _Node) -> str:
        if n.count > 1:
            return (f'<span class="name">{_e(n.listname)} {n.first}–{n.last}</span>'
                    f'<span class="times" title="{n.count} identical blocks drawn once">×{n.count}</span>')
        if n.first is not None and n.listname is not None:
            return f'<span class="name">{_e(n.listname)} {n.first}</span>'
        return f'<span class="name">{_e(n.name)}</span>'

    def _node(self, n: _Node, depth: int) -> str:
        # a list of blocks: draw its (collapsed) children directly
        if n.children and all(c.listname == n.name and c.first is not None
                              for c in n.children.values()) and not n.own:
            return "".join(self._node(c, depth) for c in n.children.values()) + self._markers(n)
        if not n.children:
            return self._own(n) + self._markers(n)
        cls = "mod repeated" if n.count > 1 else "mod"
        attrs = f' data-path="{_e(n.path)}"'
        if n.count > 1:
            attrs += f' data-count="{n.count}" data-first="{n.first}" data-last="{n.last}"'
        body = (self._own(n) if n.own else "") + "".join(
            self._node(c, depth + 1) for c in n.children.values())
        return (f'<div class="{cls} depth{min(depth, 3)}"{attrs}>'
                f'<div class="modtitle">{self._title(n)}'
                f'{self._path_span(n)}</div>'
                f'{body}{self._markers(n)}</div>')

    def _path_span(self, n: _Node) -> str:
        shown = self._display_path(n)
        return "" if shown == n.name else f'<span class="path muted">{_e(shown)}</span>'

    def _display_path(self, n: _Node) -> str:
        """The FQN with the index range of every collapsed block above: layers.{0–79}.attention."""
        return self._display.get(id(n), n.path)

    def _own(self, n: _Node) -> str:
        cat = self.colours.module(n.path, n.params)
        roles = sorted({d.role for d in n.decisions})
        rules = "; ".join(dict.fromkeys(d.rule for d in n.decisions)) or "no decision (replicated)"
        role_txt = ", ".join(roles) if roles else "replicated"
        if cat == "vocab" and roles == ["column"]:
            role_txt = "column · vocab"
        chips = []
        for short, p, alias_of in n.params:
            pcat = self.colours.param_cat[p.name]
            tied = f" (tied to {alias_of})" if alias_of else ""
            tip = (f"{short}{tied}: {p.layout} — {describe_layout(p.layout)}\n"
                   f"global {_shape(p.global_shape)} → rank-local {_shape(p.local_shape)}, "
                   f"{human(p.bytes_per_rank)} per rank ({p.dtype})\nrule: {p.rule}")
            chips.append(
                f'<span class="chip param cat-{pcat}" data-cat="{pcat}" data-layout="{_e(p.layout)}" '
                f'title="{_e(tip)}">{_glyph(p, pcat, self.plan.tp)}'
                f'<span class="pname">{_e(short)}{"<sup>tied</sup>" if alias_of else ""}</span>'
                f'<span class="lay" style="color:{_COLOUR[pcat]}">{_e(p.layout)}</span>'
                f'<span class="shape">{_e(_shape(p.global_shape))} → {_e(_shape(p.local_shape))}</span>'
                '</span>')
        outs = []
        for d in n.decisions:
            ocat = _Colours.output(d, cat)
            shown, words = _decision_layout(d)
            outs.append(
                f'<span class="chip out cat-{ocat}" data-cat="{ocat}" '
                f'title="{_e(f"output {d.layout}: {words}; rule: {d.rule}")}">'
                f'<span class="arrow">→</span><span class="lay" style="color:{_COLOUR[ocat]}">'
                f'{_e(shown)}</span></span>')
        data = {
            "title": self._display_path(n) or "(model)",
            "category": cat,
            "count": n.count if n.count > 1 else self._count_above(n),
            "decisions": [{"node": d.node, "role": d.role, "layout": _decision_layout(d)[0],
                           "layout_words": _decision_layout(d)[1], "rule": d.rule,
                           "evidence": d.evidence, "source": d.source} for d in n.decisions],
            "params": [{"name": short, "full": p.name, "tied_to": alias_of, "layout": p.layout,
                        "layout_words": describe_layout(p.layout), "category": self.colours.param_cat[p.name],
                        "global": p.global_shape, "local": p.local_shape, "dtype": p.dtype,
                        "bytes": human(p.bytes_per_rank), "rule": p.rule} for short, p, alias_of in n.params],
            "collectives": [self._coll_data(c) for c in n.collectives],
        }
        did = self._detail_id(data)
        tip = f"{self._display_path(n) or '(model)'} — {role_txt}\nrule: {rules}\n(click for details)"
        return (f'<div class="row cat-{cat}" data-cat="{cat}" data-role="{_e(role_txt)}" '
                f'data-detail="{did}" data-path="{_e(n.path)}" tabindex="0" title="{_e(tip)}">'
                f'<div class="rowhead"><span class="rname">{_e(n.name or "(model)")}</span>'
                f'<span class="role" style="background:{_COLOUR[cat]}">{_e(role_txt)}</span></div>'
                f'<div class="chips">{"".join(chips)}{"".join(outs)}</div></div>')

    def _count_above(self, n: _Node) -> int:
        return self._counts.get(id(n), 1)

    @staticmethod
    def _coll_data(c) -> dict:
        return {"kind": c.kind, "direction": c.direction, "purpose": c.purpose, "elements": c.elements,
                "bytes": human(c.bytes), "node": c.node, "source": c.source}

    def _markers(self, n: _Node) -> str:
        if not n.collectives:
            return ""
        groups: OrderedDict = OrderedDict()
        for c in n.collectives:
            groups.setdefault((c.purpose, c.kind, c.direction), []).append(c)
        mult = self._count_above(n)
        out = []
        for (purpose, kind, direction), cs in groups.items():
            row = PURPOSES[purpose]
            short, why = row.label, row.text
            b = sum(c.bytes for c in cs)
            times = f"{len(cs)} × " if len(cs) > 1 else ""
            total = (f'<span class="muted"> · ×{mult} blocks = {_e(human(b * mult))}</span>'
                     if mult > 1 else "")
            tip = f"{purpose}: {why}\n{times}{kind} {direction}, {human(b)}" + (
                f"\nsource: {cs[0].source}" if cs[0].source else "")
            did = self._detail_id({"title": f"{short} at {self._display_path(n) or '(model)'}", "category": "comm",
                                   "count": mult, "decisions": [], "params": [],
                                   "collectives": [self._coll_data(c) for c in cs],
                                   "note": f"{purpose}: {why}"})
            out.append(
                f'<div class="comm-point {_e(purpose)}" data-purpose="{_e(purpose)}" data-kind="{_e(kind)}" '
                f'data-direction="{_e(direction)}" data-bytes="{b}" data-detail="{did}" tabindex="0" '
                f'title="{_e(tip)}"><span class="line"></span><span class="cpill {_e(purpose)}">{_e(short)}'
                f'</span><span class="ctext">{times}{_e(kind)} · {_e(direction)} · <b>{_e(human(b))}</b>'
                f'{total}</span><span class="place muted">{_e(row.place)}</span><span class="line"></span></div>')
        return "".join(out)

    def _multiplicities(self, root: _Node) -> None:
        self._counts: dict[int, int] = {}
        self._display: dict[int, str] = {}

        def walk(n: _Node, mult: int, prefix: str):
            mult = mult * n.count
            self._counts[id(n)] = mult
            part = f"{{{n.first}–{n.last}}}" if n.count > 1 else n.name
            shown = f"{prefix}.{part}" if prefix and part else prefix or part
            self._display[id(n)] = shown
            for c in n.children.values():
                walk(c, mult, shown)
        walk(root, 1, "")

    # ------------------------------------------------------------------ page
    def render(self) -> str:
        plan = self.plan
        root = _build_tree(plan)
        self._multiplicities(root)
        blocks = self.blocks(root)
        repeated = "".join(
            f'<span class="tag" title="captured {a} blocks, decisions stamped onto all {b}">'
            f'{_e(k)}: planned once for {b} blocks</span>' for k, (a, b) in plan.repeated.items())
        data = json.dumps({"details": self.details, "colours": _COLOUR,
                           "model": plan.model, "tp": plan.tp}, separators=(",", ":"))
        data = data.replace("</", "<\\/").replace("<!--", "<\\!--")
        return _TEMPLATE.format(
            title=_e(f"shardplan: {plan.model} at {plan.dims}"),
            css=_static("html.css"), js=_static("html.js"), data=data,
            model=_e(plan.model), mesh=_e(str(plan.dims)), rules=_e(plan.rules), tokens=plan.tokens,
            nparams=len(plan.params), ncoll=len(plan.collectives), ndec=len(plan.decisions),
            schema=plan.schema_version, repeated=repeated,
            warnings=self.warnings(), memory=self.memory() + self.pipeline(), communication=self.communication(),
            legend=self.legend(), blocks=blocks)


def render_html(plan) -> str:
    """One self-contained HTML page drawing ``plan`` (a ``shardplan.Plan``)."""
    return _Page(plan).render()


# --------------------------------------------------------------------------- static parts

def _static(name: str) -> str:
    """A package data file beside this module (``html.css``, ``html.js``), inlined in the page."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="shardplan">
<title>{title}</title>
<script>
window.onerror = function (msg, src, line, col) {{
  var d = document.getElementById("js-error") || document.createElement("div");
  d.id = "js-error";
  d.textContent = "script error: " + msg + " (line " + line + ":" + col + ")";
  (document.body || document.documentElement).appendChild(d);
}};
</script>
<style>{css}</style>
</head>
<body>
<header class="top">
  <div class="brand">shardplan</div>
  <h1>{model} <span class="at">at {mesh}</span></h1>
  <div class="meta">rules <b>{rules}</b> · {tokens} tokens in the example · {nparams} parameters ·
  {ndec} decisions · {ncoll} collectives · schema v{schema} {repeated}</div>
</header>
<main>
{warnings}
<div class="cards">{memory}{communication}</div>
{legend}
<div class="layout">
  <div class="model">{blocks}</div>
  <aside id="details" class="details"><div class="placeholder">Click a block or a communication
  point for the rule behind it.</div></aside>
</div>
</main>
<script id="plan-data" type="application/json">{data}</script>
<script>{js}</script>
</body>
</html>
"""
