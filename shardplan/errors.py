"""Every error shardplan raises on purpose derives from ``ShardplanError``.

A message says what went wrong, where (module or graph node, and the user's
source line when known) and how to fix it.
"""

from __future__ import annotations


class ShardplanError(Exception):
    """Base of shardplan's errors."""

    def __init__(self, what: str, *, where: str | None = None,
                 source: str | None = None, fix: str | None = None):
        self.what, self.where, self.source, self.fix = what, where, source, fix
        parts = [what]
        if where:
            parts.append(f"  where: {where}")
        if source:
            parts.append(f"  source: {source}")
        if fix:
            parts.append(f"  fix: {fix}")
        super().__init__("\n".join(parts))


class ConfigurationError(ShardplanError):
    """Bad arguments or environment: tp, process groups, devices, dtypes."""


class TargetError(ConfigurationError):
    """A model name (CLI TARGET, ``--model``) that names nothing shardplan can build."""


class CaptureError(ShardplanError):
    """The model could not be captured as a graph."""


class LayoutError(ShardplanError):
    """No correct layout exists, or one the rules cannot place (strict mode)."""


class DivisibilityError(LayoutError):
    """A dimension that must be split does not divide by tp."""


class RuleError(ShardplanError):
    """A rule file that does not parse or does not make sense."""


class CommunicationError(ShardplanError):
    """A collective failed, timed out, or ranks disagree."""


class CheckpointError(ShardplanError):
    """A checkpoint that cannot be read, written or matched to the model."""


class NonFiniteError(ShardplanError):
    """A NaN or inf loss or gradient norm in training (``--on-nonfinite stop``)."""


class UnsupportedDecode(ConfigurationError):
    """A model with no cached decode step (``shardplan.kvcache``); ``generate`` then
    recomputes the prefix for every token instead, and warns with this reason."""
