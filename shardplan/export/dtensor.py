"""A plan as DTensor parallel styles, for ``parallelize_module(model, mesh, styles)``.

==========================  ==================================================
shardplan decision          DTensor style
==========================  ==================================================
column, weight ``S(0)``     ``ColwiseParallel(use_local_output=local_output)``
column whose output the     ``ColwiseParallel(output_layouts=DReplicate())``
plan gathers (an LM head)
row, weight ``S(1)``        ``RowwiseParallel()``
vocab_embedding             ``RowwiseParallel(input_layouts=Replicate())``
replicated / no decision    (no entry: the module stays as it is)
==========================  ==================================================

A sequence-parallel plan (``Plan.sequence_parallel``) exports torchtitan's layout:
the embedding ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``,
row layers that reduce-scatter ``RowwiseParallel(output_layouts=Shard(1))``, column
layers ``ColwiseParallel(input_layouts=Shard(1))`` (they all-gather their tokens) and
``SequenceParallel()`` for the leaf modules run on tokens (norms, dropout). The
residual stream stays a DTensor ``Shard(1)`` between modules, so the model's code
reads the global sequence length from it. A ``seq_unshard`` fallback inside a leaf
module raises ``LayoutError``; one in the model's own code between modules is a note
(DTensor's op rule redistributes there, e.g. HF's ``logits_to_keep`` slice).

Tied weights must be tied again after ``parallelize_module`` (``parallelize_with_dtensor``
does it: ``tie_again``).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from ..errors import LayoutError
from ..planner.transitions import Purpose
from .check import ModelCode, checked_styles
from .styles import ExportIssue, owner_of, raise_fatal


def to_dtensor_plan(plan, *, model, local_output: bool = True, example_inputs=None,
                    code: ModelCode | None = None) -> dict:
    """``{module FQN: ParallelStyle}`` for ``parallelize_module(model, mesh, ...)``.

    ``local_output=True`` (the default, as in torchtitan) hands plain local tensors
    from column-parallel layers to the model's own code, unchanged: the export is
    refused (``LayoutError`` naming the module and source line) where that code
    would compute a wrong size from a constant, e.g. ``view(B, T, self.n_heads, D)``
    (checked by capturing ``model`` on fake tensors, with ``example_inputs`` if given). With
    ``local_output=False`` they stay DTensors with global shapes, so sizes need no
    change, but every op between a column and a row layer must have a DTensor
    sharding rule (on CPU: run attention under ``sdpa_kernel(SDPBackend.MATH)`` and
    ``implicit_replication()``).

    Every styled module must be an ``nn.Linear`` (``nn.Embedding`` for the
    vocabulary). ``code``: a ``ModelCode`` of ``model`` shared with the other export.
    Raises ``LayoutError`` for layouts with no DTensor style (see ``export_issues``).
    """
    mods = checked_styles(plan, "dtensor", model, example_inputs=example_inputs, code=code,
                          run_code=local_output)
    if getattr(plan, "sequence_parallel", False):
        return _sp_styles(plan, mods, model, local_output)
    out: dict[str, ParallelStyle] = {}
    for m in mods.values():
        if m.style == "column":
            out[m.path] = ColwiseParallel(use_local_output=local_output)
        elif m.style == "column_gather":
            out[m.path] = ColwiseParallel(output_layouts=DReplicate())
        elif m.style == "row":
            out[m.path] = RowwiseParallel()
        elif m.style == "embedding":
            out[m.path] = RowwiseParallel(input_layouts=DReplicate())
    return out


def _sp_styles(plan, mods, model, local_output: bool) -> dict:
    """Styles for a sequence-parallel plan (torchtitan's ``enable_sequence_parallel`` layout).

    The residual stream stays a DTensor ``Shard(1)`` between modules (embedding,
    row layers and norms keep DTensor outputs), so the model's own code reads the
    global sequence length (positions, masks) from it; column layers all-gather
    their tokens (``input_layouts=Shard(1)``) and hand the code local slices as
    without sequence parallelism.
    """
    scatters = {c.module for c in plan.collectives if c.purpose == Purpose.SEQ_SCATTER}
    gathers = any(c.purpose == Purpose.SEQ_GATHER for c in plan.collectives)
    out: dict[str, ParallelStyle] = {}
    for path in _sp_leaves(plan, model):
        if path not in mods:
            out[path] = SequenceParallel()
    bad = []
    for m in mods.values():
        tokens_in = DShard(1) if gathers else DReplicate()
        if m.style == "column":
            out[m.path] = ColwiseParallel(input_layouts=tokens_in, use_local_output=local_output)
        elif m.style == "column_gather":
            out[m.path] = ColwiseParallel(input_layouts=tokens_in, output_layouts=DReplicate())
        elif m.style == "row":
            if m.path not in scatters:
                bad.append(ExportIssue(m.path, "P", "a row layer whose sum the plan all-reduces inside a "
                                       "sequence-parallel plan: no style spells the Replicate->Shard(1) step"))
                continue
            out[m.path] = RowwiseParallel(output_layouts=DShard(1), use_local_output=False)
        elif m.style == "embedding":
            if m.path in scatters:
                out[m.path] = RowwiseParallel(input_layouts=DReplicate(), output_layouts=DShard(1),
                                              use_local_output=False)
            else:
                out[m.path] = RowwiseParallel(input_layouts=DReplicate())
    raise_fatal(bad, "dtensor")
    return out


def _sp_leaves(plan, model) -> list[str]:
    """Leaf modules (norms, dropout) the plan runs on this rank's tokens: ``SequenceParallel()``."""
    seen = dict.fromkeys(d.module for d in plan.decisions if getattr(d, "sequence", False) and d.module)
    out = []
    for path in seen:
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        if not any(True for _ in mod.children()):
            out.append(path)
    return out


def parallelize_with_dtensor(model, mesh, plan, *, local_output: bool = True):
    """``parallelize_module(model, mesh, to_dtensor_plan(plan))``, then ``tie_again``."""
    styles = to_dtensor_plan(plan, local_output=local_output, model=model)
    parallelize_module(model, mesh, styles)
    tie_again(model, plan)
    return model


def tie_again(model, plan) -> None:
    """Tie again the weights the plan lists as aliases (``parallelize_module`` makes a new
    parameter per module)."""
    for p in plan.params:
        if not p.aliases:
            continue
        canonical = model.get_parameter(p.name)
        for alias in p.aliases:
            mod, attr = owner_of(alias)
            owner = model.get_submodule(mod)
            current = getattr(owner, attr)
            if current is canonical:
                continue
            if getattr(current, "placements", None) != getattr(canonical, "placements", None):
                raise LayoutError(f"tied weights {p.name} and {alias} were placed differently "
                                  f"({getattr(canonical, 'placements', None)} vs "
                                  f"{getattr(current, 'placements', None)})", where=alias,
                                  fix="give both modules styles that shard the weight the same way")
            setattr(owner, attr, canonical)
