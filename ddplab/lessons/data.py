"""Data under DDP: who reads which samples, in which order, and what the batch size means.

Teaches (lab 05), each measured on live ranks:

- ``DistributedSampler`` deals the indices of an epoch out to the ranks:
  disjoint shards when the length divides by the world size; otherwise it
  PADS with repeated indices from the start so every rank gets the same
  number of samples (or drops the tail with ``drop_last=True``);
- its shuffle is seeded by ``seed + epoch``: without ``set_epoch(e)`` every
  epoch repeats the same order;
- DDP averages gradients over ranks, so a step with ``b`` samples per rank on
  ``p`` ranks is a step on a global batch of ``p * b``: the learning rate
  belongs to the global batch (``same_step_as_one_process``).

Leaves out: ``DataLoader`` workers and prefetching, samplers for iterable
datasets, uneven last batches under DDP (``Join``).

References: torch/utils/data/distributed.py; Goyal et al., "Accurate, Large
Minibatch SGD" (2017) for the linear scaling rule.
"""
from __future__ import annotations


def sampler_indices(dataset_len: int, world_size: int, drop_last: bool = False) -> list:
    """The indices ``DistributedSampler(shuffle=False)`` hands each rank (no group needed)."""
    from torch.utils.data.distributed import DistributedSampler

    data = range(dataset_len)
    return [list(DistributedSampler(data, num_replicas=world_size, rank=r, shuffle=False,
                                    drop_last=drop_last)) for r in range(world_size)]


def shards_on_rank(dataset_len: int, epochs: int = 2, set_epoch: bool = True, seed: int = 0,
                   drop_last: bool = False) -> list:
    """Run on every rank: this rank's indices for each epoch, from the real process group."""
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(range(dataset_len), shuffle=True, seed=seed, drop_last=drop_last)
    out = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def describe_shards(per_rank: list, dataset_len: int) -> dict:
    """Counts for one epoch's shards (``per_rank[r]`` = rank r's indices)."""
    seen = [i for shard in per_rank for i in shard]
    return {"per_rank": [len(s) for s in per_rank], "total": len(seen),
            "distinct": len(set(seen)), "repeats": len(seen) - len(set(seen)),
            "missing": sorted(set(range(dataset_len)) - set(seen))}


def _linear_data(seed: int, n: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    return x, x @ torch.linspace(-1, 1, 8, dtype=torch.float64).unsqueeze(1)


def ddp_step_on_rank(per_rank_batch: int, lr: float) -> list:
    """Run on every rank: one SGD step of torch DDP on this rank's slice of a fixed global batch."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.pg.backend import device

    rank, p = dist.get_rank(), dist.get_world_size()
    x, y = (t.to(device()) for t in _linear_data(0, per_rank_batch * p))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1).double().to(device()))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    mine = slice(rank * per_rank_batch, (rank + 1) * per_rank_batch)
    torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    opt.step()
    return [t.detach().cpu().clone() for t in model.module.parameters()]


def one_process_step(batch: int, lr: float) -> list:
    """One SGD step in this process on the first ``batch`` samples of the same data."""
    import torch

    x, y = _linear_data(0, batch)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return [t.detach().clone() for t in model.parameters()]


def max_gap(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))
