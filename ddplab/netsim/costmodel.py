"""The alpha-beta cost model, fitted to REAL all-reduces, and step-time predictions.

Teaches: a model you can check. Measure all-reduce times over a range of
sizes on the real backend, fit ``t = a + b * n`` by least squares, and read
``a`` as the fixed cost per all-reduce and ``1 / b`` as the effective
bandwidth. For a ring over p ranks, a = 2(p-1)*alpha and
b = 2(p-1)/p / bandwidth, so alpha and bandwidth come out of the fit. On 2
CPU cores gloo's "link" is memory copies and thread hand-offs, so the fitted
numbers describe this machine, not a network.

Then predict a step: buckets become ready at measured times during backward,
each launches when it and every earlier bucket are ready (torch's order
rule), and transfers queue on one link. Prediction vs measurement is the
exercise: where they disagree, something the model ignores is happening
(compute and communication sharing cores, for one).

Leaves out: overlap slowing compute down, multiple links, protocol switches.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from ddplab.netsim.link import LinkModel, LinkQueue


@dataclass(frozen=True)
class Fit:
    world_size: int
    fixed_s: float  # a: cost of one all-reduce of nothing
    per_byte_s: float  # b
    r2: float

    @property
    def alpha_us(self) -> float:
        return 1e6 * self.fixed_s / (2 * (self.world_size - 1))

    @property
    def bandwidth_gbps(self) -> float:
        p = self.world_size
        return 8 * (2 * (p - 1) / p) / self.per_byte_s / 1e9 if self.per_byte_s > 0 else float("inf")

    def as_link(self) -> LinkModel:
        return LinkModel(self.bandwidth_gbps, max(0.0, self.alpha_us), f"fitted gloo, {self.world_size} ranks")

    def predict(self, nbytes: int) -> float:
        return self.fixed_s + self.per_byte_s * nbytes


def fit(sizes_bytes, seconds, world_size: int) -> Fit:
    """Least-squares line through (bytes, seconds)."""
    xs, ys = list(map(float, sizes_bytes)), list(map(float, seconds))
    if len(xs) < 2 or len(set(xs)) < 2:
        raise ValueError("need all-reduce timings for at least two different sizes to fit a line")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys) or 1e-30
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys))
    return Fit(world_size, a, b, 1 - ss_res / ss_tot)


def measure_allreduce(sizes_bytes=(2**12, 2**16, 2**18, 2**20, 2**22, 2**23), repeats: int = 7,
                      group=None, warmup: int = 1) -> dict:
    """Run on EVERY rank: median seconds of a blocking all-reduce per size, after ``warmup``
    untimed ones of each size.

    The repeats go round the sizes (every size once, then again), so that a burst of other
    load on the machine falls on every size alike instead of on the sizes timed during it.
    On NCCL ranks the tensors live on the rank's GPU (what its gradients use) and
    the host waits for the GPU, since a "blocking" NCCL all-reduce only blocks the
    stream, not the host."""
    import torch
    import torch.distributed as dist

    from ddplab.contracts.clock import now
    from ddplab.pg.backend import device

    where = device(group)
    settle = torch.cuda.synchronize if where.type == "cuda" else (lambda: None)
    tensors = [torch.ones(max(1, n // 4), dtype=torch.float32, device=where) for n in sizes_bytes]
    for t in tensors:
        for _ in range(warmup):  # warm the connection and buffers
            dist.all_reduce(t, group=group)
    times = [[] for _ in tensors]
    for _ in range(repeats):
        for t, took in zip(tensors, times):
            dist.barrier(group=group)
            settle()
            t0 = now()
            dist.all_reduce(t, group=group)
            settle()
            took.append(now() - t0)
    return {int(t.numel() * 4): statistics.median(took) for t, took in zip(tensors, times)}


def predict_step(compute_step_s: float, backward_end_s: float, bucket_ready_s, bucket_bytes,
                 link: LinkModel, world_size: int) -> dict:
    """Predicted step time for a bucket layout on ``link``.

    ``bucket_ready_s[i]``: when bucket i's last gradient is ready, in seconds
    from the step's start; ``backward_end_s``: when backward ends; the compute
    part of the step is ``compute_step_s``.
    """
    q = LinkQueue(link, world_size)
    launch_floor, ends = 0.0, []
    for ready, n in zip(bucket_ready_s, bucket_bytes):
        launch = max(ready, launch_floor)  # index order: never before an earlier bucket
        launch_floor = launch
        ends.append(q.schedule(launch, n)[1])
    exposed = max(0.0, max(ends, default=0.0) - backward_end_s)
    return {"step_s": compute_step_s + exposed, "exposed_comm_s": exposed, "comm_end_s": ends}
