"""The module ``parallelize`` returns: one rewritten graph per way of calling it.

Users call one model several ways (with and without targets, train and eval,
batch 1 for inference). A capture bakes in its signature and mode, so the
sharded module captures each new way on first use and caches the rewritten
graph; every graph binds the same parameter shards. Compiling the graphs
(``compile``) and generating (``generate``, ``kvcache``) live in their own
modules, which this one calls.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.fx as fx
import torch.nn as nn

from .compile import GraphCompiler
from .generate import generate_sharded
from .kvcache import DecodeSteps
from .planner.capture import PLANNING_LOCK, Captured, capture
from .planner.annotate import annotate
from .planner.annotation import Annotation
from .planner.input_shapes import InputShapes
from .planner.inputs import check_dtypes
from .layouts import MeshDim, MeshSizes, Replicate, Shard, set_spec, spec_of
from .planner.plan import build_plan
from .parallel.fsdp import OwnedPiece, adopt_tree, apply_fsdp, install_owners, route_through_owners
from .planner.recompute import Recomputed, block_names, outline_blocks
from .errors import CaptureError, CheckpointError
from .planner.rewrite import bind, gather_params, rewrite
from .planner.rules import RuleSet
from .runtime.comm import Group
from .torch_compat import FakeTensor, pytree, set_child
from .planner.shards import local_tensors


class ShardedModule(nn.Module):
    """Holds this rank's shards; calls the rewritten graph for each call's signature."""

    is_parallelized = True  # parallelize/plan/verify refuse it as input

    def __init__(self, source: nn.Module, group: Group, rules: RuleSet, *,
                 example: tuple[tuple, dict], gather_output: bool, strict: bool,
                 recompute=False, compile=False, captured: Captured | None = None,
                 sequence_parallel: bool = False, fsdp_blocks: list[str] = (),
                 keep: dict | None = None):
        super().__init__()
        self.training = source.training  # the mode the first graph is captured in
        #: compiles each graph as it is made (``compile``: False, or torch.compile's
        #: backend, True for inductor)
        self._compiler = GraphCompiler(compile) if compile else None
        self._source = [source]  # a list hides it from nn.Module's registry
        self._group, self._rules = group, rules
        self._gather, self._strict = gather_output, strict
        self.sequence_parallel = sequence_parallel
        #: call key -> [(the input shapes it serves or None for any, rewritten graph)]
        self._graphs: dict[tuple, list[tuple[InputShapes | None, fx.GraphModule]]] = {}
        self._refits: set = set()  # call keys already warned about a specialised capture
        #: the parallelized decode steps (``decode_step``), made on first use
        self._decode_steps = DecodeSteps(functools.partial(parallel_step, group=group,
                                                           rules=rules, strict=strict))
        #: FQNs of the blocks whose activations are recomputed in backward
        self.recomputed = block_names(source, recompute) if recompute else []
        #: FQNs of the blocks FSDP2 shards over the data-parallel ranks (``parallel.fsdp``)
        self.fsdp_blocks = list(fsdp_blocks)
        args, kwargs = example
        with PLANNING_LOCK:
            ann, captured = self._annotate(args, kwargs, source.training, captured, keep)
            #: what was decided (``Plan``), for the example inputs
            self.plan = build_plan(source, captured, ann, rules, args, kwargs)
            self._layouts = dict(ann.params)
            self._aliases = captured.aliases
            self._tensors = local_tensors(source, self._layouts, self._aliases,
                                          group.rank, group.size)
            gm = self._finish(ann, captured, args, kwargs)
        for name, child in gm.named_children():
            if not name.startswith(("tp_", "_", "submod_")):
                # past register_module: a child named like one of our attributes
                # (T5's ``decoder``) is still listed, and the attribute still wins
                set_child(self, name, child)
        for name, t in gm._parameters.items():
            self.register_parameter(name, t)
        if self.fsdp_blocks:
            install_owners(self, self.fsdp_blocks)
            adopt_tree(gm, self)
        self.annotation = ann
        self.train(source.training)
        self._last = [gm]  # the most recent call's graph (a list hides it from the registry)
        self._graphs[_key(args, kwargs, source.training)] = [(captured.shapes, gm)]

    @property
    def group(self) -> Group:
        return self._group

    @property
    def gather_output(self) -> bool:
        """Whether each graph all-gathers its split outputs (``parallelize``'s argument)."""
        return self._gather

    @property
    def device(self) -> torch.device:
        """Where this rank's parameters are (CPU for a module with none)."""
        return _device_of(self)

    @property
    def source(self) -> nn.Module:
        """The module this one was parallelized from: what each new way of calling captures."""
        return self._source[0]

    @property
    def layouts(self) -> dict:
        """Every parameter/buffer FQN (each alias of a tied weight) -> its placement over
        the TP group, as its tensor's spec says."""
        return {fqn: spec_of(t).layout[MeshDim.TP] for fqn, t in self._tensors.items()}

    @property
    def rank_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter/buffer FQN (each alias of a tied weight) -> this rank's tensor:
        its shard, or the whole tensor where replicated (a decode step's caches included)."""
        return dict(self._tensors)

    @property
    def graph_module(self) -> fx.GraphModule:
        """The rewritten graph of the most recent way of calling (first: the example's)."""
        return self._last[0]

    @property
    def graphs(self) -> list[fx.GraphModule]:
        """Every rewritten graph made so far, once each (one per capture)."""
        unique = {id(gm): gm for graphs in self._graphs.values() for _, gm in graphs}
        return list(unique.values())

    @property
    def code(self) -> str:
        return self.graph_module.code

    @property
    def compiled_units(self) -> dict:
        """What ``compile.compile_graph`` compiled for each way of calling (call key ->
        modules); empty without ``compile``."""
        return self._compiler.units if self._compiler is not None else {}

    def forward(self, *args, **kwargs):
        self._check_materialized(args, kwargs)
        key = _key(args, kwargs, self.training)
        graphs = self._graphs.setdefault(key, [])
        reasons = []
        for shapes, gm in graphs:
            reason = shapes.mismatch(args, kwargs) if shapes is not None else None
            if reason is None:
                try:
                    return self._call(gm, args, kwargs)
                except _GuardFailed as e:  # guards run first: nothing has communicated
                    reason = e.guard
            reasons.append(reason)
        if reasons and key not in self._refits:
            self._refits.add(key)
            warnings.warn(f"{type(self.source).__name__}: captured anew for this call ("
                          f"{reasons[0]}): export specialised the capture to the example's "
                          f"shapes there, so calls outside them are captured anew", stacklevel=4)
        with PLANNING_LOCK:
            gm, shapes = self._graph_for(args, kwargs)
        graphs.append((shapes, gm))
        try:
            return self._call(gm, args, kwargs)
        except _GuardFailed as e:
            raise CaptureError(
                f"{type(self.source).__name__}: this call's inputs fail a condition export "
                f"recorded while capturing them: {e.guard}", where=type(self.source).__name__,
                fix="report the model: a fresh capture of a call should accept that call") from None

    def _call(self, gm: fx.GraphModule, args, kwargs):
        """Run ``gm``; a guard export left that the call fails is ``_GuardFailed``, and a
        fake tensor among the outputs a ``CaptureError``."""
        self._last[0] = gm
        if self._compiler is not None:
            self._compiler.before_call(self._group.rank)
        try:
            out = gm(*args, **kwargs)
        except AssertionError as e:
            if not str(e).startswith("Guard failed"):
                raise
            raise _GuardFailed(str(e).strip().splitlines()[0]) from None
        if any(isinstance(x, FakeTensor) for x in pytree.tree_leaves(out)):
            model = type(self.source).__name__
            raise CaptureError(f"{model}: the sharded graph returned a FakeTensor (a tensor "
                               f"of the capture baked into the graph)", where=model,
                               fix="rebuild the model and parallelize it again; report the model")
        return out

    def generate(self, input_ids: torch.Tensor, *, kv_cache: bool = True,
                 **kwargs) -> torch.Tensor:
        """Greedy or sampled generation, the same tokens on every rank (collective): the
        prompt once, then one token per step on this model's decode step (its K/V cache
        split by heads) unless ``kv_cache=False``. See ``generate.generate_sharded``; the
        sampling arguments are ``generate.generate``'s."""
        return generate_sharded(self, input_ids, kv_cache=kv_cache, **kwargs)

    def decode_step(self, batch: int, max_len: int,
                    captured: Captured | None = None) -> ShardedModule:
        """The parallelized decode step (``kvcache.decode_step``) of this model for ``batch``
        sequences of up to ``max_len`` tokens: its K/V caches split by heads, its
        parameters this module's own shards (not copies). Made once per (batch,
        max_len); raises ``UnsupportedDecode`` where the model has none. The step's plan
        keeps replicated what this module's plan does; ``captured``: the step's capture,
        if made already (``capture(step, step.example(2))``). See ``kvcache.DecodeSteps``."""
        return self._decode_steps.get(self, batch, max_len, captured)

    def shard_data_parallel(self, dp_mesh, options: dict) -> None:
        """FSDP2 over ``dp_mesh`` per block, then the root (``parallel.fsdp.apply_fsdp``);
        from then on this rank's parameters are its ``DTensor`` shards of its TP shards."""
        apply_fsdp(self, self.fsdp_blocks, dp_mesh, options)
        self._tensors.update(self.named_parameters(remove_duplicate=False))
        self._decode_steps.clear()

    def load_local_(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set this rank's tensors by FQN (every alias of a tied one): copied in place
        where they exist; where they are still on ``meta`` the given tensors become the
        storage (no copy: loading costs one shard, not two)."""
        if self.fsdp_blocks:
            raise CheckpointError("a model sharded with FSDP2 loads only DCP checkpoints",
                                  fix="use shardplan.checkpoint.load(sharded, path)")
        for fqn, value in tensors.items():
            current = self._tensors[fqn]
            if current.is_meta or current.shape != value.shape:
                new = nn.Parameter(value.detach(), current.requires_grad) \
                    if isinstance(current, nn.Parameter) else value.detach()
                set_spec(new, spec_of(current))
                for alias, t in list(self._tensors.items()):
                    if t is current:
                        self._tensors[alias] = new
            else:
                with torch.no_grad():
                    current.copy_(value)
        self._rebind()
        self._decode_steps.clear()  # they read the tensors replaced above

    def share_tensors_(self, tensors: dict[str, torch.Tensor]) -> None:
        """Read ``tensors`` (FQN -> a tensor of the spec and shape of this module's, every
        alias of a tied one named) in place of this module's own: the same objects, not
        copies (a decode step reads its model's shards, ``kvcache.DecodeSteps``)."""
        self._tensors.update(tensors)
        self._rebind()

    def _rebind(self) -> None:
        """Every graph (and this module's parameter list) reads ``_tensors`` again."""
        for gm in self.graphs:
            bind(gm, self._tensors)
        for name, t in self._last[0]._parameters.items():
            self.register_parameter(name, t)

    def _check_materialized(self, args, kwargs) -> None:
        if not any(t.is_meta for t in self._tensors.values()):
            return
        if any(isinstance(x, torch.Tensor) and not x.is_meta for x in pytree.tree_leaves((args, kwargs))):
            missing = [n for n, t in self._tensors.items() if t.is_meta]
            raise CheckpointError(
                f"the sharded model was built on meta and {len(missing)} tensors were never "
                f"loaded (e.g. {missing[0]!r})",
                fix="load weights first: shardplan.checkpoint.load_full_state_dict(sharded, path) "
                    "or checkpoint.load(sharded, checkpoint_dir)")

    def _graph_for(self, args, kwargs) -> tuple[fx.GraphModule, InputShapes]:
        """The rewritten graph of a new way of calling, with the first plan's layouts,
        and the input shapes its capture serves.

        The new capture is annotated with the parameters the first plan keeps
        replicated kept so. A parameter the first plan splits but this capture
        cannot (export specialised a size-1 dim so that the rules read it
        differently) is all-gathered where this graph reads it: correct, and
        the shards stay the model's one layout.
        """
        canon = {self._aliases.get(k, k): lay for k, lay in self._layouts.items()}
        keep = {fqn: canon.get(c, Replicate()) for fqn, c in self._aliases.items()}
        ann, captured = self._annotate(args, kwargs, self.training, keep=keep)
        sharded_otherwise = [k for k, lay in ann.params.items() if isinstance(lay, Shard)
                             and lay != keep.get(k)]
        if sharded_otherwise:  # a different split of a shard: read it whole instead
            keep.update((k, Replicate()) for k in sharded_otherwise)
            ann, captured = self._annotate(args, kwargs, self.training, captured, keep=keep)
        whole = {t: canon[captured.aliases.get(t, t)] for t, lay in ann.params.items()
                 if isinstance(canon.get(captured.aliases.get(t, t)), Shard)
                 and not isinstance(lay, Shard)}
        return self._finish(ann, captured, args, kwargs, whole), captured.shapes

    def _annotate(self, args, kwargs, training: bool, captured: Captured | None = None,
                  keep: dict | None = None):
        if captured is None:
            source = self._source[0]
            device = _device_of(source)
            was = source.training
            source.train(training)
            try:
                captured = capture(source, _to(args, device), _to(kwargs, device))
                check_dtypes(captured.gm)
            finally:
                source.train(was)
        return annotate(captured.gm, MeshSizes.of(tp=self._group.size), self._rules,
                        strict=self._strict, sequence_parallel=self.sequence_parallel, keep=keep,
                        cut_blocks=bool(self.recomputed or self.fsdp_blocks)), captured

    def _finish(self, ann: Annotation, captured, args, kwargs,
                whole: dict | None = None) -> fx.GraphModule:
        target = _input_device(args, kwargs) or _device_of(self._source[0])
        gm = rewrite(ann, {MeshDim.TP: self._group}, gather_output=self._gather, device=target)
        if whole:
            gather_params(gm, whole, self._group)
        outlined = self.fsdp_blocks or self.recomputed
        if outlined:
            gm = outline_blocks(gm, outlined, self._wrap)
        if not self.fsdp_blocks:
            bind(gm, self._tensors)
        elif not self._graphs:  # the first graph: its module tree becomes this module's
            bind(gm, self._tensors)
            gm = route_through_owners(gm)
        else:  # read the module tree FSDP2 manages
            gm = route_through_owners(gm)
            adopt_tree(gm, self)
        if self._compiler is not None:
            self._compiler.compile(_key(args, kwargs, self.training), gm)
        return gm

    def _wrap(self, piece: fx.GraphModule, block: str) -> nn.Module:
        if block in self.recomputed:
            piece = Recomputed(piece, block, self._group)
        return OwnedPiece(piece, block) if self.fsdp_blocks else piece


def parallel_step(step: nn.Module, group: Group, rules: RuleSet, *, strict: bool = False,
                  captured: Captured | None = None, keep: dict | None = None) -> ShardedModule:
    """A decode step (``kvcache.DecodeStep``) parallelized with its logits gathered, from one
    capture: the prompt's, whose token count stays symbolic, also serves every single
    token after it (the caches' shapes are static). The step's full-size caches are
    released: a rank holds only its shards."""
    sharded = ShardedModule(step, group, rules, example=(step.example(2), {}),
                            gather_output=True, strict=strict, captured=captured, keep=keep)
    sharded._graphs[_key(step.example(1), {}, step.training)] = [(None, sharded.graph_module)]
    step.release_caches()  # this rank's shards (or, replicated, the same objects) stay
    return sharded


class _GuardFailed(Exception):
    """A graph's export guard refused a call (before the graph computed anything)."""

    def __init__(self, guard: str):
        super().__init__(guard)
        self.guard = guard


def _key(args, kwargs, training: bool):
    leaves, spec = pytree.tree_flatten((args, kwargs))
    sig = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append(("T", x.dtype, x.device.type, tuple(d == 1 for d in x.shape)))
        else:
            sig.append(("V", repr(x)))
    return training, str(spec), tuple(sig)


def _device_of(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def _input_device(args, kwargs) -> torch.device | None:
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            return x.device
    return None


def _to(tree, device: torch.device):
    """Example inputs on the model's device (meta models capture on meta inputs)."""
    if device.type != "meta":
        return tree
    return pytree.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, tree)
