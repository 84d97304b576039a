"""Putting every rank's stamps on one clock.

Teaches: stamps from different processes are only comparable after their
clocks are aligned. On one machine the ranks share CLOCK_MONOTONIC and the
offsets come out near zero, which is itself a check; across machines they do
not. The estimate: after a barrier every rank reads its clock; everybody
leaves a barrier at nearly the same moment, so rank r's reading minus rank 0's
estimates r's offset. Repeating it and taking the median tames noise, and the
spread of the estimates is reported as the bound: differences smaller than
the bound between ranks mean nothing.

Leaves out: NTP-style round-trip estimation and drift over long runs.
"""
from __future__ import annotations

import statistics

from ddplab.contracts.clock import now  # the one clock every stamp uses (re-exported here)

__all__ = ["now", "estimate_offsets", "offsets_from"]


def estimate_offsets(rounds: int = 9, group=None) -> dict:
    """Run on EVERY rank: ``{"offsets": {rank: seconds}, "bound_s": s}`` (rank 0 = 0)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    # a plain "nccl" group refuses CPU tensors: its readings travel on this rank's GPU
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    samples = []
    for _ in range(rounds):
        dist.barrier(group=group)
        t = torch.tensor([now()], dtype=torch.float64, device=on)
        gathered = [torch.zeros(1, dtype=torch.float64, device=on) for _ in range(world)]
        dist.all_gather(gathered, t, group=group)
        samples.append([g.item() - gathered[0].item() for g in gathered])
    return offsets_from(samples)


def offsets_from(samples: list) -> dict:
    """The estimate from rounds of readings: ``samples[i][r]`` is rank r's clock minus rank 0's
    in round i, read just after a barrier. The median per rank, and half the widest spread as
    the bound."""
    world = len(samples[0])
    offsets = {r: statistics.median(s[r] for s in samples) for r in range(world)}
    bound = max((max(s[r] for s in samples) - min(s[r] for s in samples)) / 2
                for r in range(world))
    return {"offsets": offsets, "bound_s": bound}
