"""Claims that hold only under a condition, checked on live ranks both ways.

Teaches, one function per claim, each run with its condition met and broken:
- ``loss_vs_single_process``: the mean of the ranks' losses is the loss one
  process computes on all their data, *when every rank's batch has the same
  size* (a mean of means); with unequal batches it is not.
- ``no_sync_vs_one_batch``: ``no_sync`` accumulation over K micro-batches gives
  the gradient of one large batch *when each micro-batch's loss is divided by
  K*; without the division the gradient is K times too large.
- ``many_small_vs_one_on_rank``: the same bytes in many small all-reduces take
  longer than in one: each call pays a fixed cost (why tiny buckets are slow).
- ``wait_returns_before_done_on_rank``: after ``work.wait()`` the host may go on
  while the all-reduce still runs: true under NCCL (the wait only orders the
  GPU stream, so ``optimizer.step()``'s kernels queue behind the all-reduce),
  false under gloo (the host waits until the result is there).

Leaves out: everything torch DDP does beyond these points (it is the model
under test here, built with its defaults).

References: torch.nn.parallel.DistributedDataParallel.no_sync; c10d Work.wait
(ProcessGroupNCCL: "blocks the current stream on the NCCL stream").
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ddplab.lessons.common import tiny_batch, tiny_net
from ddplab.pg.backend import backend_name, device


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu()


def loss_on_rank(batch_sizes=None):
    """This rank's loss on its own batch (size ``batch_sizes[rank]``, 16 by default)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    batch = 16 if batch_sizes is None else batch_sizes[rank]
    x, y = tiny_batch(rank, 0, batch)
    return F.mse_loss(tiny_net()(x), y).item()


def loss_vs_single_process(cluster, batch_sizes=None) -> dict:
    """Mean of the per-rank losses next to one process's loss on every rank's batch."""
    n = cluster.world_size
    sizes = batch_sizes or [16] * n
    per_rank = cluster.run(loss_on_rank, sizes)
    xs, ys = zip(*(tiny_batch(r, 0, sizes[r]) for r in range(n)))
    single = F.mse_loss(tiny_net()(torch.cat(xs)), torch.cat(ys)).item()
    mean = sum(per_rank) / n
    return {"per_rank": per_rank, "mean_of_ranks": mean, "single_process": single,
            "gap": abs(mean - single), "batch_sizes": sizes}


def no_sync_on_rank(micro_steps=4, divide=True):
    """One accumulated step of torch DDP under no_sync; its gradient vs one process's."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = device()
    model = DDP(tiny_net().to(dev))
    for k in range(micro_steps):
        x, y = (t.to(dev) for t in tiny_batch(rank, k))
        quiet = model.no_sync() if k < micro_steps - 1 else contextlib.nullcontext()
        with quiet:  # forward AND backward inside: torch decides at forward time
            loss = F.mse_loss(model(x), y)
            (loss / micro_steps if divide else loss).backward()
    reference = tiny_net()  # one process, one batch holding every rank's micro-batches
    xs, ys = zip(*(tiny_batch(r, k) for r in range(world) for k in range(micro_steps)))
    F.mse_loss(reference(torch.cat(xs)), torch.cat(ys)).backward()
    mine, ref = _grads(model.module), _grads(reference)
    return {"gap": (mine - ref).abs().max().item(), "ratio": (mine.norm() / ref.norm()).item()}


def no_sync_vs_one_batch(cluster, micro_steps=4) -> dict:
    """{True: ..., False: ...} for dividing the loss by ``micro_steps`` or not (worst rank)."""
    out = {}
    for divide in (True, False):
        per_rank = cluster.run(no_sync_on_rank, micro_steps, divide)
        out[divide] = {"gap": max(r["gap"] for r in per_rank),
                       "ratio": per_rank[0]["ratio"]}
    return out


def wait_returns_before_done_on_rank(busy_matmuls=20):
    """After ``all_reduce(...).wait()``, is the work already complete?

    On a GPU the stream is kept busy with matmuls first, so that an all-reduce
    queued behind them cannot have run yet when the host returns from wait().
    """
    import torch.distributed as dist

    dev = device()
    t = torch.ones(2**20, device=dev)
    if dev.type == "cuda":
        a = torch.randn(4096, 4096, device=dev)
        for _ in range(busy_matmuls):
            a = a @ a / 4096  # queued on the stream; the host does not wait for them
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    done_after_wait = work.is_completed()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return {"backend": backend_name(), "done_after_wait": done_after_wait,
            "done_after_sync": work.is_completed()}


def many_small_vs_one_on_rank(total_bytes=2**22, n_calls=256, repeats=3):
    """Seconds to all-reduce ``total_bytes`` as one tensor and as ``n_calls`` small ones.

    The same bytes either way: what differs is the fixed cost every call pays
    (latency, and the library's own work per call), which tiny buckets pay often.
    Median of ``repeats``; the ranks start each timing together.
    """
    import time

    import torch.distributed as dist

    dev = device()
    out = {}
    for k in (1, n_calls):
        tensors = [torch.ones(total_bytes // 4 // k, device=dev) for _ in range(k)]
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            for t in tensors:
                dist.all_reduce(t)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[k] = sorted(times)[len(times) // 2]
    return {"one_call_s": out[1], "many_calls_s": out[n_calls], "n_calls": n_calls,
            "total_bytes": total_bytes}
