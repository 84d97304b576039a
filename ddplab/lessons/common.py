"""The toy models and batches the lab's rank programs share.

Teaches: a fair comparison of gradient synchronizations needs the same model, the same
initial weights and the same data on every run. Each net here is seeded, and each rank's
batch is drawn from a generator seeded by (step, rank) on the CPU, so the numbers are the
same whatever device the rank trains on, and one process can rebuild the union of every
rank's batch to train the single-process reference.

Leaves out: real data and real models; ``ddplab.measure.models`` holds the sized MLP and
conv net that the timing comparisons use.
"""
from __future__ import annotations

import torch
from torch import nn

from ddplab.pg.backend import device


def tiny_net(seed=0, dtype=torch.float64):
    """A 8 -> 32 -> 32 -> 4 tanh net on the rank's device (float64: exact comparisons)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4)).to(dtype=dtype, device=device())


def tiny_batch(rank, step, batch=16, dtype=torch.float64):
    """Rank ``rank``'s batch at ``step`` for ``tiny_net``, on the rank's device."""
    # Drawn on the CPU (the same numbers on every device), then moved to the rank's device.
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(batch, 8, generator=g, dtype=dtype), torch.randn(batch, 4, generator=g, dtype=dtype)
    return x.to(device()), y.to(device())


def wide_net(seed=0, width=64, depth=4, dtype=torch.float32):
    """A 16 -> width x (depth - 1) -> 4 tanh net on the CPU (callers move it)."""
    torch.manual_seed(seed)
    layers = [nn.Linear(16, width), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 4)).to(dtype)


def wide_batch(rank, step=0, n=32, dtype=torch.float32, on=None):
    """Rank ``rank``'s batch for ``wide_net``; on the CPU unless ``on`` names a device."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    # drawn in float32 whatever ``dtype``: the float64 reference must see the same numbers
    x, y = torch.randn(n, 16, generator=g).to(dtype), torch.randn(n, 4, generator=g).to(dtype)
    return (x, y) if on is None else (x.to(on), y.to(on))
