"""The coverage survey's own logic: tiny configs, outcome classification, the Megatron count."""

from __future__ import annotations

import pytest

from benchmarks import coverage

pytest.importorskip("transformers")


def test_tiny_config_shrinks_sizes_and_keeps_multi_query():
    gpt2 = coverage.tiny_config("gpt2")
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.vocab_size) == (64, 2, 4, coverage.VOCAB)
    bigcode = coverage.tiny_config("gpt_bigcode")
    assert bigcode.multi_query and bigcode.n_embd == 64
    llama = coverage.tiny_config("llama")
    assert (llama.num_key_value_heads, llama.intermediate_size) == (2, 128)
    dbrx = coverage.tiny_config("dbrx").to_dict()  # a text model's own sub-configs shrink too
    assert (dbrx["d_model"], dbrx["ffn_config"]["moe_num_experts"]) == (64, 4)


def test_composite_config_is_not_built():
    with pytest.raises(coverage.NotBuilt, match="composite config"):
        coverage.tiny_config("llava")


def test_megatron_count():
    assert coverage.megatron_collectives({"layers": 2, "cross": 0}, "causal") == 8 + 1 + 1 + 3
    # encoder-decoder: 2 + 2 layers, the decoder's with cross-attention; 2 embedding lookups
    assert coverage.megatron_collectives({"layers": 4, "cross": 2}, "seq2seq") == 22 + 2 + 1 + 3


def _run(**kw):
    return {"ok": True, "worst": "loss: abs 0.0e+00", "divergent": None, "replicated": [],
            "reasons": [], "warnings": [], **kw}


@pytest.mark.parametrize("run, outcome", [
    (_run(), "equal+sharded"),
    (_run(replicated=["model.layers.0.mlp.fc1.weight"], reasons=["model.layers.0.mlp: x"]),
     "equal+replicated"),
    (_run(ok=False, divergent="linear_3"), "mismatch"),
    ({"error": "DivisibilityError: 5 heads", "stage": "plan", "refused": True}, "refused"),
    ({"error": "LayoutError: no layout", "stage": "verify", "refused": False}, "crash"),
    ({"error": "RuntimeError: shapes", "stage": "plan", "refused": False}, "crash"),
])
def test_classify(run, outcome):
    assert coverage.classify(run)[0] == outcome


def test_slowest_plans_are_listed_slowest_first_over_families_and_tps():
    results = [("a", "causal", {"runs": {2: {"plan_s": 1.0}, 4: {"plan_s": 7.5}}}),
               ("b", "causal", {"not_built": "needs vision"}),
               ("c", "causal", {"runs": {"2": {"plan_s": 3.3}, "4": {"error": "x"}}})]
    assert coverage.slowest(results) == "a tp4 7.5 s, c tp2 3.3 s, a tp2 1.0 s"
    assert coverage.slowest(results, n=1) == "a tp4 7.5 s"


def test_worst_outcome_over_tps_and_folded_names():
    result = {"runs": {2: _run(), 4: _run(ok=False)}}
    assert coverage.outcome_of(result) == "mismatch"
    assert coverage.outcome_of({"not_built": "needs vision"}) == "not built"
    names = ["m.layers.0.mlp.fc1.weight", "m.layers.1.mlp.fc1.weight"]
    assert coverage._names(names) == "m.layers.*.mlp.fc1.weight"
    assert coverage._fold("h.1.attn: no rule for stack at stack_3 (in h.1.attn)") == \
        "h.*.attn: no rule for stack (in h.*.attn)"


def test_gpt2_surveys_equal_and_sharded():
    model = coverage.build("gpt2", "GPT2LMHeadModel")
    layers = coverage._layer_counts(model)
    assert layers == {"layers": 2, "cross": 0}
    run = coverage.run_tp(model, 2, coverage.example_inputs("causal"))
    assert coverage.classify(run) == ("equal+sharded", "")
    assert run["collectives"] == coverage.megatron_collectives(layers, "causal")


def test_gemm_narrower_than_tp_is_by_design_by_the_plans_reason():
    """A layer GEMM the plan keeps whole because its output is narrower than tp (Qwen2-MoE's
    1-wide shared-expert gate) is not counted as replicated; one kept whole for another
    reason, or 2 wide at tp 2 and yet whole, is."""
    from types import SimpleNamespace as NS

    import torch.nn as nn
    model = nn.Module()
    model.config = NS()
    model.layers = nn.ModuleList([nn.ModuleDict({"gate": nn.Linear(8, 1), "fc": nn.Linear(8, 2)})])
    params = [NS(name=f"layers.0.{m}.weight", layout="R", global_shape=[w, 8])
              for m, w in (("gate", 1), ("fc", 2))]

    def decision(module, rule):
        return NS(role="replicated", module=f"layers.0.{module}", rule=rule)
    narrow = "output size {} does not divide by tp=2 at linear_1 (aten.linear.default in x)"
    plan = NS(params=params, decisions=[decision("gate", narrow.format(1)),
                                        decision("fc", "cat of sharded and replicated tensors")])
    assert coverage.replicated_gemms(model, plan) == ["layers.0.fc.weight"]
    plan.decisions[1] = decision("fc", narrow.format(2).replace("tp=2", "tp=4"))
    assert coverage.replicated_gemms(model, plan) == []  # 2 wide at tp 4: narrower too
    plan.decisions[0] = decision("gate", "no rule for aten.topk.default on a sharded input")
    assert coverage.replicated_gemms(model, plan) == ["layers.0.gate.weight"]


def test_export_column_and_summary():
    result = {"runs": {"2": _run(export={"hf": "runs equal", "dtensor": "refused: m [R]: no style"}),
                       "4": _run()}, "layers": {"layers": 2, "cross": 0}}
    assert coverage.export_cells(result) == "HF: runs equal / DTensor: refused: m [R]: no style"
    cells = coverage.row("llama", "causal", {**result, "runs": {2: result["runs"]["2"], 4: _run()}})
    assert cells[3] == coverage.export_cells(result) and len(cells) == 7
    text = coverage.summary([("llama", "causal", {**result, "runs": {
        2: {**result["runs"]["2"], "bytes_per_rank": 1, "bytes_unsharded": 2, "collectives": 13,
            "extra_kinds": [], "plan_s": 1.0}, 4: _run()}})])
    assert "HF tp_plan export: 1 runs equal, 0 refused, 0 WRONG, 0 crash" in text
    assert "DTensor export: 0 runs equal, 1 refused" in text


# --------------------------------------------------------------------------- other libraries

def _libraries():
    pytest.importorskip("x_transformers", reason="the [libs] extra is not installed")
    pytest.importorskip("curated_transformers", reason="the [libs] extra is not installed")
    from benchmarks import library_models
    return library_models


def test_library_rows_are_built_and_run():
    """Every other library's model builds tiny and runs unsharded (the survey's rows);
    both libraries are there, under names of their own."""
    lm = _libraries()
    assert {n.split(":")[0] for n in lm.MODELS} == {"x-transformers", "curated-transformers"}
    for name, case in lm.MODELS.items():
        model = case.build()
        out = model(*case.inputs())
        width = lm.CLASSES if name.endswith(":vit") else lm.HIDDEN if name.endswith(":bert") \
            else lm.VOCAB
        assert out.shape[-1] == width, name
        assert case.megatron_collectives() == 4 * lm.LAYERS + case.outside


def test_library_row_without_the_library_is_not_built(monkeypatch):
    lm = _libraries()
    monkeypatch.setitem(lm.MODELS, "nowhere:lm", lm.LibraryModel(
        "nowhere:lm", "no_such_library", lambda: None, lambda: (), 2))
    result = coverage.run_library("nowhere:lm")
    assert result["not_built"].startswith("no_such_library is not installed (the [libs] extra)")
    assert coverage.outcome_of(result) == "not built"
    assert len(coverage.library_table([("nowhere:lm", "library", result)]).splitlines()[2]
               .split(" | ")) == 6


def test_library_row_counts_against_its_own_megatron_count():
    run = {**_run(), "plan_s": 1.0, "bytes_per_rank": 1, "bytes_unsharded": 2, "collectives": 10,
           "extra_kinds": []}
    result = {"runs": {2: run, 4: run}, "layers": {"layers": 2, "cross": 0}, "megatron": 10}
    cells = coverage.library_table([("x-transformers:decoder", "library", result)]).splitlines()[2]
    assert cells == ("| x-transformers:decoder | equal+sharded / equal+sharded |  | 0.50 / 0.50 "
                     "| 10/10 / 10/10 | 1.0 / 1.0 |")


def test_library_section_is_written_alone(tmp_path, monkeypatch):
    """``--libraries`` rewrites its section and keeps the HF survey; the HF survey's
    rewrite keeps the section."""
    doc = tmp_path / "coverage.md"
    monkeypatch.setattr(coverage, "DOC", doc)
    doc.write_text("# Coverage survey\n\nHF rows\n")
    coverage.write_sections(libraries=f"{coverage.LIBRARY_HEADING}\n\nfirst\n")
    coverage.write_sections(libraries=f"{coverage.LIBRARY_HEADING}\n\nsecond\n")
    assert doc.read_text() == f"# Coverage survey\n\nHF rows\n\n{coverage.LIBRARY_HEADING}\n\nsecond\n"
    coverage.write_sections(hf="# Coverage survey\n\nnew HF rows\n")
    assert doc.read_text() == \
        f"# Coverage survey\n\nnew HF rows\n\n{coverage.LIBRARY_HEADING}\n\nsecond\n"
