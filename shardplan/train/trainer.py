"""Train a language model with tensor, pipeline and data parallelism: the entry point for torchrun.

    torchrun --nproc-per-node 4 -m shardplan.train --tp 2 --model gpt-tiny --steps 200 \\
        --batch-size 8 --seq-len 32 --data input.txt --save ckpt --save-every 50
    torchrun --nproc-per-node 4 -m shardplan.train --tp 2 ... --resume ckpt

The world is a mesh (dp_replicate, dp_shard, tp) that ``ParallelDims``
builds, rank = dp_rank * tp + tp_rank with dp_rank = replica * dp_shard +
shard: the model is parallelized over each "tp" row; without FSDP2
gradients are averaged over the replicas (one flat all-reduce). NCCL when
CUDA is available (with gloo beside it for CPU tensors), else gloo.
Without torchrun it runs as a single process (tp = dp = 1).

**Pipeline parallelism.** ``--pp N`` (``parallel.pipeline.pipeline_parallel``): the
world is a pp x tp mesh; the model is cut into N stages (``--virtual-stages V``
per rank with ``--schedule interleaved``) by the planner's FLOP cost, each
stage tensor-parallel over its tp ranks, and every step runs the batch's
``--microbatches M`` through ``--schedule`` (gpipe, 1f1b, interleaved; torch's
``torch.distributed.pipelining``). Every rank reads the whole batch (the first
stage takes the inputs, the last the targets); the loss is the last stage's
mean over the microbatches, brought to every rank; the clipping norm spans
every stage and tp rank (a tied embedding and head counted once); AdamW steps
each rank's own stages. Not yet with data parallelism, ``--sequence-parallel``,
``--save``/``--resume``, ``--fp16``, ``--bf16``, ``--recompute`` or ``--compile``
(refused by name)::

    torchrun --nproc-per-node 4 -m shardplan.train --pp 2 --tp 2 --schedule 1f1b \\
        --microbatches 4 --batch-size 8 --steps 100

**Data.** Byte tokens (vocabulary 256) of ``--data FILE``, or, without a file,
a synthetic stream (a random Markov chain over bytes, so there is something
to learn). Here dp = dp_replicate * dp_shard, the data-parallel ranks.
Step s draws ``batch_size * dp`` windows of ``seq_len + 1`` tokens
at random offsets from a generator seeded by (seed, s); data-parallel replica
d takes rows ``[d * batch_size, (d + 1) * batch_size)``, and every TP rank of
a replica the same rows. The global batch therefore depends only on the seed,
the step and ``batch_size * dp``: a single process with ``--batch-size
B*dp`` sees exactly the concatenation of the replicas' batches, and a resumed
run reads exactly what the uninterrupted one would have.

``--dp-shard N`` (N > 1, or ``--fsdp``): FSDP2 (``parallelize(fsdp=True)``):
parameters, gradients and optimizer state are sharded over the dp_shard
ranks per block, and FSDP2 averages the gradients (the hand-written
all-reduce is only without it). With ``--dp-replicate R`` too it is HSDP:
R replicas of that sharding, FSDP2 all-reducing the gradient shards over
them. ``--dp N`` is the alias of before HSDP: ``--dp-shard N`` with
``--fsdp``, else ``--dp-replicate N``; ``--fsdp`` alone gives the shards
the data-parallel ranks ``--dp-replicate`` leaves.

**Optimizer.** ``shardplan.train.optim``: AdamW (betas 0.9/0.95, no decay on 1-D
parameters), linear warm-up then cosine decay to ``--min-lr``, global-norm
clipping that is correct under TP. ``--bf16``: ``torch.autocast`` to bfloat16
(weights and optimizer state stay float32). ``--fp16``: autocast to float16
with dynamic loss scaling (``TPGradScaler``, on CPU too): gradients are
unscaled before clipping, and an inf/nan in any rank's gradients makes every
rank skip the step and back the scale off, so no rank steps alone; the scale
is logged and saved with the checkpoint. Outside that scaling, a NaN or inf
loss or gradient norm on any rank is agreed over every rank (one all-gather
of two flags): ``--on-nonfinite stop`` (the default) raises ``NonFiniteError``
on every rank naming the step, the ranks and the value; ``skip`` skips the
step on every rank, with a warning and a count of skipped steps.
``--recompute``: each block's activations are recomputed in backward
(``parallelize(recompute=True)``), with the dropout masks of the first pass. ``--compile [BACKEND]``: ``parallelize(compile=...)``,
the sharded graph (or each block, with --recompute or --fsdp) under
``torch.compile`` with ``fullgraph=True`` (default backend inductor).

**Checkpoints.** ``--save DIR`` writes ``DIR/step-00000050`` (a torch DCP
checkpoint in the unsharded model's key space, ``checkpoint.save``: every rank
writes its part, one writer per replicated chunk) every ``--save-every`` steps
and at the end; ``--async-save`` writes it in the background
(``checkpoint.async_save``) while the next steps run, the next save waiting
for it. ``extra`` carries the step, the data position and each rank's RNG
streams, so ``--resume DIR`` (the newest ``step-*`` in it, or a checkpoint
directory itself) continues exactly: the next losses equal those of an
uninterrupted run. A checkpoint loads at any other mesh (the streams then
start afresh). ``--resume auto`` resumes the newest complete checkpoint in
``--save``'s directory if there is one, and so does a run that torchrun
restarts (``--max-restarts``, ``TORCHELASTIC_RESTART_COUNT`` > 0) with
``--save``: a killed rank costs the steps since the last checkpoint.
``--timeout SECONDS``: a collective of a step or save that waits longer for
its peers (a hung rank) raises ``CommunicationError`` naming the step and the
collective's site. ``shardplan.faults`` injects kills and hangs for tests.

``train(config)`` is the same thing as a function (losses per step, on every
rank); call it inside an initialized process group (e.g. a ``RealRanks``
worker) or let it start one from torchrun's environment.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import socket
import sys
import time
import typing
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import checkpoint
from ..faults import inject
from ..api import parallelize
from ..models.factory import call_factory, import_factory
from ..runtime.consistency import agree, assert_same_across, check_replicas
from ..runtime.comm import TorchGroup
from ..errors import CommunicationError, ConfigurationError, NonFiniteError
from .optim import (TPGradScaler, average_gradients, build_optimizer, clip_grad_norm_,
                    clip_pipeline_grad_norm_, lr_schedule)
from ..layouts import MeshDim
from ..parallel.pipeline import SCHEDULES as PIPELINE_SCHEDULES, Pipeline, pipeline_parallel
from ..parallel_dims import ParallelDims
from ..planner.stages import check_microbatches, check_schedule
from ..sharded import ShardedModule
from ..runtime.random import MODEL_PARALLEL, REPLICATED, manual_seed
from ..torch_compat import set_pg_timeout

__all__ = ["TrainConfig", "Trainer", "TokenData", "build_model", "training_step",
           "pipeline_step", "parallel_dims", "train", "main", "parse_args", "VOCAB"]

VOCAB = 256  # byte tokens
FORMAT = "shardplan.train/1"
SYNTHETIC_BYTES = 1 << 16
NONFINITE_CHOICES = ("stop", "skip")
#: the options that only mean something with ``--pp`` > 1
PIPELINE_OPTIONS = ("schedule", "microbatches", "virtual_stages")


def option(default, help: str, **argparse_kwargs):
    """A ``TrainConfig`` field: its default and its command-line help (``parse_args``
    generates ``--field-name`` from it; ``argparse_kwargs`` go to ``add_argument``)."""
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass
class TrainConfig:
    """Everything a run depends on; ``parse_args`` fills it from the command line."""

    model: str = option("gpt-tiny", "a bundled preset (gpt-tiny, llama-tiny, ...) or "
                                    "package.module:factory")
    tp: int | None = option(None, "tensor-parallel size (default: the ranks the data-parallel "
                                  "sizes leave; all ranks when none is set)")
    dp: int | None = option(None, "data-parallel size, an alias: --dp-shard with --fsdp, "
                                  "else --dp-replicate")
    dp_replicate: int | None = option(None, "data-parallel replicas: plain data parallelism, or "
                                            "HSDP's replicas with --dp-shard (default: the "
                                            "ranks tp and dp-shard leave)")
    dp_shard: int | None = option(None, "FSDP2's shards per replica; > 1 turns --fsdp on "
                                        "(default: 1; with --fsdp, the ranks tp and "
                                        "dp-replicate leave)")
    pp: int = option(1, "pipeline stages: the world is a pp x tp mesh, each stage tensor-"
                        "parallel over its tp ranks (not yet with data parallelism, "
                        "--sequence-parallel, --save/--resume, --fp16, --bf16, --recompute "
                        "or --compile)")
    schedule: str | None = option(None, "the pipeline's schedule, with --pp (default: 1f1b)",
                                  choices=tuple(PIPELINE_SCHEDULES))
    microbatches: int | None = option(None, "microbatches a batch is cut into, with --pp; "
                                            "they divide --batch-size (default: pp)")
    virtual_stages: int | None = option(None, "stages per rank of --schedule interleaved "
                                              "(default: 2)")
    steps: int = option(100, "optimizer steps")
    batch_size: int = option(8, "sequences per data-parallel replica and step")
    seq_len: int = option(32, "tokens per sequence")
    lr: float = option(1e-3, "peak learning rate")
    warmup: int = option(10, "linear warm-up steps")
    min_lr: float | None = option(None, "cosine floor (default: lr / 10)")
    clip: float = option(1.0, "global-norm clip; <= 0: no clipping (the norm is still logged)")
    weight_decay: float = option(0.01, "AdamW weight decay (not on 1-D parameters)")
    seed: int = option(1234, "model, data and dropout seed")
    data: str | None = option(None, "a file whose bytes are the tokens (default: a synthetic "
                                    "stream)", metavar="FILE")
    save: str | None = option(None, "checkpoint directory (step-* inside)", metavar="DIR")
    save_every: int = option(0, "steps between checkpoints (0: only at the end)")
    async_save: bool = option(False, "write each checkpoint in the background while training "
                                     "goes on (the next save waits for it)")
    resume: str | None = option(None, "a --save directory (its newest step-*), a checkpoint "
                                      "directory, or auto: the newest checkpoint in --save's "
                                      "directory if it has one (a torchrun restart with --save "
                                      "resumes so by itself)", metavar="DIR|auto")
    timeout: float | None = option(None, "seconds a collective of the training steps and "
                                         "saves waits for its peers before it raises an error "
                                         "naming it and the step (default: torch's, 30 min on "
                                         "gloo, 10 on NCCL)", metavar="SECONDS")
    on_nonfinite: str = option("stop", "a NaN or inf loss or gradient norm on any rank: "
                                       "stop every rank with an error, or skip the step on "
                                       "every rank", choices=NONFINITE_CHOICES)
    check_replicas_every: int = option(100, "steps between replica checks (0: only at the end)")
    bf16: bool = option(False, "bfloat16 autocast")
    fp16: bool = option(False, "float16 autocast with dynamic loss scaling; an inf/nan "
                               "gradient on any rank skips the step on every rank (not with "
                               "--bf16)")
    recompute: bool = option(False, "recompute each block's activations in backward (less "
                                    "memory, one more forward; dropout masks are redrawn "
                                    "identically)")
    sequence_parallel: bool = option(False, "hold the activations between the parallel "
                                            "regions on 1/tp of the sequence (the sequence "
                                            "length must divide by tp)")
    fsdp: bool = option(False, "shard parameters, gradients and optimizer state over the "
                        "dp-shard ranks with FSDP2, per block")
    compile: str | None = option(None, "torch.compile the sharded graph (fullgraph; per block "
                                       "with --recompute or --fsdp) with this backend; bare "
                                       "--compile: "
                                       "inductor", nargs="?", const="inductor",
                                 metavar="BACKEND")
    log_every: int = option(10, "steps between log lines (0: no logging)")
    dropout: float | None = option(None, "override a bundled preset's dropout")
    device: str | None = option(None, "cpu, cuda or cuda:N (default: cuda:LOCAL_RANK when "
                                      "CUDA is available, else cpu)")

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("warmup", "save_every", "check_replicas_every", "log_every"):
            if getattr(self, name) < 0:
                raise ConfigurationError(f"{name}={getattr(self, name)} must be >= 0")
        for name in ("tp", "dp", "dp_replicate", "dp_shard"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigurationError(f"{name}={v} must be >= 1")
        ParallelDims.data_parallel(dp=self.dp, dp_replicate=self.dp_replicate,
                                   dp_shard=self.dp_shard)  # --dp with either: refused
        if (self.dp_shard or 1) > 1:
            self.fsdp = True  # the shards are FSDP2's
        if self.lr <= 0:
            raise ConfigurationError(f"lr={self.lr} must be > 0")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise ConfigurationError(f"min_lr={self.min_lr} must be in [0, lr={self.lr}]")
        if not 0 <= self.seed < 2 ** 31:
            raise ConfigurationError(f"seed={self.seed} must be in [0, 2**31)")
        if self.resume == "auto" and not self.save:
            raise ConfigurationError("resume='auto' without a save directory", where="--resume auto",
                                     fix="pass --save DIR too: auto resumes its newest checkpoint")
        if self.timeout is not None and self.timeout <= 0:
            raise ConfigurationError(f"timeout={self.timeout} must be > 0 seconds",
                                     where="--timeout", fix="pass a positive number of seconds")
        if self.save_every and not self.save:
            raise ConfigurationError(f"save_every={self.save_every} without a save directory",
                                     fix="pass --save DIR too")
        if self.on_nonfinite not in NONFINITE_CHOICES:
            raise ConfigurationError(f"on_nonfinite={self.on_nonfinite!r} is not one of "
                                     f"{NONFINITE_CHOICES}", fix="use --on-nonfinite stop or skip")
        if self.dropout is not None and not 0 <= self.dropout < 1:
            raise ConfigurationError(f"dropout={self.dropout} must be in [0, 1)")
        if self.fsdp and self.fp16:
            raise ConfigurationError("fsdp and fp16 are both set", where="--fsdp --fp16",
                                     fix="use --bf16 with --fsdp (fp16 loss scaling over FSDP2's "
                                         "sharded gradients is not implemented)")
        if self.bf16 and self.fp16:
            raise ConfigurationError("bf16 and fp16 are both set", where="--bf16 --fp16",
                                     fix="choose one: --bf16 (no loss scaling needed) or "
                                         "--fp16 (float16 with dynamic loss scaling)")
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        """The pipeline options: only with ``pp`` > 1, defaults filled in then; the options
        the pipeline does not run yet refused by name; the schedule, its virtual stages and
        the microbatches checked as ``pipeline_parallel`` checks them."""
        if self.pp < 1:
            raise ConfigurationError(f"pp={self.pp} must be >= 1", where="--pp")
        if self.pp == 1:
            given = [f"--{name.replace('_', '-')}" for name in PIPELINE_OPTIONS
                     if getattr(self, name) is not None]
            if given:
                raise ConfigurationError(f"{', '.join(given)} without --pp", where="--pp",
                                         fix="pass --pp N (N >= 2 stages) to train with a "
                                             "pipeline, or leave them out")
            return
        refused = [flag for flag, on in self._without_pipeline().items() if on]
        if refused:
            raise ConfigurationError(
                f"pp={self.pp} with {', '.join(refused)}: not supported with pp yet",
                where="--pp", fix=f"leave {', '.join(refused)} out to train with pipeline "
                                  "parallelism (pp x tp), or train without --pp")
        self.schedule = self.schedule or "1f1b"
        self.microbatches = self.pp if self.microbatches is None else self.microbatches
        per_rank = check_schedule(self.schedule, self.virtual_stages,
                                  known=list(PIPELINE_SCHEDULES), where="--schedule")
        check_microbatches(self.microbatches, pp=self.pp, per_rank=per_rank,
                           schedule=self.schedule, rows={self.batch_size}, n_blocks=None,
                           layers="", where="--microbatches --batch-size")

    def _without_pipeline(self) -> dict[str, bool]:
        """Each option the pipeline does not run yet, and whether it is set."""
        return {"--dp": (self.dp or 1) > 1, "--dp-replicate": (self.dp_replicate or 1) > 1,
                "--dp-shard": (self.dp_shard or 1) > 1, "--fsdp": self.fsdp,
                "--sequence-parallel": self.sequence_parallel, "--save": bool(self.save),
                "--resume": bool(self.resume), "--fp16": self.fp16, "--bf16": self.bf16,
                "--recompute": self.recompute, "--compile": bool(self.compile)}

    def parallel_sizes(self) -> dict:
        """The sizes for ``ParallelDims.for_world``: ``--dp`` as its alias; with
        ``--fsdp`` the data-parallel ranks ``--dp-replicate`` leaves are the shards."""
        sizes = ParallelDims.data_parallel(dp=self.dp, dp_replicate=self.dp_replicate,
                                           dp_shard=self.dp_shard, fsdp=self.fsdp)
        if self.fsdp and self.tp is not None and sizes == {"dp_replicate": None,
                                                          "dp_shard": None}:
            sizes["dp_replicate"] = 1  # the rest goes to dp_shard
        return {"tp": self.tp, **sizes}

    @property
    def floor_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (from 0): warm-up, then cosine to ``floor_lr``."""
        return lr_schedule(step, lr=self.lr, warmup=self.warmup, total=self.steps,
                           min_lr=self.floor_lr)

    def autocast(self, device_type: str):
        """The autocast context of ``--bf16`` / ``--fp16``; a no-op without either."""
        if not (self.bf16 or self.fp16):
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=torch.float16 if self.fp16 else torch.bfloat16)


# --------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------

def synthetic_corpus(seed: int, n: int = SYNTHETIC_BYTES) -> np.ndarray:
    """``n`` bytes of a random Markov chain: each byte is followed by one of 4 others.

    Learnable (the best loss is log 4 ~ 1.39 nats) and fixed by ``seed``.
    """
    rng = np.random.default_rng([seed, 0x5A17])
    succ = rng.integers(0, VOCAB, size=(VOCAB, 4))
    choice = rng.integers(0, 4, size=n)
    out = np.empty(n, dtype=np.uint8)
    b = int(rng.integers(0, VOCAB))
    for i, c in enumerate(choice.tolist()):
        out[i] = b
        b = int(succ[b, c])
    return out


class TokenData:
    """Deterministic batches of byte tokens (see the module docstring)."""

    def __init__(self, path: str | None, *, seq_len: int, batch_size: int, dp: int, seed: int):
        self.path, self.seq_len, self.batch_size, self.dp, self.seed = \
            path, seq_len, batch_size, dp, seed
        if path is None:
            self.tokens = synthetic_corpus(seed)
        else:
            p = Path(path)
            if not p.is_file():
                raise ConfigurationError(f"--data {path}: no such file")
            size = p.stat().st_size
            self.tokens = np.memmap(p, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        if len(self.tokens) < seq_len + 2:
            raise ConfigurationError(
                f"the data has {len(self.tokens)} tokens, fewer than seq_len + 2 = {seq_len + 2}",
                fix="use a longer file or a shorter --seq-len")

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp

    def offsets(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 2 ** 32 + step)
        return torch.randint(0, len(self.tokens) - self.seq_len - 1,
                             (self.global_batch_size,), generator=g)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of every replica, concatenated: ``[batch_size * dp, seq_len]``."""
        rows = np.stack([np.asarray(self.tokens[o:o + self.seq_len + 1])
                         for o in self.offsets(step).tolist()]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def batch(self, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replica ``dp_rank``'s rows of step ``step``'s global batch."""
        x, y = self.global_batch(step)
        rows = slice(dp_rank * self.batch_size, (dp_rank + 1) * self.batch_size)
        return x[rows].contiguous(), y[rows].contiguous()

    def position(self, step: int) -> dict:
        """Where the next step reads, as JSON for a checkpoint."""
        return {"source": self.path or "synthetic", "tokens": int(len(self.tokens)),
                "sampler": "random-windows/1", "next_step": step,
                "sequences_seen": step * self.global_batch_size}


# --------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------

def build_model(config: TrainConfig) -> nn.Module:
    """The unsharded model, built from the current RNG state (seed it first).

    A bundled preset gets a byte vocabulary (256), a context of at least
    ``seq_len`` and ``config.dropout`` if given; ``package.module:factory``
    is called without arguments and must take ``(idx, targets)``.
    """
    from ..models import PRESETS, build
    if config.model in PRESETS:
        _, preset = PRESETS[config.model]
        fields = {f.name for f in dataclasses.fields(preset)}
        overrides: dict = {"vocab_size": VOCAB}
        for ctx in ("block_size", "max_seq_len"):
            if ctx in fields:
                overrides[ctx] = max(getattr(preset, ctx), config.seq_len)
        if config.dropout is not None:
            if "dropout" in fields:
                overrides["dropout"] = config.dropout
            elif config.dropout:
                raise ConfigurationError(f"{config.model} has no dropout to set",
                                         fix="leave --dropout out for this model")
        return build(config.model, **overrides)
    if ":" not in config.model:
        raise ConfigurationError(f"unknown model {config.model!r}",
                                 fix=f"use a preset ({', '.join(PRESETS)}) or package.module:factory")
    model = call_factory(config.model, import_factory(config.model))
    vocab = max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)),
                default=None)
    if vocab is not None and vocab < VOCAB:
        raise ConfigurationError(f"{config.model}() has a vocabulary of {vocab}; byte tokens "
                                 f"need {VOCAB}", fix="build the model with vocab_size >= 256")
    return model


def loss_of(out) -> torch.Tensor:
    """The loss from a model's output: ``(logits, loss)``, an object with ``.loss``, or a scalar."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    if isinstance(out, (tuple, list)) and len(out) >= 2 and isinstance(out[1], torch.Tensor):
        return out[1]
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise ConfigurationError(f"cannot find the loss in the model's output ({type(out).__name__})",
                             fix="forward(idx, targets) must return (logits, loss), an object "
                                 "with .loss, or the scalar loss")


# --------------------------------------------------------------------------
# process groups
# --------------------------------------------------------------------------

def _device(config: TrainConfig) -> torch.device:
    if config.device is not None:
        return torch.device(config.device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: torch.device) -> bool:
    """Start the default process group unless one exists; return whether this call started it.

    From torchrun's environment (``RANK``, ``WORLD_SIZE``, ...), else as a single process.
    """
    if dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # NCCL for CUDA tensors, gloo beside it for the small CPU tensors of shardplan's
    # consistency checks (model checksum, replica fingerprints)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None,
                                **_attempt_store())
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1)
    return True


def _attempt_store() -> dict:
    """Under torchrun's restarts, its agent's store with the keys of this attempt only
    (``init_process_group`` arguments; none otherwise). A restarted group in the store it
    shares would read the previous attempt's addresses (pytorch/pytorch#135712)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"shardplan.train/attempt-{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


# --------------------------------------------------------------------------
# RNG states as JSON
# --------------------------------------------------------------------------

def _rng_json(states: dict) -> dict:
    return {stream: {dev: t.tolist() for dev, t in st.items()} for stream, st in states.items()}


def _rng_of(saved: dict) -> dict:
    return {stream: {dev: torch.tensor(v, dtype=torch.uint8) for dev, v in saved[stream].items()}
            for stream in (REPLICATED, MODEL_PARALLEL)}


# --------------------------------------------------------------------------
# the trainer
# --------------------------------------------------------------------------

@dataclass
class StepResult:
    loss: torch.Tensor   # this replica's loss, detached
    norm: torch.Tensor   # the global gradient norm before clipping
    skipped: bool        # the optimizer did not step (non-finite values or fp16 overflow)
    scale: float | None  # the loss scale the backward used (fp16 only)
    #: the ranks that saw a non-finite "loss" / "grad norm" (agreed; empty: none did)
    nonfinite: dict[str, list[int]] = field(default_factory=dict)


def _finite_grads(model: nn.Module) -> bool:
    """Whether this rank's own gradients (replicated ones the norm counts on one rank
    only, too) are all finite."""
    sums = [torch.sum(g.to_local() if isinstance(g, DTensor) else g, dtype=torch.float32)
            for p in model.parameters() if (g := p.grad) is not None]
    return not sums or bool(torch.isfinite(torch.stack(sums).sum()))


def agree_nonfinite(loss: torch.Tensor, norm: torch.Tensor | None, model: nn.Module,
                    group=None) -> dict[str, list[int]]:
    """The ranks of ``group`` (a shardplan ``Group``; ``None``: this process alone) whose
    loss, or gradient norm (the global one or of its own gradients; ``norm=None``: not
    checked), is NaN or inf. One all-gather of two flags, so every rank decides alike
    even when only one saw it. Collective over ``group``."""
    flags = torch.tensor([not bool(torch.isfinite(loss)),
                          norm is not None and not (bool(torch.isfinite(norm))
                                                    and _finite_grads(model))],
                         dtype=torch.int32)
    if group is not None and group.size > 1:
        flags = group.all_gather(flags.to(group.device), 0, site="non-finite check").cpu()
    table = flags.reshape(-1, 2).tolist()
    found = {what: [r for r, row in enumerate(table) if row[i]]
             for i, what in enumerate(("loss", "grad norm"))}
    return {what: ranks for what, ranks in found.items() if ranks}


def training_step(model: nn.Module, optimizer, scaler: TPGradScaler, batch, *,
                  config: TrainConfig, lr: float, dp_group=None, group=None) -> StepResult:
    """One optimizer step of ``model`` on ``batch = (inputs, targets)``.

    The step every run takes: each rank's ``Trainer.train_step`` (a sharded
    model, ``dp_group`` its data-parallel replicas) and the demo's unsharded
    reference (the plain model, no group), so the reference cannot drift from
    what it checks. Clipping counts replicated gradients once (``optim``);
    with fp16 an overflow on any rank skips the step on every rank. A non-finite
    loss, or (without fp16) gradient norm, on any rank of ``group`` (``None``:
    this process alone) skips it on every rank of ``group`` (``agree_nonfinite``).
    """
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with config.autocast(x.device.type):
        loss = loss_of(model(x, y))
    scale = scaler.get_scale() if config.fp16 else None  # the scale this backward uses
    scaler.scale(loss).backward()  # without fp16: loss.backward()
    inject("step")  # fault-injection tests only (shardplan.faults)
    scaler.unscale_(optimizer)  # clip unscaled gradients; fp16's agreed overflow check
    if config.clip > 0:
        norm = clip_grad_norm_(model, config.clip, dp_group=dp_group)
    else:
        if dp_group is not None:
            average_gradients(model.parameters(), dp_group)
        norm = clip_grad_norm_(model, None)
    # with fp16 the scaler's agreed overflow check covers the gradients
    nonfinite = agree_nonfinite(loss, None if config.fp16 else norm, model, group)
    if config.fp16:
        skipped = bool(nonfinite) or scaler.found_inf(optimizer)
        if not nonfinite:
            scaler.step(optimizer)
        scaler.update()
    else:
        skipped = bool(nonfinite)
        if not skipped:
            optimizer.step()
    return StepResult(loss.detach(), norm, skipped, scale, nonfinite)


def parallel_dims(config: TrainConfig, world: int) -> ParallelDims:
    """The sizes of a run of ``config`` on ``world`` ranks; with --pp, a
    ``ConfigurationError`` when pp x tp leaves data-parallel ranks (not supported with pp
    yet)."""
    dims = ParallelDims.for_world(world, pp=config.pp, **config.parallel_sizes())
    if config.pp > 1 and dims.dp > 1:
        raise ConfigurationError(
            f"pp={config.pp} x tp={dims.tp} on {world} ranks leaves {dims.dp} data-parallel "
            f"ranks: data parallelism is not supported with pp yet", where="--pp --tp",
            fix="launch pp x tp processes, or leave --tp out (it takes the ranks pp leaves)")
    return dims


def pipeline_step(pipe: Pipeline, optimizer, batch, *, config: TrainConfig, lr: float,
                  group=None) -> StepResult:
    """One optimizer step of a pipeline (``--pp``) on ``batch = (inputs, targets)``, the
    whole batch on every rank: the schedule runs its microbatches forward and backward
    (the inputs enter the first stage, the loss is taken on the last and brought to every
    rank: the batch's mean), the global norm over every stage and tp rank is clipped
    (``clip_pipeline_grad_norm_``) and AdamW steps this rank's stages. A non-finite loss
    or gradient norm on any rank of ``group`` skips the step on every rank, as in
    ``training_step``."""
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    loss = pipe.step(x, y, broadcast_loss=True)
    inject("step")  # fault-injection tests only (shardplan.faults)
    norm = clip_pipeline_grad_norm_(pipe, config.clip)  # clip <= 0: only measures
    nonfinite = agree_nonfinite(loss, norm, pipe, group)
    if not nonfinite:
        optimizer.step()
    return StepResult(loss, norm, bool(nonfinite), None, nonfinite)


class Trainer:
    """One rank of a run: the mesh, the sharded model, the optimizer, the data.

    ``run()`` trains up to ``config.steps`` and returns this call's losses;
    ``history`` holds (step, loss, lr, grad norm, skipped, the skipped steps so far;
    with fp16 the loss scale the step used) per step taken.
    """

    def __init__(self, config: TrainConfig):
        self.config = config
        self.device = _device(config)
        init_distributed(self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        #: the parallel dims and their mesh
        self.dims = parallel_dims(config, self.world).with_mesh(self.device.type)
        self.tp, self.dp = self.dims.tp, self.dims.dp
        self.tp_rank, self.dp_rank = self.dims.tp_group.rank, self.dims.dp_rank
        #: the replicas whose gradients this rank averages (FSDP2 averages its own)
        self.dp_group = None if config.fsdp or self.dims.dp_replicate == 1 \
            else self.dims.group(MeshDim.DP_REPLICATE)

        self.data = TokenData(config.data, seq_len=config.seq_len, batch_size=config.batch_size,
                              dp=self.dp, seed=config.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)  # the same model on every rank
            model = build_model(config)
        model.to(self.device).train()
        self.n_params = sum(p.numel() for p in model.parameters())
        example = tuple(t.to(self.device) for t in self.data.batch(0, self.dp_rank))
        #: with --pp: this rank's pipeline stages (``sharded`` is None), else None
        self.pipe: Pipeline | None = None
        self.sharded = None
        if config.pp > 1:
            self.pipe = pipeline_parallel(model, example[0], dims=self.dims,
                                          microbatches=config.microbatches,
                                          schedule=config.schedule,
                                          virtual_stages=config.virtual_stages)
        else:
            self.sharded = parallelize(model, mesh=self.dims.mesh, example_inputs=example,
                                       gather_output=False, recompute=config.recompute,
                                       sequence_parallel=config.sequence_parallel,
                                       fsdp=config.fsdp,
                                       compile=config.compile or False)
        self.tracker = manual_seed(config.seed, self.tp_rank)
        self.optimizer = build_optimizer(self.trained, config.lr,
                                         weight_decay=config.weight_decay)
        # agreed over the world: TP ranks hold different shards, replicas different batches
        self.scaler = TPGradScaler(self.device.type, enabled=config.fp16)
        self.world_group = TorchGroup()  # the ranks that agree on a non-finite step
        self.step = 0  # optimizer steps taken
        self.skipped_steps = 0  # of them, those whose optimizer step was skipped
        self.history: list[dict] = []
        self.pending: checkpoint.PendingSave | None = None  # an --async-save under way
        start = resume_point(config)
        if start is not None:
            self.resume(start)
        if config.timeout is not None:  # from the first step: ranks set up at their own pace
            _set_timeout(self.dims.mesh, config.timeout)

    @property
    def trained(self):
        """What the optimizer steps: the pipeline (``pipe``) or the sharded model."""
        return self.sharded if self.pipe is None else self.pipe

    # -- one step ----------------------------------------------------------
    def train_step(self) -> dict:
        c, step = self.config, self.step
        lr = c.lr_at(step)
        batch = tuple(t.to(self.device, non_blocking=True)
                      for t in self.data.batch(step, self.dp_rank))
        try:
            if self.pipe is not None:
                done = pipeline_step(self.pipe, self.optimizer, batch, config=c, lr=lr,
                                     group=self.world_group)
            else:
                done = training_step(self.sharded, self.optimizer, self.scaler, batch,
                                     config=c, lr=lr, dp_group=self.dp_group,
                                     group=self.world_group)
        except CommunicationError as e:  # a dead or hung peer: say which step
            raise _in_step(e, step + 1) from e
        if done.nonfinite and c.on_nonfinite == "stop":  # the same decision on every rank
            raise NonFiniteError(f"step {step + 1}: {_nonfinite_text(done.nonfinite)}",
                                 where="shardplan.train (--on-nonfinite stop)",
                                 fix="lower --lr or check the data; --on-nonfinite skip skips "
                                     "such steps on every rank instead")
        self.skipped_steps += done.skipped
        if done.skipped and self.rank == 0:
            why = (_nonfinite_text(done.nonfinite) if done.nonfinite else
                   f"inf/nan gradients at loss scale {done.scale:g}, backed off to "
                   f"{self.scaler.get_scale():g}")
            print(f"shardplan.train: step {step + 1}: {why}; step skipped "
                  f"({self.skipped_steps} skipped so far)", file=sys.stderr, flush=True)
        mean = done.loss.float().reshape(1)
        for group in self.dims.dp_groups:  # the sum over every data-parallel rank
            mean = group.all_reduce(mean, site=f"step {step + 1}'s mean loss")
        mean /= self.dp
        self.step += 1
        record = {"step": self.step, "loss": mean.item(), "lr": lr,
                  "grad_norm": done.norm.item(), "skipped": done.skipped,
                  "skipped_steps": self.skipped_steps}
        if c.fp16:
            record["scale"] = done.scale
        self.history.append(record)
        return record

    # -- the loop ----------------------------------------------------------
    def run(self) -> list[float]:
        c = self.config
        losses = []
        if self.rank == 0 and c.log_every:
            self._log_header()
        tokens = self.data.global_batch_size * c.seq_len
        t_log, since = time.perf_counter(), 0
        while self.step < c.steps:
            rec = self.train_step()
            losses.append(rec["loss"])
            since += 1
            if c.log_every and self.rank == 0 and (
                    self.step % c.log_every == 0 or self.step == c.steps or self.step == 1):
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                now = time.perf_counter()
                rate = tokens * since / max(now - t_log, 1e-9)
                print(f"step {self.step:>6}/{c.steps} | loss {rec['loss']:.4f} | "
                      f"lr {rec['lr']:.3e} | grad norm {rec['grad_norm']:.4f} | "
                      + (f"scale {rec['scale']:g} | " if c.fp16 else "")
                      + (f"skipped {rec['skipped_steps']} | " if rec["skipped_steps"] else "")
                      + f"{rate:,.0f} tok/s", flush=True)
                t_log, since = now, 0
            if c.check_replicas_every and self.step % c.check_replicas_every == 0:
                self.check_replicas()
            if c.save and ((c.save_every and self.step % c.save_every == 0)
                           or self.step == c.steps):
                self.save(Path(c.save) / f"step-{self.step:08d}")
        self.wait_for_save()
        self.check_replicas()
        return losses

    def check_replicas(self) -> None:
        """Replicated parameters equal across TP ranks; every parameter equal across replicas.

        Collective over the world: both checks run on every rank, and if either
        fails anywhere, every rank raises (no rank is left waiting in a collective).
        """
        def both():  # each check is collective over its group: run both, then raise
            first = None
            for check in (self._check_tp_replicas, self._check_dp_replicas):
                try:
                    check()
                except CommunicationError as e:
                    first = first or e
            if first:
                raise first

        agree(TorchGroup(), "the replica check", both)

    def _check_tp_replicas(self) -> None:
        """Each tp-sharded model's replicated parameters (with --pp, each stage's)."""
        modules = [self.sharded] if self.pipe is None else list(self.pipe.modules.values())
        for module in modules:
            if isinstance(module, ShardedModule):
                check_replicas(module)

    def _check_dp_replicas(self) -> None:
        """Along dp_replicate every rank holds the same tensors (with HSDP, the same
        FSDP2 shards); FSDP2's shards along dp_shard differ."""
        if self.dims.dp_replicate > 1:
            local = {n: p.to_local() if isinstance(p, DTensor) else p
                     for n, p in self.sharded.named_parameters()}
            assert_same_across(self.dims.group(MeshDim.DP_REPLICATE), local,
                               what="data-parallel replicas drifted",
                               fix="every replica must average the same gradients and "
                                   "step alike; report it with the plan")

    # -- checkpoints -------------------------------------------------------
    def extra(self) -> dict:
        c = self.config
        return {"format": FORMAT, "step": self.step, "skipped_steps": self.skipped_steps,
                "data": self.data.position(self.step),
                "rng": _rng_json(self.tracker.get_states()),
                "scaler": self.scaler.state_dict(),  # {} without fp16
                "config": {"model": c.model, "tp": self.tp, "dp": self.dp,
                           "dp_replicate": self.dims.dp_replicate,
                           "dp_shard": self.dims.dp_shard, "seed": c.seed,
                           "batch_size": c.batch_size, "seq_len": c.seq_len, "lr": c.lr,
                           "steps": c.steps, "bf16": c.bf16, "fp16": c.fp16}}

    def save(self, path: Path) -> None:
        """Collective over the world: every rank writes its part, each rank's random
        streams in ``extra``. With ``--async-save`` the previous save is waited for and
        this one only started (``wait_for_save`` finishes it)."""
        t0 = time.perf_counter()
        self.wait_for_save()
        extra = self.extra()
        extra["rng"] = [None] * self.world
        dist.all_gather_object(extra["rng"], _rng_json(self.tracker.get_states()))
        if self.config.async_save:
            self.pending = checkpoint.async_save(self.sharded, path, optimizer=self.optimizer,
                                                 extra=extra)
        else:
            checkpoint.save(self.sharded, path, optimizer=self.optimizer, extra=extra)
            dist.barrier()
        if self.rank == 0 and self.config.log_every:
            print(f"{'started saving' if self.config.async_save else 'saved'} step "
                  f"{self.step} to {path} ({time.perf_counter() - t0:.2f} s)", flush=True)

    def wait_for_save(self) -> None:
        """Finish the save under way (``--async-save``), if any. Collective."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            dist.barrier()

    def resume(self, path) -> None:
        extra = checkpoint.load(self.sharded, path, optimizer=self.optimizer)
        rng = extra.get("rng") or []
        extra["rng"] = rng[self.rank] if len(rng) == self.world else _rng_json(
            self.tracker.get_states())  # another world: the streams start afresh
        if extra.get("format") != FORMAT or "step" not in extra:
            raise ConfigurationError(f"{path} was not written by shardplan.train "
                                     f"(extra: {sorted(extra)[:5]})",
                                     fix="resume from a --save directory of shardplan.train")
        saved = extra.get("config", {})
        c = self.config
        mine = {"model": c.model, "seed": c.seed, "seq_len": c.seq_len,
                "global_batch": c.batch_size * self.dp}
        theirs = {"model": saved.get("model"), "seed": saved.get("seed"),
                  "seq_len": saved.get("seq_len"),
                  "global_batch": (saved.get("batch_size") or 0) * (saved.get("dp") or 0)}
        changed = {k: (theirs[k], mine[k]) for k in mine if theirs[k] != mine[k]}
        if changed and self.rank == 0:
            warnings.warn(f"resuming {path} with a different configuration {changed} "
                          "(saved, now): the run will not be the one that was saved",
                          stacklevel=2)
        data = extra.get("data", {})
        if data.get("tokens") not in (None, len(self.data.tokens)) and self.rank == 0:
            warnings.warn(f"the data has {len(self.data.tokens)} tokens; the checkpoint was "
                          f"trained on {data.get('tokens')}", stacklevel=2)
        self.step = int(extra["step"])
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        self.tracker.set_states(_rng_of(extra["rng"]))
        if extra.get("scaler"):  # the loss scale and growth tracker (a no-op without fp16)
            self.scaler.load_state_dict(extra["scaler"])
        self.check_replicas()
        if self.rank == 0 and c.log_every:
            print(f"resumed {path} at step {self.step}", flush=True)

    def _log_header(self) -> None:
        c = self.config
        backend = dist.get_backend()
        pipeline = (f"pp {c.pp} ({c.schedule}, {c.microbatches} microbatches) x "
                    if c.pp > 1 else "")
        print(f"shardplan.train: {c.model} ({self.n_params / 1e6:.2f}M parameters), "
              f"world {self.world} = {pipeline}dp_replicate {self.dims.dp_replicate} x dp_shard "
              f"{self.dims.dp_shard} x tp {self.tp}, {backend} on {self.device.type}"
              f"{', bf16 autocast' if c.bf16 else ''}"
              f"{', fp16 autocast with loss scaling' if c.fp16 else ''}"
              f"{', recomputed blocks' if c.recompute else ''}"
              f"{', FSDP2 over dp_shard' if c.fsdp else ''}"
              f"{' (HSDP)' if c.fsdp and self.dims.dp_replicate > 1 else ''}"
              f"{f', compiled ({c.compile})' if c.compile else ''}; global batch "
              f"{self.data.global_batch_size} x {c.seq_len} tokens; "
              f"data {c.data or 'synthetic'}", flush=True)


def _in_step(e: CommunicationError, step: int) -> CommunicationError:
    """``e`` with the step it stopped named first."""
    out = CommunicationError(f"step {step}: {e.what}", where=e.where, source=e.source, fix=e.fix)
    out.secondary = getattr(e, "secondary", False)
    return out


def _set_timeout(mesh, seconds: float) -> None:
    """Every process group of the run waits at most ``seconds`` for its peers."""
    for pg in [dist.group.WORLD, *(mesh.get_group(n) for n in mesh.mesh_dim_names)]:
        set_pg_timeout(timedelta(seconds=seconds), pg)


def _nonfinite_text(found: dict[str, list[int]]) -> str:
    """``{"loss": [1]}`` as ``non-finite loss on rank 1``."""
    return "; ".join(f"non-finite {what} on rank{'s' * (len(ranks) > 1)} "
                     f"{', '.join(map(str, ranks))}" for what, ranks in found.items())


_STEP_DIR = re.compile(r"step-(\d+)$")


def _is_checkpoint(path: Path) -> bool:
    """A checkpoint, or one of the retired format (which ``checkpoint.load`` names)."""
    return (path / ".metadata").is_file() or (path / "index.json").is_file()


def newest_checkpoint(path) -> Path | None:
    """The complete ``step-*`` checkpoint of the highest step in ``path``; None if none."""
    found = sorted((int(m.group(1)), p) for p in Path(path).glob("step-*")
                   if (m := _STEP_DIR.match(p.name)) and _is_checkpoint(p))
    return found[-1][1] if found else None


def resolve_checkpoint(path) -> Path:
    """``path`` itself if it is a checkpoint, else its newest ``step-*`` checkpoint."""
    path = Path(path)
    if _is_checkpoint(path):
        return path
    found = newest_checkpoint(path)
    if found is None:
        raise ConfigurationError(f"--resume {path}: no checkpoint there",
                                 fix="give a --save directory (its newest step-* is used) "
                                     "or one step-* checkpoint directory")
    return found


def resume_point(config: TrainConfig) -> Path | None:
    """The checkpoint a run starts from, None for a fresh start: ``--resume``'s; with
    ``--resume auto``, or when torchrun restarts a run (``TORCHELASTIC_RESTART_COUNT``
    > 0) with ``--save`` and no ``--resume``, the newest in ``--save``'s directory."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    if config.resume == "auto" or (config.resume is None and config.save and restarted):
        return newest_checkpoint(config.save)
    return None if config.resume is None else resolve_checkpoint(config.resume)


def train(config: TrainConfig) -> list[float]:
    """Train as ``config`` says; return the loss of each step taken (the global batch's
    mean, the same on every rank). Collective: call it on every rank."""
    owns = init_distributed(_device(config))
    ok = False
    try:
        losses = Trainer(config).run()
        ok = True
        return losses
    finally:
        if owns and dist.is_initialized():
            if ok:
                dist.barrier()  # cheap insurance against teardown races
            dist.destroy_process_group()


# --------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    """The command line, one ``--field-name`` per ``TrainConfig`` field (its type,
    default and help); a bool field is a switch with its ``--no-`` form."""
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m shardplan.train",
        description="Train a language model on byte tokens with Megatron tensor parallelism "
                    "(shardplan.parallelize) and data parallelism.")
    types = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        kwargs = dict(f.metadata)
        help_text = kwargs.pop("help", "")  # a field declared with option() has help
        flag = "--" + f.name.replace("_", "-")
        if types[f.name] is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           help=help_text, **kwargs)
            continue
        kind = next(t for t in typing.get_args(types[f.name]) or (types[f.name],)
                    if t is not type(None))
        if f.default is not None:
            help_text += f" (default: {f.default})"
        p.add_argument(flag, type=kind, default=f.default, help=help_text, **kwargs)
    return p


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The ``TrainConfig`` of a command line (``ConfigurationError`` for bad values)."""
    args = parser().parse_args(argv)
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    losses = train(config)
    return 0 if all(math.isfinite(x) for x in losses) else 1

