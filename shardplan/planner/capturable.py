"""Capturable forms of modules whose own forward export cannot capture.

DBRX's experts loop over the experts a batch hits (``nonzero``, then Python
control flow on its length), with no Hugging Face switch to another
implementation. While capturing, such a module runs a form computing the same
function of the same parameters without data-dependent control flow: each
(token, chosen expert) pair gathers its expert's weights and runs ``bmm``, as
Hugging Face's ``batched_mm`` experts do. The model itself is unchanged.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn as nn


def _dbrx_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """``DbrxExperts.forward``: weights ``(E * F, H)``, each expert's ``F`` rows in turn."""
    batch, h = hidden_states.shape[0], self.hidden_size
    k = top_k_index.shape[-1]
    x = hidden_states.reshape(-1, h)
    ids = top_k_index.reshape(-1)  # (tokens * k,) in token order
    rows = torch.arange(ids.shape[0], device=x.device) // k  # each pair's token

    def chosen(w: torch.Tensor) -> torch.Tensor:  # each pair's expert's (F, H) block
        return w.view(self.num_experts, -1, h)[ids]

    def project(w: torch.Tensor) -> torch.Tensor:  # (pairs, F); each its own token gather,
        return torch.bmm(chosen(w), x[rows][..., None]).squeeze(-1)  # so f moves onto x
    mlp = self.mlp
    inner = mlp.activation_fn(project(mlp.w1)) * project(mlp.v1)
    out = torch.bmm(inner[:, None, :], chosen(mlp.w2)).squeeze(1)  # (pairs, H)
    out = out * top_k_weights.reshape(-1, 1)
    return out.view(-1, k, h).sum(1).view(batch, -1, h)


#: module class name -> its capturable forward
FORMS = {"DbrxExperts": _dbrx_experts}


@contextlib.contextmanager
def capturable(model: nn.Module):
    """``model``'s modules that have a form in ``FORMS`` run it while in this block."""
    swapped = [m for m in model.modules() if type(m).__name__ in FORMS]
    for m in swapped:
        m.forward = types.MethodType(FORMS[type(m).__name__], m)
    try:
        yield
    finally:
        for m in swapped:
            del m.forward
