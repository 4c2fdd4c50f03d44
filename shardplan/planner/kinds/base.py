"""What every rule kind is, and what its rule returns.

A kind is a small object that knows five things about the ops listed under
it in a rule file: which ATen overloads it can read (``reads``), the layout
rule (operand layouts -> output layout and the layouts it needs of its
operands, ``rule``), the cuts it makes along a dim (``cuts``: where a fused
output is split downstream) and how its size arguments change for one
rank's shard (``local_args``), and what else one rank's op needs to give its
part of the result (``local_form``: a mean over a split dim divides by tp).
The arguments a rule decides by (dims, sizes, equations) are read by schema
name (``graph.args_of``), not by position or op-name suffix. The input tensor is
``node.args[0]``, first in every listed op's schema, and helpers matching one op's
fixed form read ``node.args`` by position too (``einsum``'s tensor list, a view's
size list), as export writes them: positional arguments positionally.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, cast

import torch
import torch.fx as fx

from ...layouts import Layout, MeshDim, MeshSizes, Partial, Replicate, Shard
from ..graph import op_name
from ...torch_compat import OpOverload

R = Replicate()


class Role(str, enum.Enum):
    """What a node does in the Megatron strategy (the plan's ``Decision.role``). A member
    is its value (``Role.ROW == "row"``, ``str(Role.ROW) == "row"``)."""

    LOCAL = "local"  # runs on this rank's part, no decision worth listing
    COLUMN = "column"  # opens a region: weight split on its output features
    ROW = "row"  # closes a region: weight split on its input features, output partial
    PARTIAL = "partial"  # contracts a sharded factor of two activations: output partial
    VOCAB_EMBEDDING = "vocab_embedding"
    VOCAB_LOSS = "vocab_loss"
    REPLICATED = "replicated"  # an opener kept replicated (a conflict downstream)
    DISTRIBUTED = "distributed_reduce"  # reduces a split dim locally: output partial

    def __str__(self) -> str:
        return self.value


@dataclass
class Conflict:
    """A sharded value reaching an op that cannot run on the parts."""

    node: fx.Node
    reason: str
    origins: frozenset[fx.Node] = frozenset()  # the openers of the regions it undoes
    divisibility: bool = False
    closes: bool = False  # a reduction over the split dim: the region just does not close
    replicas: int = 1  # for a divisibility conflict: replicas that would make the split divide
    sizes: tuple[int, ...] = ()  # for a divisibility conflict: the counts that must divide by tp
    gatherable: bool = False  # a fallback at an op reading a shard: gathering it would do


@dataclass
class Outcome:
    """What one rule says about one node."""

    out: Layout | tuple | None  # a tuple of Layouts for several outputs, None for non-tensors
    needs: Mapping[tuple, Layout] = field(default_factory=dict)  # by operand path
    role: Role = Role.LOCAL
    rule: str = ""
    conflict: Conflict | None = None
    bias: tuple | None = None  # operand path of a bias to add after g


@dataclass(frozen=True)
class Context:
    """What a rule may know beyond its node: the mesh's sizes and the one dimension
    ``dim`` the rule is applied to (a rule is written for one mesh dim, as DTensor's
    single-dim strategies are), the rule set, the reductions the planner chose to keep
    undistributed (their regions replicated), and which operands need a
    gradient."""

    dims: MeshSizes
    rules: Any  # the RuleSet (planner/rules.py imports the kinds: no import of it here)
    undistributed: frozenset[str] = frozenset()  # reductions not to run distributed (names)
    needs_grad: dict[fx.Node, bool] = field(default_factory=dict)  # does its value need one
    dim: MeshDim = MeshDim.TP

    @property
    def size(self) -> int:
        """The ranks along ``dim``: the parts a shard splits into."""
        return self.dims[self.dim]

    def kind_of(self, node: fx.Node) -> str | None:
        return self.rules.kind(op_name(node))

    def kind_at(self, node: fx.Node) -> Kind:
        """The kind the rule set lists ``node``'s op under (its traits), ``UNLISTED``
        for an op it does not list."""
        name = self.kind_of(node)
        return UNLISTED if name is None else KINDS[name]


Divide = Callable[[object, int], object]  # (a traced size, divisor) -> the local size


class Kind:
    """A rule kind; subclasses set ``name`` and ``ops`` (or override ``reads``), and the
    traits that hold of their ops (each False unless set)."""

    name: ClassVar[str]
    ops: ClassVar[frozenset[str]] = frozenset()  # the overloads whose arguments it reads
    # traits the planner's walkers ask of an op, by its kind:
    #: only views or copies its one input (its layout follows the input's dims there)
    shape_only: ClassVar[bool] = False
    #: each output element is computed from the elements at its index in the inputs, the
    #: dims aligned from the right as in broadcasting (no dim moved, merged or dropped)
    per_element: ClassVar[bool] = False
    #: its output is some or all of its one input's elements, in their row-major order
    keeps_element_order: ClassVar[bool] = False
    #: reads only its input's metadata (a check, a size query): no value flows on
    metadata_only: ClassVar[bool] = False
    #: cuts its input into pieces along one dim, or joins pieces along one
    cuts_or_joins: ClassVar[bool] = False

    def reads(self, op: OpOverload) -> bool:
        """Can this kind read ``op``'s arguments? (checked when a rule file loads)"""
        return _overload_name(op) in self.ops

    def rule(self, node: fx.Node, lays: dict, ctx: Context) -> Outcome:
        raise NotImplementedError

    def cuts(self, node: fx.Node, dim: int) -> set[int]:
        """Offsets along ``dim`` of its input where ``node`` cuts it into pieces."""
        return set()

    def local_args(self, node: fx.Node, src: Shard, out, size: int, divide: Divide) -> dict:
        """Argument name -> this rank's value, for an input sharded as ``src`` over
        ``size`` ranks."""
        return {}

    def local_form(self, node: fx.Node, src: Shard, out, size: int, graph: fx.Graph) -> fx.Node:
        """The node computing this rank's ``out`` from ``node`` (run on an input sharded
        as ``src``); ops that mean the same on a part return ``node`` itself."""
        return node


class _Unlisted(Kind):
    """An op no kind lists: no trait holds of it, it cuts nothing."""

    name = ""


UNLISTED = _Unlisted()
KINDS: dict[str, Kind] = {}


def register(cls: type[Kind]) -> type[Kind]:
    """Class decorator: make a kind available to rule files under ``cls.name``."""
    KINDS[cls.name] = cls()
    return cls


def _overload_name(op) -> str:
    return f"{op.namespace}.{op.__name__}"


def returns_one_tensor(op) -> bool:
    rets = op._schema.returns
    return len(rets) == 1 and isinstance(rets[0].type, torch.TensorType)


def tensor_to_tensor(op) -> bool:
    """Does ``op`` take a tensor first and return one tensor?"""
    args = op._schema.arguments
    return returns_one_tensor(op) and bool(args) and isinstance(args[0].type, torch.TensorType)


def conflict(node, reason, divisibility=False) -> Outcome:
    return Outcome(None, conflict=Conflict(node, reason, divisibility=divisibility))


def any_sharded(lay) -> bool:
    if isinstance(lay, tuple):
        return any(any_sharded(x) for x in lay)
    return isinstance(lay, (Shard, Partial))


def replicated_like(node):
    v = node.meta.get("val")
    if isinstance(v, (tuple, list)):
        return tuple(R if isinstance(x, torch.Tensor) else None for x in v)
    return R if isinstance(v, torch.Tensor) else None


def with_dim(lay: Shard, d: int) -> Shard:
    return replace(lay, dim=d)


def cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def local_size(size, lay: Shard, tp: int, divide: Divide):
    """A size argument of the sharded dim, for one rank (-1 stays -1)."""
    if isinstance(size, int):
        return size if size == -1 else lay.local_size(size, tp)
    return divide(size, tp // cast(int, lay.replicas))  # a traced size: one count, not blocks
