"""The model a command's TARGET names: a bundled preset, an import string
``package.module:factory`` or a Hugging Face ``config.json`` (``shardplan plan``,
``verify`` and ``generate`` share it)."""

from __future__ import annotations

import contextlib
import json
import sys

import torch
import torch.nn as nn

from .errors import TargetError
from .models import PRESETS
from .models.factory import call_factory, import_factory


def build_target(target: str, *, meta: bool) -> nn.Module:
    """The model TARGET names; on the meta device (no memory) when ``meta`` and possible."""
    if target in PRESETS:
        from .models import build
        return build(target, device="meta" if meta else None)
    if target.endswith(".json"):
        return _hf_model(target, meta=meta)
    if ":" not in target:
        raise TargetError(f"unknown target {target!r}: not a bundled preset "
                          f"({', '.join(PRESETS)}) nor an import string package.module:factory")
    factory = import_factory(target)
    if meta:
        try:
            with torch.device("meta"):
                model = factory()
            if isinstance(model, nn.Module):
                return model
        except Exception as e:  # some factories cannot build on meta: try for real
            print(f"shardplan: note: {target}() failed on the meta device "
                  f"({type(e).__name__}: {e}); building it on the CPU", file=sys.stderr)
    return call_factory(target, factory)


def _hf_model(path: str, *, meta: bool) -> nn.Module:
    """The model class a Hugging Face config.json names, with random weights."""
    try:
        import transformers
    except ImportError:
        raise TargetError(f"{path}: Hugging Face targets need transformers: "
                          "pip install -e '.[hf]'") from None
    try:
        with open(path) as f:
            fields = json.load(f)
        config = transformers.AutoConfig.for_model(**fields)
    except (OSError, ValueError, KeyError) as e:
        raise TargetError(f"cannot read a Hugging Face config from {path}: {e}") from e
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise TargetError(f"{path} names no model class transformers knows "
                          f"(architectures: {arch!r})")
    with torch.device("meta") if meta else contextlib.nullcontext():
        return cls(config)
