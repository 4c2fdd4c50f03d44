"""A Hugging Face causal LM from its folder, sharded over this rank's group in one call."""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from .empty import parameters_on_meta
from .hf import load_full_state_dict


def load_pretrained(path, *, group=None, weights=None, example_inputs=None):
    """The ``save_pretrained`` model at ``path`` (config.json + weights), parallelized.

    Built from the config with its parameters on meta (buffers the checkpoint
    does not hold, such as Llama's rotary ``inv_freq``, are computed as the
    constructor computes them), parallelized over ``group`` (default: the
    world), then each rank loads only its slices of ``weights`` (default
    ``path``: one file or an index of several). Collective; returns the
    ``ShardedModule`` in eval mode. ``example_inputs`` (default a (2, 4) batch of
    ``input_ids``): the call signature to capture first.
    """
    import transformers
    from ..api import parallelize
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"no Hugging Face config in {path}: {e}", where=str(path),
                              fix="pass a folder written by save_pretrained") from None
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.eval()
    example = example_inputs or {"input_ids": torch.zeros(2, 4, dtype=torch.long)}
    sharded = parallelize(model, group=group, example_inputs=example, check_model=False)
    load_full_state_dict(sharded, path if weights is None else weights)
    return sharded.eval()
