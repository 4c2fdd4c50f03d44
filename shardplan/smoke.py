"""Smoke run: plan the bundled GPT, train it a few steps at tp=2 on gloo, compare.

    python -m shardplan.smoke

Prints the layout report, then the loss of each step sharded (two real gloo
processes) and unsharded; exits non-zero if they differ.
"""

from __future__ import annotations

import copy
import sys

import torch

import shardplan
from shardplan.models import build
from shardplan.ranks import RealRanks

STEPS, TP = 5, 2


def _data(vocab: int):
    """One fixed batch, every step: the loss falls as the model memorizes it."""
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, vocab, (4, 16), generator=g),
             torch.randint(0, vocab, (4, 16), generator=g))
    return [batch] * STEPS


def _model():
    torch.manual_seed(0)
    return build("gpt-tiny")


def _train(model, data) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in data:
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _rank(ctx):
    model = _model()
    data = _data(model.config.vocab_size)
    sharded = shardplan.parallelize(model, group=ctx.group, example_inputs=data[0])
    return _train(sharded, data)


def main() -> int:
    model = _model()
    print(shardplan.plan(model, TP, example_inputs=_data(model.config.vocab_size)[0]).report())
    with RealRanks(TP) as ranks:
        sharded = ranks.run(_rank)[0]
    unsharded = _train(copy.deepcopy(model), _data(model.config.vocab_size))
    print(f"\n{'step':>4} {'tp=2 loss':>12} {'unsharded':>12}")
    for i, (a, b) in enumerate(zip(sharded, unsharded)):
        print(f"{i:4} {a:12.6f} {b:12.6f}")
    ok = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(sharded, unsharded))
    print("\nsharded == unsharded:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
