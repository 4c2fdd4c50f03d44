"""Every ``Purpose`` in one table: the module that realises it and the reports' words for it.

The rewriter inserts ``PURPOSES[t.purpose].module`` for a transition ``t``, named
``tp_<name>_<n>`` (``self.tp_f_3(x)`` in a rank's graph's code); the text and HTML reports
name and explain a plan's collectives by ``label`` and ``text``. A new purpose is a new
member of ``Purpose`` and a new row here (``tests/test_planner.py`` checks that every
member has one, and that the rewriter inserts the table's modules).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..runtime.graph_ops import (CopyToRegion, GatherSequence, GatherShard,
                                 LinearsOnGatheredSequence, LocalShard, MaxOverRanks,
                                 ReduceFromRegion, ScatterToSequence, SumGradients, SumOverReplicas,
                                 VocabCrossEntropy)
from .transitions import Collective, Purpose


@dataclass(frozen=True)
class PurposeRow:
    """How one purpose is run and shown.

    ``name`` and ``module``: the inserted module's name and class; ``max_module``: the
    class a distributed max runs instead (forward ``ALL_REDUCE_MAX``, named
    ``<name>_max``). ``label`` and ``text``: the reports' short name and explanation;
    ``place``: where the HTML report draws it beside its region; ``tokens``: its forward
    moves the ranks' tokens (sequence parallelism's scatter and gathers, listed in the
    text report's sequence-parallel section).
    """

    name: str
    module: type[nn.Module]
    label: str
    text: str
    place: str = ""
    tokens: bool = False
    max_module: type[nn.Module] | None = None

    def realised_by(self, forward: Collective) -> tuple[str, type[nn.Module]]:
        """The name and class of the module run for a transition with this ``forward``."""
        if forward is Collective.ALL_REDUCE_MAX and self.max_module is not None:
            return f"{self.name}_max", self.max_module
        return self.name, self.module


PURPOSES: dict[Purpose, PurposeRow] = {
    Purpose.F: PurposeRow(
        "f", CopyToRegion, "f",
        "region entry: identity forward, all-reduce of the gradient backward",
        place="before the region"),
    Purpose.G: PurposeRow(
        "g", ReduceFromRegion, "g",
        "region exit: all-reduce of the partial sums forward, identity backward",
        place="after the region"),
    Purpose.SPLIT: PurposeRow(
        "shard", LocalShard, "split",
        "a replicated value read as this rank's part: its local slice, no communication"),
    Purpose.GATHER_OUTPUT: PurposeRow(
        "gather", GatherShard, "gather", "all-gather of the split output (the full logits)"),
    Purpose.REPLICA_GRAD: PurposeRow(
        "replica_sum", SumOverReplicas, "grad",
        "sum of gradients over ranks holding the same part"),
    Purpose.VOCAB_LOSS: PurposeRow(
        "vocab_loss", VocabCrossEntropy, "loss",
        "vocab-parallel cross-entropy: max, sum-exp and target logit"),
    Purpose.SEQ_SCATTER: PurposeRow(
        "seq_scatter", ScatterToSequence, "g·seq",
        "region exit, sequence parallel: reduce-scatter of the partial sums onto the ranks' "
        "tokens forward, all-gather backward",
        place="after the region", tokens=True),
    Purpose.SEQ_GATHER: PurposeRow(
        "seq_gather", GatherSequence, "f·seq",
        "region entry, sequence parallel: all-gather of the ranks' tokens forward, "
        "reduce-scatter of the gradient backward",
        place="before the region", tokens=True),
    Purpose.SEQ_UNSHARD: PurposeRow(
        "seq_unshard", GatherShard, "gather·seq",
        "all-gather of the ranks' tokens for an op that needs the whole sequence (fallback)",
        tokens=True),
    Purpose.SEQ_GRAD: PurposeRow(
        "seq_grad", CopyToRegion, "grad·seq",
        "sum over ranks of the gradient of a replicated tensor read per token"),
    Purpose.SEQ_GRAD_BUCKET: PurposeRow(
        "seq_grad_bucket", SumGradients, "grad·seq·bucket",
        "one flat all-reduce summing the per-token parameters' gradients (norms, row biases) "
        "of a step, or of a block under recompute or FSDP"),
    Purpose.SEQ_REGATHER: PurposeRow(
        "seq_linear", LinearsOnGatheredSequence, "regather·seq",
        "the linears reading gathered tokens keep only this rank's for backward and "
        "all-gather them again there, once, for their weights' gradients"),
    Purpose.STAT: PurposeRow(
        "stat", ReduceFromRegion, "stat",
        "distributed reduction: each rank reduces its part of a split dim, the small result "
        "is all-reduced forward",
        max_module=MaxOverRanks),
    Purpose.GATHER: PurposeRow(
        "gather", GatherShard, "gather·op",
        "all-gather of a split activation for an op with no distributed form (a chosen "
        "move): upstream stays sharded, the op runs replicated; backward keeps this rank's "
        "slice"),
}
