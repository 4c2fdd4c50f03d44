"""memory: will a training step fit? Per-rank bytes before the first GPU-hour.

``estimate`` adds up, per rank, for a plan at tp (x dp_replicate x dp_shard
data parallelism):

- parameters: the plan's local shapes at ``dtype``;
- gradients: the same shapes and dtype as the parameters;
- optimizer state: AdamW keeps two fp32 moments per parameter, plus an fp32
  master copy when ``dtype`` is 16-bit (mixed precision); SGD keeps none;
- FSDP (``fsdp=True``) divides these three by dp_shard and adds a transient:
  one block's parameters gathered over dp_shard and its unsharded gradients
  before their reduce-scatter. Replicas (dp_replicate: plain data
  parallelism, or HSDP's replicas of the shards) each hold them all, so
  dp_replicate divides nothing;
- activations: what autograd saves for backward in the graph this rank runs.
  The rank's rewritten graph runs once on fake tensors (shapes only, no
  memory) under ``saved_tensors_hooks``; every saved storage is counted once,
  parameters and buffers left out, and charged to the block whose node saved
  it. So sharding by tp, by the sequence (``sequence_parallel``), and what
  each op really keeps (the fused attention's log-sum-exp, not s x s
  probabilities) come from the captured graph, not from a formula. With
  ``recompute`` a block keeps only its inputs. Blocks planned once (block 1
  of a truncated list) are counted once per real block. The same run
  (``fake_run``) counts each block's FLOPs and the parameters it reads, for
  the pipeline's stages (``stages``).

The peak is their sum, a deliberate upper bound: gradients and activations
are both alive at the start of backward only for the last blocks, and the
allocator's fragmentation and the collectives' buffers are not modelled.
"""

from __future__ import annotations

import math
import re

import torch
import torch.fx as fx
import torch.nn as nn
from pydantic import BaseModel
from torch.utils.flop_counter import FlopCounterMode

from . import blocks
from .annotation import Annotation
from .capture import Captured, module_of
from .recompute import block_names
from .rewrite import bind, rewrite
from .shards import local_shape
from .. import arguments
from ..errors import ConfigurationError
from ..layouts import Replicate
from ..runtime.comm import Group
from ..torch_compat import FakeTensorMode

#: optimizer state bytes per parameter, besides an fp32 master copy under mixed precision
OPTIMIZER_BYTES = {"adamw": 8, "sgd": 0}
#: the dtypes the estimate counts parameters and activations in, by name
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


class MemoryEstimate(BaseModel):
    """Per-rank bytes of one training step (see ``shardplan.planner.memory``)."""

    dtype: str
    optimizer: str | None
    dp: int
    dp_replicate: int
    dp_shard: int
    fsdp: bool
    sequence_parallel: bool
    recompute: bool
    params: int
    grads: int
    optimizer_state: int
    fsdp_transient: int
    activations: int
    activations_per_block: int
    activations_outside_blocks: int
    blocks: int
    peak: int
    gpu_memory: int | None = None
    fits: bool | None = None

    def rows(self) -> list[tuple[str, int]]:
        return [("parameters", self.params), ("gradients", self.grads),
                ("optimizer state", self.optimizer_state),
                ("FSDP gathered block", self.fsdp_transient),
                ("activations", self.activations)]


def estimate(plan, model: nn.Module, captured: Captured, ann: Annotation, args, kwargs, *,
             dtype: torch.dtype | None, dp_replicate: int, dp_shard: int, fsdp: bool,
             sequence_parallel: bool,
             recompute: bool, optimizer: str | None, gpu_memory: int | None) -> MemoryEstimate:
    """The per-rank memory of training ``plan``'s model (see the module docstring); the
    arguments as ``check_estimate_arguments`` returns them."""
    dtype = dtype or next(model.parameters()).dtype
    params, grads, state, transient = state_bytes(plan, dtype, dp_shard=dp_shard, fsdp=fsdp,
                                                  optimizer=optimizer)
    outside, per_block, n_blocks = saved_activations(model, captured, ann, args, kwargs,
                                                     recompute=recompute, dtype=dtype)
    activations = outside + sum(per_block)
    peak = params + grads + state + transient + activations
    return MemoryEstimate(
        dtype=str(dtype).replace("torch.", ""), optimizer=optimizer,
        dp=dp_replicate * dp_shard, dp_replicate=dp_replicate, dp_shard=dp_shard, fsdp=fsdp,
        sequence_parallel=sequence_parallel, recompute=recompute, params=params,
        grads=grads, optimizer_state=state, fsdp_transient=transient,
        activations=activations, activations_per_block=max(per_block, default=0),
        activations_outside_blocks=outside, blocks=n_blocks, peak=peak, gpu_memory=gpu_memory,
        fits=None if gpu_memory is None else peak <= gpu_memory)


def check_estimate_arguments(*, batch, seq, examples: bool, dp, dp_replicate, dp_shard, fsdp,
                             sequence_parallel,
                             recompute, dtype, optimizer,
                             gpu_memory) -> tuple[torch.dtype | None, int | None]:
    """``(dtype, gpu_memory in bytes)`` of ``plan``'s estimate arguments, a dtype's name
    and a size such as "80GB" read; a ``ConfigurationError`` naming the first bad one.

    ``batch`` and ``seq`` positive ints, given together and without example inputs
    (``examples``); ``dp``, ``dp_replicate``, ``dp_shard`` positive ints or None; ``fsdp``,
    ``sequence_parallel`` and ``recompute`` True or False; ``dtype`` one of ``DTYPES`` (or
    its name) or None;
    ``optimizer`` one of ``OPTIMIZER_BYTES`` or None; ``gpu_memory`` a positive number of
    bytes, a size (``parse_bytes``) or None.
    """
    for name, value in (("batch", batch), ("seq", seq)):
        arguments.integer(name, value, 1, where=_WHERE, optional=True)
    if (batch is None) != (seq is None) or (batch is not None and examples):
        given = f"batch={batch!r}, seq={seq!r}" + (" and example_inputs" if examples else "")
        raise ConfigurationError(
            f"{given}: the estimate is of token ids of batch x seq, or of the example inputs",
            where=_WHERE, fix="pass both batch and seq (and no example_inputs), or "
                              "example_inputs shaped as one step's batch")
    for name, value in (("dp", dp), ("dp_replicate", dp_replicate), ("dp_shard", dp_shard)):
        arguments.integer(name, value, 1, where=_WHERE, optional=True)
    for name, value in (("fsdp", fsdp), ("sequence_parallel", sequence_parallel),
                        ("recompute", recompute)):
        arguments.flag(name, value, where=_WHERE)
    if dtype is not None and dtype not in DTYPES.values():  # a name, or refused
        arguments.choice("dtype", dtype, list(DTYPES), where=_WHERE,
                         fix=f"pass dtype as one of {', '.join(map(str, DTYPES.values()))}, "
                             "its name, or None (the model's)")
        dtype = DTYPES[dtype]
    arguments.choice("optimizer", optimizer, list(OPTIMIZER_BYTES), where=_WHERE, optional=True)
    if isinstance(gpu_memory, str):
        gpu_memory = parse_bytes(gpu_memory, "gpu_memory")
    arguments.number("gpu_memory", gpu_memory, 0, where=_WHERE, low_open=True, optional=True,
                     fix="pass gpu_memory as bytes or a size such as '80GB' or '141GiB'")
    return dtype, None if gpu_memory is None else int(gpu_memory)


_WHERE = "plan"


def state_bytes(plan, dtype: torch.dtype, *, dp_shard: int, fsdp: bool,
                optimizer: str | None) -> tuple[int, int, int, int]:
    """Per-rank (parameters, gradients, optimizer state, FSDP transient) bytes: FSDP
    divides by dp_shard only (HSDP's replicas hold the same shards)."""
    size = torch.empty((), dtype=dtype).element_size()
    shard = dp_shard if fsdp else 1
    numel = sum(math.prod(p.local_shape) for p in plan.params)
    transient = 2 * _largest_block(plan) * size * (shard - 1) // shard if fsdp else 0
    return (*elements_state(numel, dtype, shard=shard, optimizer=optimizer), transient)


def elements_state(numel: int, dtype: torch.dtype, *, shard: int,
                   optimizer: str | None) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer state) bytes of ``numel`` elements per rank held
    at ``dtype``, divided over ``shard`` FSDP shards."""
    size = torch.empty((), dtype=dtype).element_size()
    per_param = OPTIMIZER_BYTES[optimizer] + (4 if size < 4 else 0) if optimizer else 0
    return (math.ceil(numel * size / shard), math.ceil(numel * size / shard),
            math.ceil(numel * per_param / shard))


def _largest_block(plan) -> int:
    """Elements per rank of the largest block (an element of a list of blocks)."""
    per: dict = {}
    for p in plan.params:
        first = blocks.split_first(p.name)
        if first is not None:
            per[first[:2]] = per.get(first[:2], 0) + math.prod(p.local_shape)
    return max(per.values(), default=0)


class _ShapeGroup(Group):
    """Rank 0 of ``size`` ranks whose collectives return tensors of the right shape."""

    def __init__(self, size: int):
        self.rank, self.size = 0, size

    def _all_reduce(self, t, op):
        return t.clone()

    def _all_gather(self, t, dim):
        return torch.cat([t] * self.size, dim)

    def _reduce_scatter(self, t, dim):
        return t.chunk(self.size, dim)[0].clone()

    def _broadcast(self, t, src):
        return t.clone()

    def _barrier(self):
        pass


def saved_activations(model: nn.Module, captured: Captured, ann: Annotation, args, kwargs, *,
                      recompute: bool, dtype: torch.dtype) -> tuple[int, list[int], int]:
    """(bytes outside the blocks, [bytes of each real block], blocks) rank 0 keeps for
    backward. The graph runs at the model's dtypes; floating tensors count at ``dtype``
    (ops that keep fp32 statistics under 16-bit autocast are not modelled)."""
    names = _blocks(model, recompute)
    run = fake_run(model, captured, ann, args, kwargs, names=names,
                   recomputed=set(names) if recompute else set(), dtype=dtype)
    by_block = dict(run.bytes)
    outside = by_block.pop(None, 0)
    return outside, [by_block.get(stand_in(name, captured), 0) for name in names], len(names)


def fake_run(model: nn.Module, captured: Captured, ann: Annotation, args, kwargs, *,
             names: list[str], recomputed: set, dtype: torch.dtype,
             split_outside: bool = False) -> _Saved:
    """Rank 0's rewritten graph run once on fake tensors, forward only: per block of
    ``names`` (``labels``), the bytes autograd saves, the FLOPs (``FlopCounterMode``) and
    the canonical FQNs of the parameters read."""
    gm = rewrite(ann, {d: _ShapeGroup(n) for d, n in ann.dims.items()}, gather_output=False,
                 device=torch.device("cpu"))
    labels = _labels(gm, names, split_outside)
    with FakeTensorMode(allow_non_fake_inputs=False):
        tensors = _fake_locals(model, captured, ann)
        bind(gm, tensors)
        model_state = {t.untyped_storage()._cdata: captured.aliases.get(fqn, fqn)
                       for fqn, t in tensors.items()}
        fake_args = [_fake_like(a) for a in args]
        fake_kwargs = {k: _fake_like(v) for k, v in kwargs.items()}
        counter = _Saved(gm, labels, model_state, dtype, recomputed)
        flat = gm.graph._codegen.process_inputs(*fake_args, **fake_kwargs)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), \
                counter.flop_counter:
            counter.run(*flat)
    return counter


def _blocks(model: nn.Module, recompute: bool) -> list[str]:
    """The FQNs of the blocks (every element of every ``nn.ModuleList``)."""
    has_list = any(isinstance(m, nn.ModuleList) for m in model.modules())
    return block_names(model, True) if has_list or recompute else []


def stand_in(name: str, captured: Captured) -> str:
    """The captured block that block ``name`` was planned by: itself, or block 1 of a
    truncated list when it lies past the captured blocks."""
    for path, (kept, _) in captured.truncated.items():
        index = blocks.index_in(name, path)
        if index is not None and index >= kept:
            return blocks.with_index(name, path, 1)
    return name


#: the labels of the nodes outside the blocks with ``split_outside``: before the first
#: block's (the embedding), and after it (the head and the loss)
BEFORE, AFTER = "(before the blocks)", "(after the blocks)"


def _labels(gm: fx.GraphModule, names: list[str],
            split_outside: bool = False) -> dict[fx.Node, str | None]:
    """Node -> the block it belongs to, as ``outline_blocks`` cuts them: by the module
    that produced it; nodes the rewriter inserted go with the node before them. Nodes
    outside the blocks get None, or with ``split_outside`` ``BEFORE`` until the first
    block's node and ``AFTER`` once the last block's has run (between two blocks: the
    block before)."""
    wanted, label = set(names), None
    out: dict[fx.Node, str | None] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            out[node] = None
            continue
        if "nn_module_stack" in node.meta:
            parts = module_of(node).split(".")
            label = next((".".join(parts[:i]) for i in range(1, len(parts) + 1)
                          if ".".join(parts[:i]) in wanted), None)
        out[node] = label
    return _split_outside(gm, out) if split_outside else out


def _split_outside(gm: fx.GraphModule, labels: dict) -> dict:
    """``labels`` with the computing nodes outside the blocks named ``BEFORE``, ``AFTER``
    or the block that ran before them (see ``_labels``)."""
    order = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    in_block = [i for i, n in enumerate(order) if labels[n] is not None]
    last = in_block[-1] if in_block else -1
    out, previous = dict(labels), None
    for i, node in enumerate(order):
        if labels[node] is not None:
            previous = labels[node]
        elif i > last:
            out[node] = AFTER
        else:
            out[node] = previous or BEFORE
    return out


def _fake_locals(model: nn.Module, captured: Captured, ann: Annotation) -> dict[str, torch.Tensor]:
    """FQN -> a fake tensor of rank 0's local shape (one object per tied group)."""
    layouts = {captured.aliases.get(k, k): v for k, v in ann.params.items()}
    made: dict = {}
    out = {}
    for fqn, canon in captured.aliases.items():
        if canon not in made:
            owner, _, leaf = canon.rpartition(".")
            full = getattr(model.get_submodule(owner) if owner else model, leaf)
            shape = local_shape(tuple(full.shape), layouts.get(canon, Replicate()), ann.size)
            t = torch.empty(shape, dtype=full.dtype)
            made[canon] = nn.Parameter(t) if isinstance(full, nn.Parameter) else t
        out[fqn] = made[canon]
    return out


def _fake_like(x):
    return torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x


class _Saved(fx.Interpreter):
    """Runs the graph, charging each storage autograd saves, the FLOPs and the model
    state read to the running node's block (``bytes``, ``flops``, ``reads``: label ->
    bytes, FLOPs, canonical FQNs)."""

    def __init__(self, gm, labels, model_state: dict, dtype, recomputed: set):
        super().__init__(gm)
        self.labels, self.model_state, self.recomputed = labels, model_state, recomputed
        self.size = torch.empty((), dtype=dtype).element_size()
        self.seen: set = set()
        self.bytes: dict = {}
        self.flops: dict = {}
        self.reads: dict = {}
        self.label = None
        self.flop_counter = FlopCounterMode(display=False)

    def run_node(self, n: fx.Node):
        self.label = self.labels[n]
        if self.label in self.recomputed:
            self._keep_inputs(n)
        self._note_reads(n)
        before = self.flop_counter.get_total_flops()
        out = super().run_node(n)
        done = self.flop_counter.get_total_flops() - before
        if done:
            self.flops[self.label] = self.flops.get(self.label, 0) + done
        return out

    def _note_reads(self, n: fx.Node) -> None:
        for a in n.all_input_nodes:
            for t in _tensors(self.env[a]):
                fqn = self.model_state.get(t.untyped_storage()._cdata)
                if fqn is not None:
                    self.reads.setdefault(self.label, set()).add(fqn)

    def _keep_inputs(self, n: fx.Node) -> None:
        for a in n.all_input_nodes:
            if self.labels[a] != self.label:
                for t in _tensors(self.env[a]):
                    self._count(t)

    def pack(self, t):
        if self.label not in self.recomputed:  # a recomputed block keeps only its inputs
            self._count(t)
        return t

    def _count(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        key = s._cdata
        if key in self.seen or key in self.model_state:
            return
        self.seen.add(key)
        n = s.nbytes()
        if t.is_floating_point():
            n = n // t.element_size() * self.size
        self.bytes[self.label] = self.bytes.get(self.label, 0) + n


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def parse_bytes(text: str, name: str = "size") -> int:
    """``"80GB"``, ``"80 GiB"``, ``"141e9"`` -> bytes (GB = 10^9, GiB = 2^30); a
    ``ConfigurationError`` naming the argument ``name`` for anything else."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    try:
        number = float(m.group(1)) if m else None
    except ValueError:
        number = None
    if m is None or number is None or not math.isfinite(number):
        raise ConfigurationError(f"{name}={text!r} is not a memory size", where=_WHERE,
                                 fix="pass a number of bytes with an optional unit: B, KB, MB, "
                                     "GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (of 1024), "
                                     "e.g. 80GB or 141GiB")
    unit = (m.group(2) or "B").upper().rstrip("B") or "B"
    scale = {"B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(number * scale)
