"""Small models and workloads for experiments: an MLP family sized by parameter count,
a small conv net with BatchNorm and a small GPT-style transformer
(``ddplab.measure.transformer``).

Teaches: what changes DDP's cost. Communication scales with the number of
PARAMETERS (every gradient is all-reduced once per step), never with the
batch size; compute scales with both. So the MLP family is sized by a
parameter budget, and the batch size is a separate knob.

Every rank builds the same model from the same seed, and draws its OWN
batch from a seed that includes its rank: data parallelism in one line.

Leaves out: real datasets (nothing is downloaded), DistributedSampler (the
labs show what it does with a dataset that does not divide evenly).
"""
from __future__ import annotations

import math

import torch
from torch import nn


def mlp(n_params: float = 2e6, depth: int = 4, d_in: int = 64, d_out: int = 10) -> nn.Sequential:
    """An MLP with ``depth`` Linear layers and about ``n_params`` parameters.

    Hidden width h solves d_in*h + (depth-2)*h*h + h*d_out ~= n_params.
    """
    if depth < 2:
        raise ValueError("depth must be >= 2 (input and output layers)")
    if not n_params > 0:
        raise ValueError(f"n_params must be > 0, got {n_params!r}")
    a, b, c = depth - 2, d_in + d_out + depth, -float(n_params)
    h = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a) if a else -c / b
    h = max(4, int(h))
    layers: list[nn.Module] = [nn.Linear(d_in, h), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(h, h), nn.ReLU()]
    layers.append(nn.Linear(h, d_out))
    return nn.Sequential(*layers)


class SmallConvNet(nn.Module):
    """Two conv blocks with BatchNorm (a buffer DDP broadcasts) and a linear head."""

    def __init__(self, channels: int = 16, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels),
            nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Linear(2 * channels * 16, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def build(name: str = "mlp", seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank
    if name == "mlp":
        return mlp(**kwargs)
    if name == "convnet":
        return SmallConvNet(**kwargs)
    if name == "transformer":
        from ddplab.measure.transformer import TinyGPT

        return TinyGPT(**kwargs)
    raise ValueError(f"unknown model {name!r}: use 'mlp', 'convnet' or 'transformer'")


def batch(model_name: str, batch_size: int, rank: int, step: int, d_in: int = 64,
          classes: int = 10, seed: int = 1234):
    """This rank's batch for this step: (inputs, integer labels)."""
    if model_name == "transformer":
        from ddplab.measure.transformer import batch as token_batch

        return token_batch(batch_size, rank, step, seed=seed)
    g = torch.Generator().manual_seed(seed + 100003 * step + rank)
    if model_name == "convnet":
        x = torch.randn(batch_size, 3, 16, 16, generator=g)
    else:
        x = torch.randn(batch_size, d_in, generator=g)
    y = torch.randint(0, classes, (batch_size,), generator=g)
    return x, y


def n_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
