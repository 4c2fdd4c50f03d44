"""Two random streams for tensor-parallel dropout.

* **replicated** — torch's default generators (CPU, and the current CUDA
  device when CUDA is available), seeded with ``seed`` on every rank, so
  dropout on replicated activations draws the same mask everywhere;
* **model-parallel** — seeded with ``seed + 2718 + tp_rank`` (Megatron's
  offset), so dropout inside a sharded region (e.g. on attention
  probabilities, where ranks hold different heads) draws independent masks.

``tracker.fork()`` swaps the model-parallel state into the default
generators and back, keeping how far it advanced. ``get_states()`` /
``set_states()`` capture and restore both streams, which is what activation
recomputation needs to redraw the same masks. The model-parallel state lives
in tensors that are only ever updated in place (``state_for``): draws that
take the state as data (``region_random``) read and advance the same tensor
eager and compiled.

The default generators are per process: simulated ranks (threads) share
them, so run RNG-dependent code per rank sequentially or on real ranks.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..errors import ConfigurationError

REPLICATED = "replicated"
MODEL_PARALLEL = "model-parallel"


def model_parallel_seed(seed: int, tp_rank: int) -> int:
    """The seed of ``tp_rank``'s model-parallel stream (Megatron's ``seed + 2718 + rank``)."""
    return seed + 2718 + tp_rank


def _default_states(cuda: bool) -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if cuda:
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_default_states(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def _seeded_states(seed: int, cuda: bool) -> dict[str, torch.Tensor]:
    """The generator states ``manual_seed(seed)`` would give, without touching the defaults."""
    states = {"cpu": torch.Generator().manual_seed(seed).get_state()}
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device())
        states["cuda"] = torch.Generator(device).manual_seed(seed).get_state()
    return states


class RNGTracker:
    """Holds the model-parallel stream of one rank; the replicated one is torch's default.

    Constructing a tracker does not touch the default generators;
    ``manual_seed(seed, tp_rank)`` seeds them too and installs the tracker.
    ``cuda`` (default: ``torch.cuda.is_available()``) says whether the current
    CUDA device's generator is tracked besides the CPU one.
    """

    def __init__(self, seed: int, tp_rank: int, *, cuda: bool | None = None):
        self.seed, self.tp_rank = seed, tp_rank
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        #: the model-parallel stream's generator states by device type, updated in place
        self._parallel = _seeded_states(model_parallel_seed(seed, tp_rank), self.cuda)
        self._outside: dict[str, torch.Tensor] | None = None  # replicated state while forked

    @contextmanager
    def fork(self):
        """Draw from the model-parallel stream inside the block. Nested forks are no-ops."""
        if self._outside is not None:
            yield
            return
        self._outside = _default_states(self.cuda)
        _set_default_states(self._parallel)
        try:
            yield
        finally:
            _copy_into(self._parallel, _default_states(self.cuda))
            _set_default_states(self._outside)
            self._outside = None

    def get_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Both streams, ``{"replicated": {...}, "model-parallel": {...}}``, as copies."""
        current = _default_states(self.cuda)
        if self._outside is None:
            replicated, parallel = current, self._parallel
        else:
            replicated, parallel = self._outside, current
        return {REPLICATED: _clone(replicated), MODEL_PARALLEL: _clone(parallel)}

    def set_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore both streams from ``get_states()`` (inside or outside a fork)."""
        replicated, parallel = _clone(states[REPLICATED]), _clone(states[MODEL_PARALLEL])
        if self._outside is None:
            _set_default_states(replicated)
            _copy_into(self._parallel, parallel)
        else:
            self._outside = replicated
            _set_default_states(parallel)

    def model_parallel_state(self) -> dict[str, torch.Tensor]:
        """A copy of the model-parallel stream's current state."""
        return self.get_states()[MODEL_PARALLEL]

    @contextmanager
    def model_parallel_at(self, state: dict[str, torch.Tensor]):
        """Inside the block, the model-parallel stream starts at ``state``; afterwards
        it is back where it was (activation recomputation replays a block's draws)."""
        if self._outside is not None:
            raise ConfigurationError("model_parallel_at inside a fork",
                                     fix="replay a block outside tracker.fork()")
        now = _clone(self._parallel)
        _copy_into(self._parallel, state)
        try:
            yield
        finally:
            _copy_into(self._parallel, now)

    def state_for(self, device: torch.device) -> torch.Tensor:
        """The live model-parallel generator state for ``device``'s type (a CPU tensor
        that draws taking the state as data advance in place)."""
        if self._outside is not None:
            raise ConfigurationError("a model-parallel draw inside tracker.fork()",
                                     fix="call the sharded model outside tracker.fork()")
        return self._parallel[device.type]


def _copy_into(live: dict[str, torch.Tensor], states: dict[str, torch.Tensor]) -> None:
    for k, v in states.items():
        live[k].copy_(v)


def _clone(states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in states.items()}


_tracker: RNGTracker | None = None


def manual_seed(seed: int, tp_rank: int, *, cuda: bool | None = None) -> RNGTracker:
    """Seed the replicated stream with ``seed``, install a tracker for the other; return it.

    Call it on every rank with the same ``seed`` and the rank's TP rank.
    """
    tracker = RNGTracker(seed, tp_rank, cuda=cuda)
    torch.default_generator.manual_seed(seed)
    if tracker.cuda:
        torch.cuda.manual_seed(seed)
    set_rng_tracker(tracker)
    return tracker


def get_rng_tracker() -> RNGTracker:
    """The installed tracker."""
    if _tracker is None:
        raise ConfigurationError(
            "no tensor-parallel RNG tracker is installed",
            fix="call shardplan.runtime.manual_seed(seed, tp_rank) on every rank first")
    return _tracker


def tracker_for(tp_rank: int) -> RNGTracker:
    """The installed tracker; if none is, install one seeded from torch's initial seed."""
    if _tracker is None:
        set_rng_tracker(RNGTracker(torch.initial_seed(), tp_rank))
    return _tracker


def set_rng_tracker(tracker: RNGTracker | None) -> None:
    """Install ``tracker`` (``None`` removes it)."""
    global _tracker
    _tracker = tracker
