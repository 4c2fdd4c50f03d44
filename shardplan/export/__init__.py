"""A plan in other tools' words: DTensor parallel styles and Hugging Face tp_plan strings.

``to_dtensor_plan(plan, model=...)`` maps module FQNs to
``torch.distributed.tensor.parallel`` styles for ``parallelize_module(model, mesh,
styles)`` (``dtensor``); ``to_hf_tp_plan(plan, model=...)`` gives the same as Hugging
Face ``tp_plan`` strings (``hf``). Both read the styles ``styles.analyse`` settles from
the plan alone, then run the export check (``check``): an export is a promise that the
target runtime runs the model's own, unchanged code right, so both need the model,
capture it as the runtime would run it (column layers hand it local tensors, nothing
else adapts) and refuse, naming module and source line, where a size would come out
wrong (a view by ``self.num_heads``, mixed layouts in one attention).

What cannot be exported raises ``LayoutError`` naming every such module;
``export_issues(plan, target)`` lists the problems (and the notes: what is
exported but communicates differently) without raising:

- blocked shards ``S(0|a+b+c)`` (a fused QKV: each rank holds its slice of
  every block). DTensor's public styles shard a weight in one piece; Hugging
  Face's ``packed_colwise`` / ``packed_rowwise`` express exactly two equal
  blocks (fused gate/up), so those export there, other blocks nowhere;
- shards held by groups of ranks ``S(d|xR)`` (fewer KV heads than tp);
- ``partial`` decisions (a contraction of a split activation with another
  activation, not a parameter): no module style places that;
- a module planned with two different roles (called twice);
- split weights stored (in, out) (HF ``Conv1D``): the styles handle
  ``nn.Linear`` / ``nn.Embedding`` only;
- a split parameter that no exported module owns (used functionally by a
  parent module, or not named ``weight`` / ``bias``);
- with ``model=`` given: a split module that is not an ``nn.Linear`` /
  ``nn.Embedding``; a split tied weight also held by a module with no style;
  a styled module's output the model's code writes in place (the runtimes hand
  it a view of a DTensor's local tensor, which autograd refuses to modify).

Notes (exported, not fatal): a padded vocabulary ``S(0|padN)`` becomes an
uneven DTensor shard (same values, rank-local shapes differ from shardplan's);
a vocab-parallel loss is not a module style, so the exported model computes
the loss on gathered logits (more communication, same values); tied weights
must be tied again after ``parallelize_module`` (``parallelize_with_dtensor``
does it).
"""

from .check import ModelCode, export_issues
from .dtensor import parallelize_with_dtensor, tie_again, to_dtensor_plan
from .hf import to_hf_tp_plan
from .styles import ExportIssue

__all__ = ["to_dtensor_plan", "to_hf_tp_plan", "export_issues", "ExportIssue", "ModelCode",
           "parallelize_with_dtensor", "tie_again"]
