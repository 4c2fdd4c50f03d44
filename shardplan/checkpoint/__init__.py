"""Checkpoints of a parallelized model: per-rank shards, offline resharding, full weights.

Tensors go in safetensors files, everything else in JSON; nothing is pickled.

A *sharded checkpoint* is a directory::

    path/index.json                       format, tp, per tensor its layout, global and
                                          local shape, dtype and aliases; the optimizer's
                                          param groups and state; the plan; ``extra``
    path/rank00000-of-00002.safetensors   rank 0's local tensors: ``model/<fqn>`` and
    path/rank00001-of-00002.safetensors   ``optim/<fqn>/<state>``; its ``extra`` in the header

Every rank writes its own file (replicated tensors included, so each file
loads alone). A save is atomic: all ranks write into ``.<name>.partial`` next
to ``path``, agree that every file is complete (fsynced), and only then rank 0
writes the index and swaps the directory into place, so a save that dies
halfway leaves the previous checkpoint as it was. The collectives in here are
tiny success flags: a rank that fails tells the others instead of leaving
them waiting in a barrier.

A *full checkpoint* is one ``.safetensors`` file of full, unpadded tensors
under the original model's names (a tied tensor stored once, as safetensors'
``save_model`` does), loadable by the unsharded model with
``safetensors.torch.load_model``.

    save_sharded(sharded, path, optimizer=opt, extra={"step": 100})
    extra = load_sharded(sharded, path, optimizer=opt)
    reshard(path, path_tp4, tp=4)                      # offline, one tensor at a time
    full = gather_full_state_dict(sharded)             # dict on rank 0, None elsewhere
    save_full(sharded, "model.safetensors")
    load_full_state_dict(sharded, "model.safetensors") # each rank reads only its slices
    load_full_state_dict(sharded, "hf_folder/")        # or several files via their index
    sharded = load_pretrained("hf_folder/")            # HF config + weights -> sharded model
    with parameters_on_meta(): model = MyModel()       # to parallelize, then load into

Every function except ``reshard`` is collective: call it on every rank.

One concern per module: ``files`` (safetensors IO), ``atomic`` (directories
replaced atomically, the index), ``agreement`` (failing on every rank
together), ``entries`` (the module's tensors with their specs), ``optimizer``,
``sharded`` (save/load per rank), ``resharding`` (offline, another tp),
``full`` (full state dicts), ``sources`` (one or many full-checkpoint files),
``empty`` (models built to be loaded) and ``pretrained`` (an HF folder in one call).
"""

from .dcp import load_dcp, save_dcp
from .empty import parameters_on_meta
from .full import gather_full_state_dict, load_full_state_dict, save_full
from .pretrained import load_pretrained
from .index import FORMAT, INDEX, VERSION, rank_file
from .resharding import reshard
from .sharded import load_sharded, save_sharded

__all__ = ["save_dcp", "load_dcp", "save_sharded", "load_sharded", "reshard",
           "gather_full_state_dict", "save_full", "load_full_state_dict", "load_pretrained",
           "parameters_on_meta", "rank_file", "FORMAT", "VERSION", "INDEX"]
