"""``package.module:factory`` import strings: the one resolver the CLI and the trainer share."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

from ..errors import TargetError


def import_factory(spec: str) -> Callable:
    """The callable ``spec`` names (``package.module:attr.path``).

    Modules in the working directory are importable, as under ``python -m``:
    ``shardplan plan mymodel:build`` and ``torchrun -m shardplan.train
    --model mymodel:build`` find the same ``mymodel.py``.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise TargetError(f"bad import string {spec!r}: expected package.module:factory")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:
        raise TargetError(f"cannot import {module_name!r} from {spec!r}: "
                          f"{type(e).__name__}: {e}",
                          fix="give package.module:factory, importable on every rank") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetError(f"{module_name!r} has no attribute {attr!r} "
                              f"(from {spec!r})") from None
    if not callable(obj):
        raise TargetError(f"{spec!r} is a {type(obj).__name__}, not a callable factory")
    return obj


def call_factory(spec: str, factory: Callable):
    """``factory()``, its errors reported as ``TargetError`` naming ``spec``; checks it built a module."""
    import torch.nn as nn
    try:
        model = factory()
    except Exception as e:
        raise TargetError(f"{spec}() raised {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise TargetError(f"{spec}() returned {type(model).__name__}, not a torch.nn.Module")
    return model
