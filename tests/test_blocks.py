"""The block-index helper every presenter and the planner's stamping share."""

from __future__ import annotations

from shardplan.planner import blocks


def test_names():
    name = "layers.12.attn.3.wq.weight"
    assert blocks.pattern(name) == "layers.*.attn.*.wq.weight"
    assert blocks.indices(name) == (12, 3)
    assert blocks.split_first(name) == ("layers", 12, "attn.3.wq.weight")
    assert blocks.split_first("lm_head.weight") is None
    assert blocks.pattern("h0.weight") == "h0.weight"  # digits inside a word are no index


def test_index_in_and_with_index():
    assert blocks.index_in("layers.1.attn.wq", "layers") == 1
    assert blocks.index_in("layers.1", "layers") == 1
    assert blocks.index_in("layers_x.1.attn", "layers") is None
    assert blocks.index_in("model.layers.1.attn", "layers") is None
    assert blocks.with_index("layers.1.attn.wq", "layers", 7) == "layers.7.attn.wq"
    assert blocks.with_index("layers.1", "layers", 7) == "layers.7"


def test_instances():
    names = ["h.0.mlp", "h.1.mlp", "h.10.mlp", "h.1.attn", "hx.0.mlp"]
    assert blocks.instances("h.*.mlp", names) == ["h.0.mlp", "h.1.mlp", "h.10.mlp"]


def test_runs_fold_consecutive_alike_blocks_only():
    items = [(0, "a", "x0"), (1, "a", "x1"), (2, "b", "x2"), (3, "a", "x3"), (5, "a", "x5")]
    got = [(r.first, r.last, r.count, r.item) for r in blocks.runs(items)]
    assert got == [(0, 1, 2, "x0"), (2, 2, 1, "x2"), (3, 3, 1, "x3"), (5, 5, 1, "x5")]


def test_fold_groups_by_pattern_and_key():
    items = [("h.0.w", "S"), ("h.1.w", "S"), ("h.2.w", "R"), ("ln.w", "R")]
    folds = blocks.fold(items, name=lambda it: it[0], key=lambda it: it[1])
    assert [(f.name, f.indices, f.item) for f in folds] == [
        ("h.*.w", [(0,), (1,)], ("h.0.w", "S")), ("h.2.w", None, ("h.2.w", "R")),
        ("ln.w", None, ("ln.w", "R"))]


def test_span_text():
    assert blocks.span_text([3, 0, 1, 2, 7, 9, 8, 1]) == "0-3, 7-9"
    assert blocks.span_text([5]) == "5"
