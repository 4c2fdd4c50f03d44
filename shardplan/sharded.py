"""The module ``parallelize`` returns: one rewritten graph per way of calling it.

Users call one model several ways (with and without targets, train and eval,
batch 1 for inference). A capture bakes in its signature and mode, so the
sharded module captures each new way on first use and caches the rewritten
graph; every graph binds the same parameter shards.
"""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx
import torch.nn as nn

from . import arguments
from .planner.capture import PLANNING_LOCK, Captured, capture
from .planner.annotate import Annotation, annotate
from .planner.input_shapes import InputShapes
from .planner.inputs import check_dtypes
from .layouts import MeshDim, MeshSizes, Replicate, Shard, set_spec, spec_of
from .planner.plan import build_plan
from .parallel.fsdp import OwnedPiece, adopt_tree, apply_fsdp, install_owners, route_through_owners
from .planner.recompute import Recomputed, block_names, outline_blocks
from .errors import CaptureError, CheckpointError, ConfigurationError
from .planner.rewrite import bind, gather_params, rewrite
from .planner.rules import RuleSet
from .runtime.comm import Group
from .runtime.graph_ops import ModelParallelRNG
from .runtime.onednn import OneDnnGemms
from .runtime.overlap import OverlapCollectives
from .runtime.passes import PostGradPasses
from .runtime.random import tracker_for
from .runtime.region_random import DRAWS
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
        self._compile = compile  # False, or torch.compile's backend (True: inductor)
        self._source = [source]  # a list hides it from nn.Module's registry
        self._group, self._rules = group, rules
        self._gather, self._strict = gather_output, strict
        self.sequence_parallel = sequence_parallel
        #: call key -> [(the input shapes it serves or None for any, rewritten graph)]
        self._graphs: dict[tuple, list[tuple[InputShapes | None, fx.GraphModule]]] = {}
        self._refits: set = set()  # call keys already warned about a specialised capture
        self._decoders: dict = {}  # (batch, max_len) -> the parallelized decode step
        #: what ``compile_graph`` compiled for each way of calling (call key -> modules)
        self.compiled_units: dict = {}
        self._draws = False  # a compiled graph draws from the model-parallel stream
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
        if self._draws:  # a compiled graph reads the tracker's state but cannot install one
            tracker_for(self._group.rank)
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
        """Greedy or sampled generation, the same tokens on every rank (collective);
        see ``shardplan.generate.generate`` for the arguments.

        With ``kv_cache`` (the default) the model runs as its decode step
        (``decode_step``): the prompt once, then one token per step, each rank
        holding its heads of the K/V cache. A model with no decode step
        recomputes the whole prefix for every token, with a warning saying why. The
        arguments are checked (``generate.check_arguments``) before a step is built.
        """
        from .generate import check_arguments, generate
        check_arguments(self._source[0], input_ids, **kwargs)  # before a decode step is built
        arguments.flag("kv_cache", kv_cache, where="generate")
        step = self._decoder_for(input_ids, kwargs["max_new_tokens"]) if kv_cache else None
        gather = None if self._gather or step is not None else self._vocab_gather()
        return generate(self, input_ids, group=self._group, source=self._source[0],
                        gather=gather, step=step, **kwargs)

    def decode_step(self, batch: int, max_len: int,
                    captured: Captured | None = None) -> "ShardedModule":
        """The parallelized decode step (``kvcache.decode_step``) of this model for ``batch``
        sequences of up to ``max_len`` tokens: its K/V caches split by heads, its
        parameters this module's own shards (not copies). Made once per (batch,
        max_len); raises ``UnsupportedDecode`` where the model has none. The step's plan
        keeps replicated what this module's plan does; ``captured``: the step's capture,
        if made already (``capture(step, step.example(2))``)."""
        from .kvcache import decode_step
        key = (batch, max_len)
        if key not in self._decoders:
            keep = {"model." + fqn: lay for fqn, lay in self.layouts.items()}
            with PLANNING_LOCK:
                step = decode_step(self._source[0], batch, max_len)
            sharded = parallel_step(step, self._group, self._rules, strict=self._strict,
                                    captured=captured, keep=keep)
            sharded._adopt(self, prefix="model.")
            self._decoders[key] = sharded
        return self._decoders[key]

    def _decoder_for(self, input_ids: torch.Tensor, max_new_tokens: int):
        """The decode step that fits this generation, or None (warned) where there is none."""
        from .errors import ShardplanError
        from .kvcache import cache_length
        batch, prompt = input_ids.shape
        if max_new_tokens < 1:
            return None  # the prompt is the result
        try:
            length = cache_length(self._source[0], prompt + max_new_tokens - 1)
            return self.decode_step(batch, length)
        except ShardplanError as e:  # no step, or one that cannot be captured or planned
            warnings.warn(f"generate: no K/V cache, the prefix is recomputed for every token: "
                          f"{e.what}", stacklevel=3)
            return None

    def _adopt(self, owner: "ShardedModule", prefix: str) -> None:
        """Read ``owner``'s tensors (this module's FQN = ``prefix`` + theirs) in place of this
        module's copies of them; caches still on ``meta`` become zeros on ``owner``'s device."""
        from .errors import UnsupportedDecode
        device = _device_of(owner)
        for fqn, mine in list(self._tensors.items()):
            theirs = owner._tensors.get(fqn.removeprefix(prefix)) if fqn.startswith(prefix) \
                else None
            if theirs is None:
                if mine.is_meta:
                    new = set_spec(torch.zeros(mine.shape, dtype=mine.dtype, device=device),
                                   spec_of(mine))
                    self._tensors[fqn] = new
                continue
            if spec_of(theirs) != spec_of(mine) or theirs.shape != mine.shape:
                raise UnsupportedDecode(
                    f"the decode step splits {fqn.removeprefix(prefix)} as "
                    f"{spec_of(mine).layout} but the model as {spec_of(theirs).layout}")
            self._tensors[fqn] = theirs
        self._rebind()

    def _vocab_gather(self):
        """With gather_output=False: the function that turns this rank's part of the last
        position's logits (batch, vocab part) into the full, unpadded (batch, vocab)."""
        out = next(n for n in self.annotation.gm.graph.nodes if n.op == "output")
        logits = pytree.tree_leaves(out.args[0])[0]
        lay, full = self.annotation.layouts.get(logits), logits.meta["val"].shape
        if not isinstance(lay, Shard):
            return None
        if lay.dim % len(full) != len(full) - 1:
            raise ConfigurationError(f"the logits are split along dim {lay.dim}, not the vocabulary",
                                     fix="parallelize with gather_output=True to generate")

        def gather(part: torch.Tensor) -> torch.Tensor:
            parts = self._group.all_gather(part.unsqueeze(0), 0, site="generate.logits").unbind(0)
            return Shard(part.dim() - 1, lay.blocks, lay.padded, lay.replicas).unshard(
                list(parts), int(full[-1]))
        return gather

    def shard_data_parallel(self, dp_mesh, options: dict) -> None:
        """FSDP2 over ``dp_mesh`` per block, then the root (``parallel.fsdp.apply_fsdp``);
        from then on this rank's parameters are its ``DTensor`` shards of its TP shards."""
        apply_fsdp(self, self.fsdp_blocks, dp_mesh, options)
        self._tensors.update(self.named_parameters(remove_duplicate=False))
        self._decoders.clear()

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
        self._decoders.clear()  # they read the tensors replaced above

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
        if self._compile:
            self.compiled_units[_key(args, kwargs, self.training)] = compile_graph(
                gm, "inductor" if self._compile is True else self._compile)
            self._draws |= any(isinstance(m, ModelParallelRNG) for m in gm.modules())
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


def compile_graph(gm: fx.GraphModule, backend: str) -> list[nn.Module]:
    """``torch.compile`` ``gm`` in place, each unit as one graph (``fullgraph``), and
    return the units: every block's piece when the graph is cut into blocks
    (recomputation or FSDP2: torchtitan's per-block compile, the glue between blocks
    and FSDP2's hooks stay eager), else the whole graph. Batch and sequence become
    dynamic on the first call with other sizes (one recompile). Dropout draws the
    masks eager draws: the model-parallel stream through ``region_random``, the
    replicated one through torch's generator (inductor's ``fallback_random``). Under
    inductor the forward and input-gradient GEMMs run on oneDNN (``runtime.onednn``)
    and each collective overlaps the compute that does not need it
    (``runtime.overlap``)."""
    fork = [name for name, m in gm.named_modules()
            if isinstance(m, ModelParallelRNG) and not m.traceable]
    if fork:
        raise ConfigurationError(
            f"compile: {fork[0]} runs {gm.get_submodule(fork[0]).op} on the model-parallel RNG "
            f"stream by swapping generators, which torch.compile cannot trace (only "
            f"{', '.join(DRAWS)} have a traceable form)",
            fix="remove that op from the rule file's random table, call eval(), or pass "
                "compile=False")
    units = [m.block for m in gm.modules() if isinstance(m, Recomputed)]
    units += [m.piece for m in gm.modules()
              if isinstance(m, OwnedPiece) and not isinstance(m.piece, Recomputed)]
    # inductor draws replicated-stream dropout from its own generator unless told to call
    # torch's: with the fallback a compiled model draws the masks an eager one draws;
    # forward and input-gradient GEMMs run on oneDNN (runtime/onednn.py); each
    # collective overlaps the compute that does not need it (runtime/overlap.py), in
    # the order that pass leaves (inductor's peak-memory reordering would undo it)
    passes = PostGradPasses(OneDnnGemms(), OverlapCollectives())
    options = ({"fallback_random": True, "post_grad_custom_post_pass": passes,
                "reorder_for_peak_memory": False} if backend == "inductor" else None)
    for unit in units or [gm]:
        unit.compile(fullgraph=True, backend=backend, options=options)
    return units or [gm]


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
