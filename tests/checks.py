"""The checks the tests share, so that tests/test_mutations.py can prove they bite.

- ``assert_equivalent``: every rank's outputs and loss, every copy of every
  gradient (each rank's replica of a replicated parameter, each member of a K/V
  replica group) against the unsharded model;
- ``full_gradient``: a parameter's full gradient, after checking that every
  member of each replica group holds the same shard;
- ``megatron_count`` / ``assert_megatron_ledger``: the collectives Megatron-LM
  issues for a decoder LM, computed from the model's structure alone, against
  what a rank recorded.
"""

from __future__ import annotations

from collections import Counter

import torch

from shardplan.layouts import Shard
from shardplan.verify import every_copy

ATOL, RTOL = 2e-5, 1e-4


def full_gradient(lay, parts: list[torch.Tensor], shape, name: str = "") -> torch.Tensor:
    """The full tensor from every rank's part; raises if the copies of it disagree.

    A replicated tensor must be bit-identical on every rank (replicas that drift
    apart are the silent bug). A shard held by replica groups
    (``Shard(..., replicas=r)``) must be bit-identical within each group.
    """
    if not isinstance(lay, Shard):
        for r, p in enumerate(parts[1:], 1):
            assert torch.equal(p, parts[0]), f"{name}: rank {r}'s replica differs from rank 0's"
        return parts[0]
    tp = len(parts)
    sizes = lay.local_blocks(tp) if lay.blocks else (parts[0].shape[lay.dim],)
    pieces = [p.split(list(sizes), lay.dim) for p in parts]  # a count of ranks per block
    for i, r in enumerate(lay.block_replicas()):
        for start in range(0, tp, r):
            for j in range(start + 1, start + r):
                assert torch.equal(pieces[j][i], pieces[start][i]), \
                    f"{name}: rank {j} differs from rank {start} in their replica group"
    return lay.unshard(parts, shape[lay.dim])


def assert_grads(layouts: dict, per_rank_grads: list[dict], ref_grads: dict,
                 atol: float = ATOL, rtol: float = RTOL) -> None:
    """Every copy of every gradient on every rank against the unsharded gradients."""
    for name, g in ref_grads.items():
        parts = [grads[name] for grads in per_rank_grads]
        lay = layouts[name]
        full_gradient(lay, parts, g.shape, name)
        for where, full in every_copy(lay, parts, g.shape):
            torch.testing.assert_close(full, g, atol=atol, rtol=rtol, msg=f"{name}{where}")


def assert_equivalent(results, ref, atol: float = ATOL, rtol: float = RTOL) -> None:
    """``results[r] = (outputs, loss, grads, layouts, ...)`` of every rank vs
    ``ref = (outputs, loss, grads)`` of the unsharded model."""
    logits, loss, grads = ref
    for rank, r in enumerate(results):
        torch.testing.assert_close(r[0], logits, atol=atol, rtol=rtol, msg=f"outputs, rank {rank}")
        torch.testing.assert_close(r[1], loss, atol=atol, rtol=rtol, msg=f"loss, rank {rank}")
    assert_grads(results[0][3], [r[2] for r in results], grads, atol, rtol)


def megatron_count(layers: int, b: int, s: int, h: int, *, recompute: bool = False,
                   loss: bool = True, gathered_vocab: int = 0,
                   kv_weight: int = 0) -> dict[str, Counter]:
    """Megatron-LM's collectives for one step of a decoder LM with a vocabulary-parallel
    embedding and LM head, as ``{direction: Counter((kind, elements))}``.

    Forward: per layer g after attention and after the MLP (b*s*h each), the
    embedding's g (b*s*h), and the vocabulary-parallel loss's all-reduces of the
    max, the target logit and the sum of exps (b*s each).
    Backward: per layer f before attention and before the MLP (b*s*h each), and
    the LM head's f (b*s*h). Recomputation re-runs each block's forward in the
    backward pass as far as its last saved activation: the attention's g again
    (its output feeds the second norm, which saves it), not the MLP's (the block's
    output; torch's checkpoint stops early). The re-run g is a forward all-reduce.
    """
    fwd = Counter({("all_reduce", b * s * h): 2 * layers + 1 + (layers if recompute else 0)})
    if loss:
        fwd[("all_reduce", b * s)] += 3
    if gathered_vocab:
        fwd[("all_gather", b * s * gathered_vocab)] += 1
    bwd = Counter({("all_reduce", b * s * h): 2 * layers + 1})
    if kv_weight:
        bwd[("all_reduce", kv_weight)] += 2 * layers
    return {"forward": fwd, "backward": bwd}


def decode_calls(records, batch: int) -> list[list[tuple]]:
    """A generation's ``(kind, elements)`` records split into its model calls: each call
    ends with the broadcast of its batch of tokens (asserted); nothing may follow the last."""
    calls, current = [], []
    for kind, elements in records:
        if kind == "broadcast":
            assert elements == batch
            calls.append(current)
            current = []
        else:
            current.append((kind, elements))
    assert not current, current
    return calls


def ledger_count(records) -> dict[str, Counter]:
    """The same shape as ``megatron_count`` from a rank's ``CommRecord``s."""
    out = {"forward": Counter(), "backward": Counter()}
    for r in records:
        out[r.direction if r.direction in out else "forward"][(r.kind, r.elements)] += 1
    return out


def assert_megatron_ledger(per_rank_records, want: dict[str, Counter], tp: int) -> None:
    """Every rank recorded exactly ``want``, every collective over the whole TP group."""
    for rank, records in enumerate(per_rank_records):
        assert ledger_count(records) == want, f"rank {rank}: {ledger_count(records)} != {want}"
        assert all(r.group_size == tp for r in records), rank


POSITIONS = ("wpe", "pos")  # position embeddings: replicated
ROW_PARALLEL = ("c_proj", "wo", "w2", "down", "o_proj", "down_proj")  # read a region's output


def assert_megatron_layouts(model: torch.nn.Module, layouts: dict, tp: int) -> None:
    """Every GEMM weight and the token embedding is split by Megatron's rule, found from
    the model's module types and names alone: out-projections on their input dim
    (row-parallel), every other linear and the embedding on dim 0. Norm weights stay
    replicated."""
    if tp == 1:
        return
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
            name = f"{mod_name}.weight"
            if name not in layouts or mod_name.rsplit(".", 1)[-1] in POSITIONS:
                continue
            row = mod_name.rsplit(".", 1)[-1] in ROW_PARALLEL
            want = 1 if row and isinstance(mod, torch.nn.Linear) else 0
            lay = layouts[name]
            assert isinstance(lay, Shard) and lay.dim in (want, want - 2), \
                f"{name} should be split on dim {want} at tp={tp}, is {lay}"
        elif isinstance(mod, (torch.nn.LayerNorm, torch.nn.RMSNorm)) and mod.weight is not None:
            assert not isinstance(layouts[f"{mod_name}.weight"], Shard), mod_name


def assert_megatron_plan(model: torch.nn.Module, plan, prefix: str = "") -> None:
    """``assert_megatron_layouts`` on a ``Plan``'s layout strings, for the modules under
    ``prefix`` (e.g. ``"blocks."``: every GEMM the fuzzer placed in a region)."""
    if plan.tp == 1:
        return
    for mod_name, mod in model.named_modules():
        if not mod_name.startswith(prefix) or not isinstance(mod, torch.nn.Linear):
            continue
        want = 1 if mod_name.rsplit(".", 1)[-1] in ROW_PARALLEL else 0
        lay = plan.param(f"{mod_name}.weight").layout
        assert lay.startswith(f"S({want}"), \
            f"{mod_name}.weight should be split on dim {want} at tp={plan.tp}, is {lay}"
