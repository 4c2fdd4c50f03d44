"""The rule kinds a rule file may list ops under, by name.

Each module of this package defines kinds and registers them with
``@register``; all are imported here, so a new kind is a new file.
"""

import importlib
import pkgutil

from .base import KINDS, Conflict, Context, Kind, Outcome, Role, register

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["KINDS", "Conflict", "Context", "Kind", "Outcome", "Role", "register"]
