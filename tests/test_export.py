"""Exporting a plan: DTensor parallel styles (run on 2 real gloo ranks) and HF tp_plan strings."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import shardplan
from shardplan.export import export_issues, parallelize_with_dtensor, to_dtensor_plan, to_hf_tp_plan
from shardplan.models import build

VOCAB = 97  # not divisible by 2: shardplan pads, DTensor shards unevenly


def _hf(family: str, device=None):
    """A tiny random Hugging Face causal LM (vocabulary ``VOCAB``, 2 layers, 4 heads, 2 KV heads)."""
    tf = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                  max_position_embeddings=64, use_cache=False)
    configs = {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(num_key_value_heads=2, intermediate_size=96, **common)),
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig(num_key_value_heads=2, intermediate_size=96,
                                                             **common)),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(num_key_value_heads=2, intermediate_size=96, **common)),
        "olmo2": (tf.Olmo2ForCausalLM, tf.Olmo2Config(num_key_value_heads=2, intermediate_size=96,
                                                      pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                      **common)),
        "opt": (tf.OPTForCausalLM, tf.OPTConfig(ffn_dim=96, word_embed_proj_dim=64, pad_token_id=0,
                                                bos_token_id=1, eos_token_id=2, **common)),
        "bert": (tf.BertForMaskedLM, tf.BertConfig(intermediate_size=96, pad_token_id=0, **common)),
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(n_embd=64, n_head=4, n_layer=2, n_positions=64,
                                                   vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                                                   use_cache=False)),
    }
    cls, cfg = configs[family]
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return cls(cfg).eval()  # no dropout: every rank and the reference compute the same


def _reference(model, idx, hf=False):
    ref = copy.deepcopy(model)
    if hf:
        out = ref(input_ids=idx, labels=idx)
        logits, loss = out.logits, out.loss
    else:
        logits, loss = ref(idx, idx)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    return logits.detach(), loss.detach(), grads


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _dtensor_step(ctx, model, idx, plan, family):
    """On each rank: parallelize a copy with the exported styles, one forward/backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    m = copy.deepcopy(model)
    if family == "gpt":
        # the bundled GPT reads C from its (replicated) input and views q/k/v as
        # (B, T, n_head, C // n_head): no head count fits a local C/tp tensor, so keep
        # DTensor activations (global shapes) through attention; CPU SDPA has a DTensor
        # rule only for the math kernel, which makes its causal mask a plain tensor
        parallelize_with_dtensor(m, mesh, plan, local_output=False)
        with sdpa_kernel(SDPBackend.MATH), implicit_replication():
            logits, loss = m(idx, idx)
            loss.backward()
        tied = m.lm_head.weight is m.transformer.wte.weight
    else:  # an HF model, unchanged: local tensors through its -1 head views
        parallelize_with_dtensor(m, mesh, plan)
        out = m(input_ids=idx, labels=idx)
        logits, loss = out.logits, out.loss
        loss.backward()
        tied = None
    grads = {n: _full(p.grad).detach().clone() for n, p in m.named_parameters()}
    return _full(logits).detach(), _full(loss).detach(), tied, grads


@pytest.mark.real
@pytest.mark.timeout(240)
def test_dtensor_plan_reproduces_unsharded_models_on_two_gloo_ranks(real_ranks):
    torch.manual_seed(0)
    gpt = build("gpt-tiny", fused_qkv=False, vocab_size=VOCAB)
    llama = _hf("llama")
    idx = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    for family, model in (("gpt", gpt), ("llama", llama)):
        plan = shardplan.plan(model, 2)
        styles = to_dtensor_plan(plan, model=model, local_output=family != "gpt")
        assert styles, family
        logits, loss, grads = _reference(model, idx, hf=family != "gpt")
        results = real_ranks(2).run(_dtensor_step, model, idx, plan, family)
        for rank, (got_logits, got_loss, tied, got_grads) in enumerate(results):
            msg = f"{family} rank {rank}"
            torch.testing.assert_close(got_logits, logits, atol=2e-5, rtol=1e-4, msg=msg)
            torch.testing.assert_close(got_loss, loss, atol=2e-5, rtol=1e-4, msg=msg)
            assert tied in (True, None), msg
            assert set(got_grads) == set(grads), msg
            for name, g in grads.items():
                torch.testing.assert_close(got_grads[name], g, atol=2e-5, rtol=1e-4, msg=f"{msg} {name}")


def test_dtensor_styles_for_the_bundled_gpt():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = build("gpt-tiny", fused_qkv=False, vocab_size=VOCAB, device="meta")
    plan = shardplan.plan(model, 2)
    with pytest.raises(shardplan.LayoutError, match=r"models/gpt.py:57: .*t.view\(B, T, self.n_head, hd\)"):
        to_dtensor_plan(plan, model=model)  # local q/k/v viewed with the model's full head count
    styles = to_dtensor_plan(plan, model=model, local_output=False)
    assert list(styles)[0] == "transformer.wte"  # in model order
    assert isinstance(styles["transformer.wte"], RowwiseParallel)
    assert styles["transformer.wte"].input_layouts == (Replicate(),)
    head = styles["lm_head"]
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Replicate(),)
    for i in range(2):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.c_fc"):
            s = styles[f"transformer.h.{i}.{name}"]
            assert isinstance(s, ColwiseParallel) and s.output_layouts == (Shard(-1),)
            assert not s.use_local_output
        for name in ("attn.c_proj", "mlp.c_proj"):
            assert isinstance(styles[f"transformer.h.{i}.{name}"], RowwiseParallel)
    assert len(styles) == 2 + 2 * 6
    notes = export_issues(plan)
    assert [i.fatal for i in notes] == [False, False]  # the padded vocabulary, embedding and head
    assert all("padded vocabulary" in i.reason for i in notes)
    idx = torch.zeros(2, 8, dtype=torch.long, device="meta")
    with_loss = shardplan.plan(model, 2, example_inputs=(idx, idx))  # a vocab-parallel loss
    assert any("loss on gathered logits" in i.reason and not i.fatal for i in export_issues(with_loss))
    assert to_dtensor_plan(with_loss, model=model, local_output=False).keys() == styles.keys()


def test_fused_qkv_cannot_be_exported_and_says_why():
    model = build("gpt-tiny", device="meta")
    plan = shardplan.plan(model, 2)
    with pytest.raises(shardplan.LayoutError) as e:
        to_dtensor_plan(plan, model=model)
    text = str(e.value)
    assert "transformer.h.0.attn.c_attn" in text and "transformer.h.1.attn.c_attn" in text
    assert "S(0|32+32+32)" in text and "blocked" in text
    with pytest.raises(shardplan.LayoutError, match="two equal blocks"):
        to_hf_tp_plan(plan, model=model)
    fatal = [i for i in export_issues(plan, "dtensor") if i.fatal]
    assert [i.module for i in fatal] == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]


def test_other_unexportable_layouts_are_named():
    model = build("gpt-tiny", fused_qkv=False, device="meta")
    plan = shardplan.plan(model, 2)

    def edit(name, layout):
        params = [p.model_copy(update={"layout": layout}) if p.name == name else p for p in plan.params]
        return plan.model_copy(update={"params": params})

    grouped = edit("transformer.h.0.attn.k_proj.weight", "S(0|x2)")
    with pytest.raises(shardplan.LayoutError, match="group of 2 ranks"):
        to_dtensor_plan(grouped, model=model)
    conv1d = edit("transformer.h.0.mlp.c_fc.weight", "S(1)")
    with pytest.raises(shardplan.LayoutError, match="Conv1D"):
        to_hf_tp_plan(conv1d, model=model)
    packed = edit("transformer.h.0.mlp.c_fc.weight", "S(0|64+64)")
    packed = packed.model_copy(update={"params": [
        p.model_copy(update={"layout": "S(0|64+64)"}) if p.name == "transformer.h.0.mlp.c_fc.bias" else p
        for p in packed.params]})
    assert not [i for i in export_issues(packed, "hf") if i.fatal]  # packed_colwise
    with pytest.raises(shardplan.LayoutError, match="one piece"):
        to_dtensor_plan(packed, model=model)
    wrong_type = build("gpt-tiny", fused_qkv=False, device="meta")
    wrong_type.transformer.h[0].mlp.c_fc = torch.nn.Identity()
    with pytest.raises(shardplan.LayoutError, match="Identity is not an nn.Linear"):
        to_dtensor_plan(plan, model=wrong_type)


def test_hf_plan_for_llama_matches_transformers_own():
    tf = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    from shardplan.export import ModelCode

    cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=96, vocab_size=128,
                         max_position_embeddings=64, use_cache=False)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    example = {"input_ids": torch.zeros(2, 8, dtype=torch.long, device="meta")}
    plan = shardplan.plan(model, 2, example_inputs=example)
    # one ModelCode for both exports: the plan's capture and one cut capture (the export
    # made without one equals the shared one: test_both_exports_read_the_plans_capture_...)
    code = ModelCode(model, example)
    hf = to_hf_tp_plan(plan, model=model, code=code)
    assert hf == model.tp_plan  # lm_head colwise_gather_output, model.embed_tokens, model.layers.*
    base = to_hf_tp_plan(plan, model=model, prefix="model", code=code)
    assert {k: v for k, v in base.items() if k != "embed_tokens"} == dict(cfg.base_model_tp_plan)
    assert base["embed_tokens"] == "embedding_rowwise"
    assert set(hf.values()) <= set(ALL_PARALLEL_STYLES.keys())


def test_hf_plan_for_the_bundled_llama_names_its_head_count_views():
    model = build("llama-tiny", device="meta")
    plan = shardplan.plan(model, 2)
    with pytest.raises(shardplan.LayoutError) as e:
        to_hf_tp_plan(plan, model=model)
    assert e.value.where == "layers.*.attention"
    assert "models/llama.py:96: q = self.wq(x).view(B, T, self.n_heads, self.head_dim)" in str(e.value)
    with pytest.raises(TypeError, match="model"):
        plan.to_hf_tp_plan()


def test_hf_exports_that_would_run_wrong_are_refused_naming_the_line():
    """OPT views by its head count, OLMo2 norms q/k over every head, GPT-2's Conv1D stores (in, out):
    no tp_plan spells those plans (the runtime checks of the exported ones are in
    test_survey_family_exports_run_equal_or_are_refused_as_recorded)."""
    for family, line in (("opt", "modeling_opt.py:154: query_states = query_states.view(bsz, -1, self.num_heads"),
                         ("olmo2", "modeling_olmo2.py"), ("gpt2", "Conv1D")):
        model = _hf(family, "meta")
        plan = shardplan.plan(model, 2)
        with pytest.raises(shardplan.LayoutError, match=re.escape(line)):
            to_hf_tp_plan(plan, model=model)


def test_both_exports_read_the_plans_capture_and_one_cut_capture():
    """One ``ModelCode`` serves both exports: the capture as it is is the plan's own, one
    cut capture serves both targets, and the HF export is the one made without sharing."""
    from shardplan.planner.capture import planned_capture
    from shardplan.export import ModelCode

    model = _hf("llama", "meta")
    plan = shardplan.plan(model, 2)
    code = ModelCode(model)
    hf = to_hf_tp_plan(plan, model=model, code=code)
    styles = to_dtensor_plan(plan, model=model, code=code)
    assert code.whole(plan)[0] is planned_capture(plan)[3]
    assert len(code._cuts) == 1
    assert hf == to_hf_tp_plan(plan, model=model)
    assert len(styles) == 2 + 2 * 7  # embedding, head, 7 linears in each of 2 layers
    copied = plan.model_copy()  # an edited or loaded plan: captured afresh
    assert planned_capture(copied) is None and copied == plan


def _dtensor_sp_step(ctx, model, idx, styles_plan):
    """On each rank: the exported sequence-parallel styles on a copy, one forward/backward."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    m = copy.deepcopy(model)
    parallelize_with_dtensor(m, mesh, styles_plan)
    out = m(input_ids=idx, labels=idx)
    out.loss.backward()
    grads = {n: _full(p.grad).detach().clone() for n, p in m.named_parameters()}
    return _full(out.logits).detach(), _full(out.loss).detach(), grads


@pytest.mark.real
@pytest.mark.timeout(120)
def test_sequence_parallel_plan_exports_dtensor_sp_styles_on_two_gloo_ranks(real_ranks):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    llama = _hf("llama")
    plan = shardplan.plan(llama, 2, sequence_parallel=True)
    assert plan.sequence_parallel
    styles = to_dtensor_plan(plan, model=llama)
    kinds = {k: (type(v).__name__, getattr(v, "input_layouts", None), getattr(v, "output_layouts", None))
             for k, v in styles.items()}
    assert kinds["model.embed_tokens"] == ("RowwiseParallel", (Replicate(),), (Shard(1),))
    assert kinds["model.layers.0.self_attn.q_proj"][:2] == ("ColwiseParallel", (Shard(1),))
    assert kinds["model.layers.1.mlp.down_proj"] == ("RowwiseParallel", (Shard(-1),), (Shard(1),))
    for norm in ("model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"):
        assert isinstance(styles[norm], SequenceParallel), norm
    assert isinstance(styles["lm_head"], ColwiseParallel)
    assert styles["lm_head"].input_layouts == (Shard(1),) and styles["lm_head"].output_layouts == (Replicate(),)
    assert not any(isinstance(v, RowwiseParallel) and v.output_layouts == (Replicate(),)
                   for k, v in styles.items() if k != "model.embed_tokens")

    idx = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    logits, loss, grads = _reference(llama, idx, hf=True)
    for rank, (got_logits, got_loss, got_grads) in enumerate(real_ranks(2).run(_dtensor_sp_step, llama, idx,
                                                                                 plan)):
        msg = f"rank {rank}"
        torch.testing.assert_close(got_logits, logits, atol=2e-5, rtol=1e-4, msg=msg)
        torch.testing.assert_close(got_loss, loss, atol=2e-5, rtol=1e-4, msg=msg)
        assert set(got_grads) == set(grads), msg
        for name, g in grads.items():
            torch.testing.assert_close(got_grads[name], g, atol=2e-5, rtol=1e-4, msg=f"{msg} {name}")


def test_sequence_parallel_fallback_without_a_style_is_named():
    llama = _hf("llama")
    plan = shardplan.plan(llama, 2, sequence_parallel=True)
    c = next(c for c in plan.collectives if str(c.purpose) == "seq_gather")
    fake = c.model_copy(update={"purpose": "seq_unshard", "module": "model.layers.1.input_layernorm"})
    broken = plan.model_copy(update={"collectives": [*plan.collectives, fake]})
    with pytest.raises(shardplan.LayoutError, match=r"model\.layers\.1\.input_layernorm.*seq_unshard"):
        to_dtensor_plan(broken, model=llama)


# Every survey family's tp 2 exports (``benchmarks.coverage.REPRESENTATIVE``), as the
# survey runs them: HF and DTensor, each "runs equal" or refused with the reason recorded
# here (a fragment of the exporter's first problem); a change either way fails.
EQUAL = "runs equal"
BLOCKED = "blocked shard"  # a fused QKV / gate-up (DTensor: any blocks; HF: more than two)
CONSTANT = "divides a size by tp here that the model's code computes from a constant"
EXPERTS = "experts' 3-D weights"
QK_NORM = "read on this rank's part at"  # a q/k norm's partial gradient: DTensor cannot sum it
GROUPED = "held by a group of"  # a fused multi-query QKV: K/V parts held by pairs of ranks
DISTRIBUTED = "a reduction over the split dim run distributed"
TIED = "no style places it here"
GATHERED = "a split activation all-gathered for an op"  # the gather move (Mamba's conv)
SPLIT = "the plan reads a whole tensor as this rank's part"  # T5's position bias
# refusals found in the model's own code name its source line
AT_A_LINE = {CONSTANT, QK_NORM, DISTRIBUTED, SPLIT, GATHERED}
SURVEY_EXPORTS = {
    "gpt2": ("Conv1D", "Conv1D"),
    "gptj": (EQUAL, EQUAL), "gpt_neox": (EQUAL, EQUAL),
    "opt": (CONSTANT, CONSTANT), "bloom": (CONSTANT, CONSTANT),
    "falcon": (GROUPED, GROUPED),
    "llama": (EQUAL, EQUAL), "mistral": (EQUAL, EQUAL), "mixtral": (EQUAL, EXPERTS),
    "qwen2": (EQUAL, EQUAL), "qwen2_moe": (EQUAL, EXPERTS), "gemma": (EQUAL, EQUAL),
    "gemma2": (EQUAL, EQUAL), "phi": (EQUAL, EQUAL), "phi3": (BLOCKED, BLOCKED),
    "stablelm": (CONSTANT, CONSTANT), "cohere": (EQUAL, EQUAL), "glm": (EQUAL, BLOCKED),
    "helium": (EQUAL, EQUAL), "olmo": (EQUAL, EQUAL), "olmo2": (DISTRIBUTED, DISTRIBUTED),
    "bert": (TIED, TIED), "roberta": (TIED, TIED),
    "t5": (SPLIT, SPLIT),
    "bart": (EQUAL, EQUAL), "gpt_bigcode": (GROUPED, GROUPED), "codegen": (EQUAL, EQUAL),
    "persimmon": (CONSTANT, QK_NORM), "mpt": (BLOCKED, BLOCKED), "qwen3": (EQUAL, QK_NORM),
    "deepseek_v3": ("no exported module owns it", EXPERTS), "dbrx": (BLOCKED, BLOCKED),
    "gemma3_text": (EQUAL, QK_NORM), "deberta-v2": (TIED, TIED), "mamba": (GATHERED, GATHERED),
    "xglm": (CONSTANT, CONSTANT), "gpt_neo": (CONSTANT, CONSTANT), "qwen3_moe": (EQUAL, EXPERTS),
    "olmoe": (DISTRIBUTED, DISTRIBUTED), "starcoder2": (EQUAL, EQUAL),
    "gpt_oss": ("planned with several roles", "planned with several roles"),
    "deepseek_v2": ("no exported module owns it", EXPERTS), "nemotron": (EQUAL, EQUAL),
    "electra": (EQUAL, EQUAL), "mbart": (EQUAL, EQUAL),
}


@pytest.fixture(scope="module")
def survey_exports(real_ranks, tmp_path_factory):
    """Every survey family built tiny, planned at tp 2, exported both ways and run in both
    runtimes on 2 real gloo ranks (``family_exports.run_families``: one pool for all, each
    rank preparing every other family)."""
    from benchmarks import coverage, family_exports

    assert sorted(SURVEY_EXPORTS) == sorted(coverage.REPRESENTATIVE)  # the survey's own list
    return family_exports.run_families(list(coverage.REPRESENTATIVE), tmp_path_factory.mktemp("exports"),
                                     real_ranks(2))


@pytest.mark.real
@pytest.mark.timeout(900)  # the first family's setup launches every family's exports
@pytest.mark.xdist_group("survey-exports")  # one worker: the module fixture runs once
@pytest.mark.parametrize("family", sorted(SURVEY_EXPORTS))
def test_survey_family_exports_run_equal_or_are_refused_as_recorded(survey_exports, family):
    """The HF tp_plan (``from_pretrained(tp_plan=...)``) and the DTensor styles
    (``parallelize_module`` on the unpatched model), each on 2 real gloo ranks: every rank's
    logits (HF: also under ``no_grad``), loss and gradients equal the unsharded model's, with
    exactly the plan's parameters split; or the exporter refuses with a LayoutError naming a
    module of the model. Which of the two, and the refusal's reason, as recorded."""
    got = survey_exports[family]
    assert "not_planned" not in got, got
    modules = set(got["modules"])
    for target, want in zip(("hf", "dtensor"), SURVEY_EXPORTS[family]):
        outcome = got[target]
        if want == EQUAL:
            assert outcome == EQUAL, f"{family} {target}: {outcome}"
            continue
        assert outcome.startswith("refused: ") and want in outcome, f"{family} {target}: {outcome}"
        named = outcome[len("refused: "):].split(" [", 1)[0]
        pattern = re.compile(re.escape(named).replace(r"\*", r"\d+") + "$")
        assert any(pattern.match(m) for m in modules), f"{family} {target}: {named}"
        if want in AT_A_LINE:
            assert re.search(r"\.py:\d+: ", outcome), f"{family} {target}: {outcome}"
