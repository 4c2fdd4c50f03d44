"""Transitions: every layout change in an annotated graph, and what realises it.

The engine (``annotate``) ends with the list; the rewriter executes it, and
the plan's collectives, the ledger tests and any cost model read it. One
``Transition`` is one value changing layout on its way to some consumers:

======================  =============  ===========  ============  ==========
purpose                 before -> after  forward      backward      Megatron
======================  =============  ===========  ============  ==========
``F``                   R -> R         none         all_reduce    f
``G``                   P -> R         all_reduce   none          g
``SPLIT``               R -> S(d)      local_slice  none (*)      split
``GATHER_OUTPUT``       S(d) -> R      all_gather   local_slice   gather_output
``REPLICA_GRAD``        S(d|xr)        none         replica_sum   (GQA K/V)
``VOCAB_LOSS``          S(1) -> R      3 all_reduce none          vocab-parallel CE
``SEQ_SCATTER``         P -> S(seq)    reduce_scatter all_gather  g (sequence parallel)
``SEQ_GATHER``          S(seq) -> R    all_gather   reduce_scatter f (sequence parallel)
``SEQ_UNSHARD``         S(seq) -> R    all_gather   local_slice   (gather, fallback)
``SEQ_GRAD``            R -> R         none         all_reduce    sequence-parallel grad sum
``SEQ_GRAD_BUCKET``     R -> R         none         all_reduce    one sum for a step's
``SEQ_REGATHER``        S(seq) -> R    none         all_gather    linears keep the shard
``STAT``                P -> R         all_reduce   none          (distributed reduction)
                                       (_max for a max)
``GATHER``              S(d) -> R      all_gather   local_slice   (a chosen gather)
======================  =============  ===========  ============  ==========

(*) a split of a tensor that needs a gradient follows an ``F``, whose
backward all-reduce sums the zero-padded slices' gradients. Sequence
parallelism (``annotate(..., sequence_parallel=True)``) adds the last five
rows, not a code path: a partial result leaving a region is reduce-scattered
along the sequence instead of all-reduced, the ops between regions run on
this rank's tokens, and a region's replicated input is all-gathered from
them (``SEQ_UNSHARD`` where an op that is no region needs the whole
sequence: its gradient is whole on every rank). ``SEQ_GRAD`` is ``F``'s
collective for a replicated tensor read by sequence-sharded ops (a norm's
weight, a position embedding): each rank's gradient covers only its tokens,
so it is summed over the ranks, once.
``SEQ_GRAD_BUCKET`` is the ``SEQ_GRAD``s of the parameters (norms' weights
and biases, row biases) and of a position embedding's output in one flat
all-reduce, run when the last of their gradients is ready (Megatron buckets
them too): one per step, or one per block where recomputation or FSDP run
the graph block by block; ``sources`` are the parameters, ``messages`` one
flat buffer. ``SEQ_REGATHER``: the linears reading a ``SEQ_GATHER`` keep
only this rank's tokens for backward and all-gather them again, once for all
of them, for their weights' gradients, so the gathered input is not held
until backward (Megatron's choice).
``STAT`` is ``G`` for a reduction over a split dim (a norm's mean of squares
over all heads): each rank reduces its part, and the small result (b*s
numbers) is summed; where the whole statistic then meets the parts again,
its gradient is summed by an ordinary ``F``. ``GATHER`` is the planner's third
answer to an op that cannot run on the parts (``choices``): the shard is
all-gathered there, so the work upstream stays sharded and the op and what
follows run replicated, identical on every rank; backward each rank keeps
its slice of that (identical) gradient.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..layouts import Layout, MeshDim
from .graph import hint


class Collective(str, enum.Enum):
    """How ranks exchange data for one side (forward or backward) of a transition. A member
    is its value (``str(Collective.ALL_GATHER) == "all_gather"``)."""

    NONE = "none"
    LOCAL_SLICE = "local_slice"  # keep this rank's part: no communication
    ALL_REDUCE = "all_reduce"
    ALL_REDUCE_MAX = "all_reduce_max"  # a distributed max (a softmax's shift)
    REDUCE_SCATTER = "reduce_scatter"  # sequence parallel's g
    ALL_GATHER = "all_gather"
    REPLICA_SUM = "replica_sum"  # all-reduce of a zero-padded full-size buffer

    def __str__(self) -> str:
        return self.value

    @property
    def communicates(self) -> bool:
        return self not in (Collective.NONE, Collective.LOCAL_SLICE)

    @property
    def c10d(self) -> str:
        """The process-group collective it runs (what a ledger records)."""
        return "all_reduce" if self in (Collective.REPLICA_SUM, Collective.ALL_REDUCE_MAX) \
            else self.value


class Purpose(str, enum.Enum):
    """Why a transition exists (the plan's ``CollectiveEntry.purpose``); a member is its
    value, as a ``Collective`` is."""

    F = "f"  # a replicated tensor enters a region: sum its gradient
    G = "g"  # a partial sum leaves a region
    SPLIT = "split"  # a replicated activation read as this rank's part
    GATHER_OUTPUT = "gather_output"  # a sharded graph output made whole
    REPLICA_GRAD = "replica_grad"  # a parameter part held by several ranks: sum its gradient
    VOCAB_LOSS = "vocab_loss"  # cross-entropy over logits split along the classes
    SEQ_SCATTER = "seq_scatter"  # a partial sum leaves a region onto the ranks' tokens
    SEQ_GATHER = "seq_gather"  # the ranks' tokens gathered to enter a region
    SEQ_UNSHARD = "seq_unshard"  # the ranks' tokens gathered for an op needing them all
    SEQ_GRAD = "seq_grad"  # a replicated tensor read per token: sum its gradient
    SEQ_GRAD_BUCKET = "seq_grad_bucket"  # a step's (or block's) SEQ_GRAD parameters in one buffer
    SEQ_REGATHER = "seq_regather"  # a linear's gathered input gathered again in backward
    STAT = "stat"  # a reduction over a split dim: the ranks' partial results summed
    GATHER = "gather"  # a shard all-gathered for an op that cannot run on the parts

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Transition:
    """``src``'s value changes from ``before`` to ``after`` for ``consumers``.

    ``consumers`` are ``(node, operand path)`` edges of the annotated graph
    (path ``None``: every operand of that node that reads ``src``).
    ``messages`` are the shapes (full sizes, example values for symbolic
    dims) of the collectives that realise it, in order; ``dtype`` is theirs.
    ``before`` and ``after`` are placements along ``mesh_dim``, the mesh dimension
    whose ranks its collectives run over.
    """

    purpose: Purpose
    src: fx.Node
    consumers: tuple[tuple[fx.Node, tuple | None], ...]
    before: Layout
    after: Layout
    forward: Collective
    backward: Collective
    messages: tuple[tuple[int, ...], ...] = ()
    dtype: torch.dtype = torch.float32
    sources: tuple[fx.Node, ...] = ()  # SEQ_GRAD_BUCKET: every tensor it sums (src first)
    mesh_dim: MeshDim = MeshDim.TP

    @property
    def direction(self) -> str | None:
        """The pass that communicates ("forward" or "backward"), None for a local one."""
        if self.forward.communicates:
            return "forward"
        return "backward" if self.backward.communicates else None

    @property
    def collective(self) -> Collective:
        """The communicating side's collective (NONE for a local transition)."""
        return self.forward if self.forward.communicates else self.backward

    @property
    def elements(self) -> list[int]:
        return [math.prod(m) for m in self.messages]


def message(node: fx.Node) -> tuple[int, ...]:
    """The full shape of the tensor ``node`` makes, symbolic dims at their example value."""
    v = node.meta.get("val")
    return tuple(hint(d) for d in v.shape) if isinstance(v, torch.Tensor) else (0,)


def dtype_of(node: fx.Node) -> torch.dtype:
    v = node.meta.get("val")
    return v.dtype if isinstance(v, torch.Tensor) else torch.float32
