"""Checkpoints of a parallelized model, through torch DCP (``torch.distributed.checkpoint``).

One format, a DCP directory in the unsharded model's key space, written from
any mesh (tp, dp_shard, dp_replicate, FSDP2 or not) and read into any other;
Hugging Face folders in and out through DCP's HF storage.

    save(sharded, "ck/step100", optimizer=opt, extra={"step": 100})
    pending = async_save(sharded, "ck/step200", optimizer=opt); ...; pending.wait()
    extra = load(sharded, "ck/step100", optimizer=opt)
    load_full_state_dict(sharded, "hf_folder/")        # each rank reads only its slices
    sharded = load_pretrained("hf_folder/")            # HF config + weights -> sharded model
    save_hf(sharded, "out/")                           # from_pretrained("out/") loads it
    export_hf("ck/step100", "out/", config="hf_folder/")   # offline, one process
    full = gather_full_state_dict(sharded)             # dict on rank 0, None elsewhere
    with parameters_on_meta(): model = MyModel()       # to parallelize, then load into

Every function but ``export_hf`` is collective. A save at more than one rank
needs torch.distributed (real ranks); simulated ranks (threads) only load.
"""

from .dcp import OLD_FORMAT, PendingSave, async_save, load, save
from .empty import parameters_on_meta
from .hf import export_hf, gather_full_state_dict, load_full_state_dict, load_pretrained, save_hf

__all__ = ["save", "async_save", "load", "PendingSave", "OLD_FORMAT", "load_full_state_dict",
           "gather_full_state_dict", "save_hf", "export_hf", "load_pretrained",
           "parameters_on_meta"]
