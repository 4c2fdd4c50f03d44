"""Every private torch API shardplan uses, in one place.

Each was checked against torch 2.13.0, the release shardplan pins (pyproject.toml);
when torch moves one, this is the file to change. Why no public API serves:

- ``pytree``/``tree_flatten_spec`` (``torch.utils._pytree``, ``torch.fx._pytree``):
  torch has no public pytree module; export's input and output specs are these
  ``TreeSpec`` objects, and flattening a call by the spec is how torch itself feeds
  an exported graph.
- ``OpOverload``/``OpOverloadPacket`` (``torch._ops``): the classes of
  ``torch.ops.aten.x.default`` and ``torch.ops.aten.x``, not exported publicly.
- ``FakeTensor``/``FakeTensorMode``/``is_fake`` (``torch._subclasses.fake_tensor``):
  what export leaves in ``node.meta["val"]`` and runs on; no public alias.
- ``funcol`` (``torch.distributed._functional_collectives``): the traceable
  collectives ``torch.compile`` lowers; the public ``torch.distributed`` ones are
  in-place and graph-breaking.
- ``CustomGraphPass``/``get_hash_for_files`` (``torch._inductor.custom_graph_pass``):
  the base class Inductor's ``post_grad_custom_post_pass`` option documents.
- ``WAIT_TENSOR`` (``torch.ops._c10d_functional``): the wait op ``funcol`` emits.
- ``mkldnn_linear`` (``torch.ops.mkldnn._linear_pointwise``): oneDNN's linear;
  ``torch.nn.functional.linear`` does not choose oneDNN on CPU.
- ``safe_softmax`` (``torch.ops.aten._safe_softmax``): the softmax the math
  ``scaled_dot_product_attention`` computes (0, not nan, on fully masked rows).
- ``current_graph_task_id`` (``torch._C``): whether autograd is running a backward
  now (a recomputed block's forward inside backward); ``torch.autograd.graph`` has
  no public query for it.
- ``flatten_state_dict``/``set_element`` (``torch.distributed.checkpoint._nested_dict``,
  ``._traverse``): how DCP's own planners flatten a nested state dict and write
  back into it; DCP exports no public equivalent.
- ``compute_local_shape_and_global_offset`` (``torch.distributed.tensor._utils``):
  a ``DTensor`` shard's offset in the global tensor, as DCP reads it.
- ``set_child`` (``Module._modules``): ``register_module`` refuses a name that is
  also an attribute of the parent (a child named ``decoder`` under a module with a
  ``decoder`` attribute); writing the registry lists the child and keeps the attribute.
- ``share_parameters`` (``Module._parameters``): two modules reading one parameter
  registry, so a swap in one (FSDP2 between sharded and gathered) is seen by both;
  no public API shares a registry.
- ``FusedInfCheck``, ``found_inf_per_device``, ``scale_device``
  (``torch.amp.GradScaler``): ``step`` checks an optimizer that unscales itself
  (fused AdamW) with ``_check_inf_per_device`` instead of ``unscale_``, with no
  public hook; ``ShardedGradScaler(process_group=...)`` agrees only in ``unscale_``
  and takes only a torch process group. The found-inf flags and the scale's device
  are the scaler's private state.
- ``uncached_fake_dispatch`` (``torch._dynamo.config.fake_tensor_cache_enabled``): export's
  fake-tensor dispatch cache rebuilds each hit's output from symbolic sizes, dearer than
  running the op's meta function where batch and sequence are symbolic (a capture takes
  a third to a half longer with it); the switch is only in dynamo's config.
"""

from __future__ import annotations

import torch
import torch._dynamo.config
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.fx._pytree import tree_flatten_spec

__all__ = ["pytree", "tree_flatten_spec", "OpOverload", "OpOverloadPacket", "FakeTensor",
           "FakeTensorMode", "is_fake", "funcol", "CustomGraphPass", "get_hash_for_files",
           "WAIT_TENSOR", "mkldnn_linear", "safe_softmax", "current_graph_task_id",
           "flatten_state_dict", "set_element", "compute_local_shape_and_global_offset",
           "set_child", "share_parameters", "FusedInfCheck", "found_inf_per_device",
           "scale_device", "uncached_fake_dispatch"]

WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
safe_softmax = torch.ops.aten._safe_softmax
current_graph_task_id = torch._C._current_graph_task_id


def mkldnn_linear(*args):
    """oneDNN's linear (looked up per call: a build without oneDNN has no such op)."""
    return torch.ops.mkldnn._linear_pointwise(*args)


def set_child(parent: nn.Module, name: str, child: nn.Module) -> None:
    """List ``child`` as ``parent``'s submodule ``name``, even where ``name`` is also an
    attribute of ``parent`` (which then still wins on attribute access)."""
    parent._modules[name] = child


def share_parameters(reader: nn.Module, owner: nn.Module) -> None:
    """Make ``reader``'s own parameters ``owner``'s, one registry for both."""
    reader._parameters = owner._parameters


class FusedInfCheck:
    """Mixin for a ``torch.amp.GradScaler`` subclass: the inf check ``step`` runs for an
    optimizer that unscales itself is followed by ``self.agree_inf(optimizer)``, which
    returns the optimizer's found-inf flags."""

    def _check_inf_per_device(self, optimizer):
        super()._check_inf_per_device(optimizer)
        return self.agree_inf(optimizer)


def found_inf_per_device(scaler: torch.amp.GradScaler, optimizer) -> dict:
    """``{device: flag}`` of ``scaler``'s inf checks for ``optimizer`` this iteration."""
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]


def scale_device(scaler: torch.amp.GradScaler) -> torch.device:
    """The device of ``scaler``'s scale (set by its first ``scale``)."""
    return scaler._scale.device


def uncached_fake_dispatch():
    """A context in which fake tensors run every op's meta function (no dispatch cache)."""
    return torch._dynamo.config.patch(fake_tensor_cache_enabled=False)
