"""shardplan: Megatron-LM tensor parallelism for plain PyTorch models, planned from the graph."""

from . import checkpoint # noqa: F401  (shardplan.checkpoint.save, ...)
from .api import parallelize
from .runtime.consistency import check_replicas
from .planner.plan import Plan, plan
from .verify import VerifyReport, verify
from .errors import (CaptureError, CheckpointError, CommunicationError, ConfigurationError,
                     DivisibilityError, LayoutError, NonFiniteError, RuleError,
                     ShardplanError)
from .layouts import Partial, Replicate, Shard

__all__ = [
    "parallelize", "plan", "Plan", "verify", "VerifyReport", "check_replicas",
    "Replicate", "Shard", "Partial",
    "ShardplanError", "CaptureError", "CheckpointError", "CommunicationError",
    "ConfigurationError", "DivisibilityError", "LayoutError", "NonFiniteError", "RuleError",
]
