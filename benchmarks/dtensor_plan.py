"""The best hand-written DTensor tensor-parallel plans for the bundled models.

What a careful user of ``torch.distributed.tensor.parallel`` writes by hand
(the torchtitan recipe), for comparison with shardplan:

- vocab embedding ``RowwiseParallel(input_layouts=Replicate())`` (one
  all-reduce forward);
- per block, a ``PrepareModuleInput`` on the attention (and, for Llama's
  SwiGLU, on the MLP) that makes its input one replicated DTensor, so q, k and
  v (w1 and w3) share it and the backward sums their input gradients once
  (one all-reduce, Megatron's f) instead of once per projection;
- q/k/v and the MLP's first linears ``ColwiseParallel()`` (local outputs),
  output projections ``RowwiseParallel()`` (Megatron's g);
- the LM head ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``
  and the loss under ``loss_parallel()``, so the logits are never gathered.

Local outputs mean the attention's code sees this rank's heads: Llama reads
its head counts from attributes (divided by tp here, as torchtitan does); the
bundled GPT computes ``C // n_head`` from its input, so its attention forward
is replaced by the same computation reading the local head count
(``_local_head_forward``): the one model edit this plan needs. A fused q/k/v
cannot be expressed with local outputs (DTensor shards a weight in one piece,
so a rank would hold all of q and half of k): ``hand_written`` needs separate
q/k/v. ``global_activations()`` is the same plan with the model unchanged
(q/k/v DTensors with global shapes through attention; fused q/k/v allowed),
``exported()`` shardplan's plan through ``parallelize_with_dtensor`` (global
shapes too, the loss on gathered logits). ``sequence_parallel()`` is the
hand-written plan with Megatron's sequence parallelism (torchtitan's recipe).
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F

__all__ = ["hand_written", "sequence_parallel", "global_activations", "global_context",
           "exported", "exported_context", "loss_context", "full"]


def _local_head_forward(self, x):
    """The bundled GPT's attention with ``self.n_head`` this rank's heads (same math)."""
    B, T, _ = x.shape
    hd = self.n_embd // self.n_head_full
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                       is_causal=True)
    return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)))


def _gpt_styles(model, local: bool = True) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel)
    if model.config.fused_qkv and local:
        raise ValueError("a fused q/k/v has no DTensor style: build the GPT with fused_qkv=False")
    styles = {"transformer.wte": RowwiseParallel(input_layouts=Replicate()),
              "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.transformer.h)):
        p = f"transformer.h.{i}"
        qkv = ["c_attn"] if model.config.fused_qkv else ["q_proj", "k_proj", "v_proj"]
        styles.update({
            f"{p}.attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                            desired_input_layouts=(Replicate(),)),
            **{f"{p}.attn.{n}": ColwiseParallel(use_local_output=local) for n in qkv},
            f"{p}.attn.c_proj": RowwiseParallel(),
            f"{p}.mlp.c_fc": ColwiseParallel(), f"{p}.mlp.c_proj": RowwiseParallel(),
        })
    return styles


def _llama_styles(model) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel)
    styles = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
              "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.layers)):
        p = f"layers.{i}"
        styles.update({
            f"{p}.attention": PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                                 desired_input_layouts=(Replicate(), None, None)),
            f"{p}.attention.wq": ColwiseParallel(), f"{p}.attention.wk": ColwiseParallel(),
            f"{p}.attention.wv": ColwiseParallel(), f"{p}.attention.wo": RowwiseParallel(),
            f"{p}.feed_forward": PrepareModuleInput(input_layouts=(Replicate(),),
                                                    desired_input_layouts=(Replicate(),)),
            f"{p}.feed_forward.w1": ColwiseParallel(), f"{p}.feed_forward.w3": ColwiseParallel(),
            f"{p}.feed_forward.w2": RowwiseParallel(),
        })
    return styles


def hand_written(model, mesh):
    """Parallelize ``model`` (a bundled GPT with separate q/k/v, or a Llama) in place with
    the hand-written plan; run its forward and backward under ``loss_context()``."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh.size()
    if hasattr(model, "transformer"):
        parallelize_module(model, mesh, _gpt_styles(model))
        for block in model.transformer.h:
            attn = block.attn
            attn.n_head_full = attn.n_head
            attn.n_head //= tp
            attn.forward = types.MethodType(_local_head_forward, attn)
        if model.config.tie_weights:  # parallelize_module made a new parameter per module
            model.lm_head.weight = model.transformer.wte.weight
    else:
        parallelize_module(model, mesh, _llama_styles(model))
        for layer in model.layers:
            layer.attention.n_heads //= tp
            layer.attention.n_kv_heads //= tp
    return model


def _gpt_sequence_styles(model) -> dict:
    """torchtitan's sequence-parallel recipe on the bundled GPT (separate q/k/v): the
    residual stream is this rank's tokens (local ``[B, T/t, C]``), norms
    ``SequenceParallel``, each sublayer's input all-gathered once by a
    ``PrepareModuleInput`` (``Shard(1)`` -> ``Replicate``), row outputs reduce-scattered
    (``output_layouts=Shard(1)``), the head reading ``Shard(1)`` and giving class-sharded
    logits for ``loss_parallel``. The learned position embedding's ``[T, C]`` output is
    cut onto the tokens (``Shard(0)``) to add to the embedding's ``Shard(1)`` output."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel)
    if model.config.fused_qkv:
        raise ValueError("a fused q/k/v has no DTensor style: build the GPT with fused_qkv=False")
    tokens = lambda: PrepareModuleInput(input_layouts=(Shard(1),),  # noqa: E731
                                        desired_input_layouts=(Replicate(),))
    styles = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                           use_local_output=False),
        "transformer.wpe": PrepareModuleOutput(output_layouts=Replicate(),
                                               desired_output_layouts=Shard(0),
                                               use_local_output=False),
        "transformer.drop": PrepareModuleOutput(output_layouts=Shard(1),
                                                desired_output_layouts=Shard(1),
                                                use_local_output=True),
        "transformer.ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                   use_local_output=False)}
    for i in range(len(model.transformer.h)):
        p = f"transformer.h.{i}"
        styles.update({
            f"{p}.ln_1": SequenceParallel(), f"{p}.ln_2": SequenceParallel(),
            f"{p}.attn": tokens(), f"{p}.mlp": tokens(),
            **{f"{p}.attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")},
            f"{p}.attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
            f"{p}.mlp.c_fc": ColwiseParallel(),
            f"{p}.mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    return styles


def sequence_parallel(model, mesh):
    """Parallelize the bundled GPT (separate q/k/v) in place with the hand-written
    sequence-parallel plan (``_gpt_sequence_styles``); run it under ``loss_context()``."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, _gpt_sequence_styles(model))
    for block in model.transformer.h:
        attn = block.attn
        attn.n_head_full = attn.n_head
        attn.n_head //= mesh.size()
        attn.forward = types.MethodType(_local_head_forward, attn)
    if model.config.tie_weights:  # parallelize_module made a new parameter per module
        model.lm_head.weight = model.transformer.wte.weight
    return model


def global_activations(model, mesh):
    """The hand-written GPT plan with the model unchanged (fused q/k/v too): q/k/v stay
    DTensors with global shapes through attention, whose sharding rules decide the
    communication. Run it under ``global_context()``."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, _gpt_styles(model, local=False))
    if model.config.tie_weights:
        model.lm_head.weight = model.transformer.wte.weight
    return model


@contextlib.contextmanager
def global_context():
    """``exported_context()`` and ``loss_parallel()`` together."""
    with exported_context(), loss_context():
        yield


def loss_context():
    """``loss_parallel()``: cross-entropy on class-sharded logits (forward and backward)."""
    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel()


def exported(model, mesh, example_inputs):
    """shardplan's plan exported to DTensor styles, the model unchanged (global-shape
    DTensor activations); run it under ``exported_context()``."""
    import shardplan
    from shardplan.export import parallelize_with_dtensor

    plan = shardplan.plan(model, mesh.size(), example_inputs=example_inputs)
    return parallelize_with_dtensor(model, mesh, plan, local_output=False)


@contextlib.contextmanager
def exported_context():
    """What the exported model needs on CPU: SDPA's math kernel (the one with a DTensor
    rule) and implicit replication of its plain tensors (the causal mask)."""
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH), implicit_replication():
        yield


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a plain tensor as is)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
