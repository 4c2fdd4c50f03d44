"""annotation: the layout engine's result for one graph on one mesh (``Annotation``).

``annotate`` builds it; the rewriter, the plan, the memory estimate and the
reports read it. A layout here is a placement along the one mesh dimension
the engine plans (``Annotation.dim``, tp).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from ..layouts import Layout, MeshDim, MeshSizes, Partial, Replicate, Shard
from .choices import Choice
from .kinds import Outcome
from .rules import RuleSet
from .transitions import Purpose, Transition

R = Replicate()

#: where a node reads an operand: its operand path (``(0,)``, ``(1, 2)``), None for all
Edge = tuple[fx.Node, tuple | None]


@dataclass
class Annotation:
    """The engine's result for one graph on one mesh; never changed after ``annotate``.

    The layouts and transitions are placements along ``dim`` (tp), the mesh dimension
    the engine plans; ``dims`` are the sizes of every dimension of the mesh."""

    gm: fx.GraphModule
    dims: MeshSizes
    # a tuple of layouts for an op of several outputs; a row-parallel output is Partial
    layouts: dict[fx.Node, Layout | tuple | None]
    outcomes: dict[fx.Node, Outcome]
    params: dict[str, Layout]  # by get_attr target
    requires_grad: dict[fx.Node, bool]
    disabled: dict[fx.Node, str]  # opener -> the reason it stays replicated
    warnings: list[str]  # openers kept replicated for a reason other than a non-closing region
    rules: RuleSet
    transitions: list[Transition]  # in the order the rewriter meets them
    # sequence parallelism: a partial node -> the Shard(seq) it is reduce-scattered to;
    # (consumer, operand path) -> (the Shard(seq) all-gathered for it, SEQ_GATHER or
    # SEQ_UNSHARD; or GATHER, the planner's gather move); a node -> its seq dims
    scattered: dict[fx.Node, Shard] = field(default_factory=dict)
    gathered: dict[Edge, tuple[Shard, Purpose]] = field(default_factory=dict)
    seq_dims: dict[fx.Node, frozenset[int]] = field(default_factory=dict)
    # a partial result with no sequence dim of its own (HF Conv1D's flattened batch x
    # sequence) -> the view of it that has one, where it is reduce-scattered instead
    deferred: dict[fx.Node, fx.Node] = field(default_factory=dict)
    # partial nodes read by an op linear in them: their sum is reduced after it (a g moved
    # on to where the tensor is smallest: an MoE layer's sum over the top-k)
    passed: set[fx.Node] = field(default_factory=set)
    # a sum of partial sums -> the row-parallel partials in it whose bias is added after
    # the sum's g (a parallel-residual block's two row biases)
    joined_biases: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    # op a region stopped at -> its openers
    stopped: dict[fx.Node, frozenset[fx.Node]] = field(default_factory=dict)
    # op with no rule for a shard it reads (a fallback; all-gathering it would do) -> openers
    blocked: dict[fx.Node, frozenset[fx.Node]] = field(default_factory=dict)
    choices: list[Choice] = field(default_factory=list)  # one per weighed region
    dim: MeshDim = MeshDim.TP

    @property
    def size(self) -> int:
        """The ranks along ``dim``: the parts a shard of these layouts is split into."""
        return self.dims[self.dim]

    def read(self, node: fx.Node, consumer: fx.Node | None = None, path=None):
        """The layout ``consumer`` reads of ``node`` (after its g, scatter or gather)."""
        if (consumer, path) in self.gathered:
            return R
        return self.scattered.get(node) or read_as(self.layouts.get(node))

    def on_tokens(self, node: fx.Node, lay=None) -> bool:
        """Is ``node``'s layout (or ``lay``) a shard of its sequence dim?"""
        lay = self.layouts.get(node) if lay is None else lay
        return isinstance(lay, Shard) and lay.dim in self.seq_dims.get(node, ())


def read_as(lay):
    """The layout a consumer reads: a partial value is reduced (g) before anyone reads it."""
    return R if isinstance(lay, Partial) else lay
