"""The tensor-parallel runtime: collectives, f/g mappings, parallel layers, loss, RNG."""

from .comm import Group, P2POp, ThreadGroup, TorchGroup, as_group
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                     padded_vocab_size, vocab_range)
from .ledger import CommLedger, CommRecord
from .loss import vocab_parallel_cross_entropy
from .mappings import (copy_to_region, f, g, gather_from_region, gather_from_sequence,
                       reduce_from_region, reduce_scatter_to_sequence, scatter_to_region)
from .random import (RNGTracker, get_rng_tracker, manual_seed, model_parallel_seed,
                     set_rng_tracker)

__all__ = [
    "Group", "P2POp", "ThreadGroup", "TorchGroup", "as_group",
    "CommLedger", "CommRecord",
    "copy_to_region", "reduce_from_region", "scatter_to_region", "gather_from_region",
    "gather_from_sequence", "reduce_scatter_to_sequence", "f", "g",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "padded_vocab_size", "vocab_range",
    "vocab_parallel_cross_entropy",
    "RNGTracker", "manual_seed", "model_parallel_seed", "get_rng_tracker", "set_rng_tracker",
]
