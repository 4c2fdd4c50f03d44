"""Tensor-parallel layers that hold only this rank's shard.

Each layer can be built in three ways:

* ``Layer(..., group=group)`` initializes the *full* layer exactly as its torch
  counterpart would (same RNG draws) and keeps this rank's slice, so a seed
  gives the same model for every tp;
* ``Layer(..., device="meta")`` allocates nothing (for planning);
* ``Layer.from_full(module, group)`` copies this rank's slice of an existing
  ``nn.Linear`` / ``nn.Embedding``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigurationError, DivisibilityError
from ..torch_compat import is_fake
from .comm import Group, as_group
from .mappings import copy_to_region, gather_from_region, reduce_from_region, scatter_to_region


def _check_divides(size: int, tp: int, what: str) -> None:
    if size % tp:
        ok = [d for d in range(1, min(size, 64) + 1) if size % d == 0]
        raise DivisibilityError(
            f"{what}={size} does not divide by tp={tp}",
            fix=f"use a tp that divides {size} (e.g. {ok[-4:]}), or pad {what} "
                f"to a multiple of {tp}")


def padded_vocab_size(num_embeddings: int, tp: int) -> int:
    """``num_embeddings`` rounded up to a multiple of ``tp``."""
    return -(-num_embeddings // tp) * tp


def vocab_range(padded_vocab: int, rank: int, size: int) -> tuple[int, int]:
    """The ids ``[start, end)`` that ``rank`` of ``size`` owns in a padded vocabulary."""
    _check_divides(padded_vocab, size, "padded_vocab")
    per = padded_vocab // size
    return rank * per, (rank + 1) * per


def _copy_param(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    """A new Parameter owning a copy of ``t`` (never a view of the full tensor)."""
    return nn.Parameter(t.detach().clone(memory_format=torch.contiguous_format),
                        requires_grad=like.requires_grad)


class _ParallelLinear(nn.Module):
    """What column- and row-parallel linears share: shapes, group, construction."""

    split_dim: int  # of the full weight (out, in): 0 = column, 1 = row

    def __init__(self, in_features: int, out_features: int, bias: bool, group,
                 device, dtype):
        super().__init__()
        self.group: Group = as_group(group)
        self.in_features, self.out_features = in_features, out_features
        full_shape = [out_features, in_features]
        name = ("out_features", "in_features")[self.split_dim]
        _check_divides(full_shape[self.split_dim], self.group.size,
                       f"{type(self).__name__}.{name}")
        shape = list(full_shape)
        shape[self.split_dim] //= self.group.size
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(shape, **kw))
        bias_size = shape[0]  # column: split with the weight; row: full, added after g
        self.bias = nn.Parameter(torch.empty(bias_size, **kw)) if bias else None
        if not self.weight.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization of the full layer, keeping this rank's slice."""
        w = self.weight
        full = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                         device=w.device, dtype=w.dtype)
        self._load_full(full)

    def _load_full(self, full: nn.Linear) -> None:
        rank, tp = self.group.rank, self.group.size
        self.weight = _copy_param(full.weight.chunk(tp, self.split_dim)[rank], full.weight)
        if full.bias is not None:
            b = full.bias.chunk(tp)[rank] if self.split_dim == 0 else full.bias
            self.bias = _copy_param(b, full.bias)

    @classmethod
    def from_full(cls, module: nn.Linear, group, **kwargs):
        """This rank's shard of ``module`` (an ``nn.Linear``), as a copy."""
        if not isinstance(module, nn.Linear):
            raise ConfigurationError(
                f"{cls.__name__}.from_full needs an nn.Linear, got {type(module).__name__}")
        layer = cls(module.in_features, module.out_features, module.bias is not None,
                    group=group, device="meta", dtype=module.weight.dtype, **kwargs)
        layer._load_full(module)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp={self.group.size}, rank={self.group.rank}, "
                f"local_weight={tuple(self.weight.shape)}")


class ColumnParallelLinear(_ParallelLinear):
    """``y = x Wᵀ + b`` with ``W`` split along its output dim (``Y`` = ``Shard(-1)``).

    The input (replicated) goes through f; ``gather_output`` all-gathers the
    output, otherwise it stays this rank's slice. ``skip_f`` leaves f to the
    caller, so several layers reading one tensor (q, k, v) share a single f.
    """

    split_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group,
                 gather_output: bool = False, skip_f: bool = False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, group, device, dtype)
        self.gather_output, self.skip_f = gather_output, skip_f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.skip_f:
            x = copy_to_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_region(y, self.group) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """``y = x Wᵀ + b`` with ``W`` split along its input dim; g sums the partial outputs.

    With ``input_is_parallel`` the input is already this rank's last-dim slice
    (a column-parallel output); otherwise it is split here. The full bias is
    added once, after g. ``skip_g`` returns the ``Partial`` output without g
    and *without the bias*: the caller reduces it (sharing one g among several
    layers) and then adds ``self.bias``.
    """

    split_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group,
                 input_is_parallel: bool = True, skip_g: bool = False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, group, device, dtype)
        self.input_is_parallel, self.skip_g = input_is_parallel, skip_g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group)
        y = F.linear(x, self.weight)
        if self.skip_g:
            return y
        y = reduce_from_region(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over the group.

    The vocabulary is padded to ``padded_vocab``, a multiple of tp, with zero
    rows; rank r owns ids ``vocab_range(padded_vocab, r, tp)``. Each rank looks
    up the ids it owns, zeroes the rest, and g sums the ranks' rows.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group,
                 padding_idx: int | None = None, device=None, dtype=None):
        super().__init__()
        self.group: Group = as_group(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ConfigurationError(
                    f"padding_idx={padding_idx} is outside the vocabulary of {num_embeddings}")
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        self.padded_vocab = padded_vocab_size(num_embeddings, self.group.size)
        self.vocab_start, self.vocab_end = vocab_range(
            self.padded_vocab, self.group.rank, self.group.size)
        self.weight = nn.Parameter(torch.empty(
            self.vocab_end - self.vocab_start, embedding_dim, device=device, dtype=dtype))
        if not self.weight.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Embedding``'s initialization of the full table, keeping this rank's rows."""
        w = self.weight
        full = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx,
                            device=w.device, dtype=w.dtype)
        self._load_full(full)

    def _load_full(self, full: nn.Embedding) -> None:
        start, end = self.vocab_start, min(self.vocab_end, self.num_embeddings)
        shard = torch.zeros(self.vocab_end - self.vocab_start, self.embedding_dim,
                            device=full.weight.device, dtype=full.weight.dtype)
        if end > start:
            shard[: end - start] = full.weight.detach()[start:end]
        self.weight = nn.Parameter(shard, requires_grad=full.weight.requires_grad)

    @classmethod
    def from_full(cls, module: nn.Embedding, group) -> VocabParallelEmbedding:
        """This rank's rows of ``module`` (an ``nn.Embedding``), zero-padded, as a copy."""
        if not isinstance(module, nn.Embedding):
            raise ConfigurationError(
                f"VocabParallelEmbedding.from_full needs an nn.Embedding, "
                f"got {type(module).__name__}")
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ConfigurationError(
                "VocabParallelEmbedding does not support max_norm, scale_grad_by_freq "
                "or sparse embeddings",
                fix="keep this embedding replicated, or drop those options")
        layer = cls(module.num_embeddings, module.embedding_dim, group=group,
                    padding_idx=module.padding_idx, device="meta", dtype=module.weight.dtype)
        layer._load_full(module)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.num_embeddings, "VocabParallelEmbedding")
        rows = vocab_lookup(self.weight, ids, self.vocab_start, self.vocab_end, self.padding_idx)
        return reduce_from_region(rows, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, padded_vocab={self.padded_vocab}, "
                f"rows=[{self.vocab_start}, {self.vocab_end}), tp={self.group.size}")


def vocab_lookup(weight: torch.Tensor, ids: torch.Tensor, start: int, end: int,
                 padding_idx: int | None = None) -> torch.Tensor:
    """The rows of ``ids`` that this rank owns (``[start, end)``), zeros for the others.

    ``weight`` holds rows ``start..end-1``. The output is partial: summed over
    the ranks it is ``nn.Embedding``'s. The row of ``padding_idx`` (a full
    vocabulary id) is looked up as any other and gets no gradient, on the
    rank that owns it.
    """
    outside = (ids < start) | (ids >= end)
    local = (ids - start).masked_fill(outside, 0)
    local_pad = padding_idx - start if padding_idx is not None and start <= padding_idx < end \
        else None
    rows = F.embedding(local, weight, local_pad)
    return rows.masked_fill(outside.unsqueeze(-1), 0.0)


def check_ids(ids: torch.Tensor, num: int, who: str, ignore_index: int | None = None) -> None:
    """Raise if an id is outside ``[0, num)`` (``ignore_index`` allowed).

    A sharded lookup would otherwise turn a bad id into a silent zero. Costs
    one reduction and one host sync; skipped on meta and fake tensors (they
    have no values) and while compiling or exporting.
    """
    if torch.compiler.is_dynamo_compiling() or ids.is_meta or is_fake(ids) or ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= num)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if bool(bad.any()):
        first = ids[bad][0].item()
        raise ConfigurationError(
            f"{who}: id {first} is outside the vocabulary [0, {num})",
            fix="check the tokenizer / targets; padded vocabulary rows are not valid ids")
