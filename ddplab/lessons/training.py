"""Checks a learner runs in the labs: each answers one question by measuring it.

Teaches, one function per question:
- ``single_process_gap``: is a strategy really the same as training on one
  process with all the data? (max parameter difference after every step)
- ``loss_and_grads``: is the loss synchronized? (no: each rank's loss is its
  own; the GRADIENTS are what DDP makes equal)
- ``sync_order``: when exactly is the sync? (during backward, and finished
  before ``loss.backward()`` returns; ``optimizer.step()`` waits for nothing;
  on NCCL the host sees only when each all-reduce was "enqueued")
- ``traffic_by_batch_size``: does the batch size change the traffic? (no:
  every step all-reduces one gradient per parameter)
- ``no_sync_traffic``: what does ``no_sync`` save, and is the result the same?
- ``autocast_traffic``: does autocast shrink the all-reduce? (no: gradients
  of fp32 parameters stay fp32; compression is a comm hook's job)
- ``sampler_indices``: does DistributedSampler ever duplicate samples? (yes:
  it pads an uneven dataset by repeating indices unless drop_last=True)

Functions ending in ``_on_rank`` run on every rank (``cluster.run``); the
others take a Cluster and return plain numbers to check.

Leaves out: real datasets; everything here is small random data.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ddplab.lessons.common import tiny_batch, tiny_net
from ddplab.sync import comm
from ddplab.sync.registry import Strategy, build_strategy


def _wrap(strategy, model, bucket_cap_mb=0.001, recorder=None):
    """(model to train, after_backward or None) for a registered strategy name.

    The lessons use a tiny model, so a tiny cap (0.001 MB) gives several buckets.
    A wrapper class (``Cls`` or ``(Cls, *args)``, yours or ddplab's) wraps the
    model; a plain function is the learner's own, called after backward.
    """
    if isinstance(strategy, type):  # a wrapper class: Cls(module)
        strategy = (strategy,)
    if isinstance(strategy, tuple):  # (Cls, *args)
        cls, *args = strategy
        wrapped = cls(model, *args)
        return wrapped, getattr(wrapped, "finish_gradient_synchronization", None)
    if callable(strategy) and not isinstance(strategy, Strategy):  # the learner's own function
        return model, (lambda: strategy(model))
    built = build_strategy(strategy, model, bucket_cap_mb=bucket_cap_mb, recorder=recorder)
    return built.model, built.after_backward


def single_process_gap_on_rank(strategy="bucketed", steps=3, lr=0.1, sleep_on_rank=None):
    """Train ``strategy`` on this rank's data and, beside it, one model on ALL ranks' data.

    ``strategy``: a name, your own function ``f(model)`` called after backward, or a
    wrapper class ``Cls`` (``Cls(model)``) or ``(Cls, *args)`` (``Cls(model, *args)``).
    ``sleep_on_rank``: (rank, seconds) makes that rank a straggler before each backward.
    """
    import time

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model, after_backward = _wrap(strategy, tiny_net())
    reference = tiny_net()  # the same start, trained as one process would be
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    gaps = []
    for step in range(steps):
        x, y = tiny_batch(rank, step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if sleep_on_rank and sleep_on_rank[0] == rank:
            time.sleep(sleep_on_rank[1])
        loss.backward()
        if after_backward:
            after_backward()
        opt.step()
        xs, ys = zip(*(tiny_batch(r, step) for r in range(world)))  # the union of every rank's batch
        ref_opt.zero_grad()
        F.mse_loss(reference(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
        gaps.append(max((a - b).abs().max().item()
                        for a, b in zip(model.parameters(), reference.parameters())))
    return gaps


def single_process_gap(cluster, strategy="bucketed", steps=3, sleep_on_rank=None) -> list:
    """Largest |parameter difference| vs one-process training, per step, worst rank."""
    per_rank = cluster.run(single_process_gap_on_rank, strategy, steps, 0.1, sleep_on_rank)
    return [max(g[s] for g in per_rank) for s in range(steps)]


def loss_and_grads_on_rank(strategy="ddp"):
    import torch.distributed as dist

    rank = dist.get_rank()
    model, after_backward = _wrap(strategy, tiny_net())
    x, y = tiny_batch(rank, 0)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    if after_backward:
        after_backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)  # only if you ask: the average you would log
    mean_loss /= dist.get_world_size()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return {"rank": rank, "loss": loss.item(), "mean_loss": mean_loss.item(),
            "grad_norm": grads.norm().item(), "grads": grads}


def sync_order_on_rank(strategy="bucketed", bucket_cap_mb=0.001):
    """Event times (ms from the forward's start) of one step, in the order they happened."""
    rec = comm.ListRecorder()
    model, after_backward = _wrap(strategy, tiny_net(), bucket_cap_mb, recorder=rec)
    import torch.distributed as dist

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = tiny_batch(dist.get_rank(), 0)
    # One step first: iteration 0 of BucketedDDP (as of torch's DDP) is one bucket, and the
    # buckets every later step uses are rebuilt after it.
    F.mse_loss(model(x), y).backward()
    if after_backward:
        after_backward()
    opt.zero_grad()
    rec.clear()
    marks = {"forward_start": comm.now()}
    loss = F.mse_loss(model(x), y)
    marks["backward_start"] = comm.now()
    loss.backward()
    marks["backward_returned"] = comm.now()
    if after_backward:
        after_backward()
        marks["average_gradients_returned"] = comm.now()
    marks["step_start"] = comm.now()
    opt.step()
    marks["step_end"] = comm.now()
    events = [(name, t) for name, t in marks.items()]
    # "enqueued" instead of "done" on NCCL: a host stamp there is when the GPU was asked
    for name in ("launch", "done", "enqueued", "wait_start", "wait_end"):
        times = [t for t, info in rec.of(name) if info.get("kind", "grad") == "grad"]
        if times:
            events += [(f"first {name}", min(times)), (f"last {name}", max(times))]
    t0 = marks["forward_start"]
    return sorted(((name, round(1000 * (t - t0), 3)) for name, t in events), key=lambda e: e[1])


def traffic_on_rank(batch_size, strategy="bucketed", micro_steps=1, use_no_sync=False,
                    autocast_dtype=None):
    """Gradient payload bytes and all-reduce calls of one optimizer step."""
    import contextlib

    import torch.distributed as dist

    model, after_backward = _wrap(strategy, tiny_net(dtype=torch.float32), 0.001)
    with comm.counting() as counted:
        for k in range(micro_steps):
            last = k == micro_steps - 1
            quiet = model.no_sync() if use_no_sync and not last else contextlib.nullcontext()
            x, y = tiny_batch(dist.get_rank(), k, batch_size, torch.float32)
            # autocast for the device the model runs on: a CPU autocast leaves CUDA ops alone
            cast = (torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype
                    else contextlib.nullcontext())
            with quiet:
                with cast:
                    loss = F.mse_loss(model(x).float(), y)
                loss.backward()
            if after_backward and (last or not use_no_sync):
                after_backward()
    grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
    return {"bytes": counted.grad_bytes, "calls": counted.grad_calls,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "grad_dtypes": grad_dtypes}


def traffic_by_batch_size(cluster, batch_sizes=(4, 256), strategy="bucketed") -> dict:
    return {b: cluster.run(traffic_on_rank, b, strategy)[0] for b in batch_sizes}


def no_sync_traffic(cluster, micro_steps=4) -> dict:
    """Calls and bytes for ``micro_steps`` micro-batches with and without no_sync."""
    return {"every_micro_step": cluster.run(traffic_on_rank, 8, "bucketed", micro_steps, False)[0],
            "with_no_sync": cluster.run(traffic_on_rank, 8, "bucketed", micro_steps, True)[0]}


def autocast_traffic(cluster, dtype=torch.bfloat16) -> dict:
    return {"fp32": cluster.run(traffic_on_rank, 16, "bucketed")[0],
            "autocast": cluster.run(traffic_on_rank, 16, "bucketed", 1, False, dtype)[0]}


def sampler_indices(dataset_len=10, world_size=4, drop_last=False) -> list:
    """The indices DistributedSampler hands each rank (no process group needed)."""
    from torch.utils.data.distributed import DistributedSampler

    data = list(range(dataset_len))
    return [list(DistributedSampler(data, num_replicas=world_size, rank=r, shuffle=False,
                                    drop_last=drop_last)) for r in range(world_size)]


def torch_env_names(prefix="NCCL_") -> dict:
    """Environment variables that torch's own Python sources read, split by name.

    Answers "is it NCCL_ASYNC_ERROR_HANDLING or TORCH_NCCL_ASYNC_ERROR_HANDLING?"
    for the torch installed HERE, by reading its files rather than a forum post.
    """
    import pathlib
    import re

    root = pathlib.Path(torch.__file__).parent
    names = set()
    pattern = re.compile(r"\b((?:TORCH_)?" + re.escape(prefix) + r"[A-Z_]+)\b")
    for path in list((root / "distributed").rglob("*.py")) + list((root / "csrc").rglob("*.h")):
        try:
            names.update(pattern.findall(path.read_text(errors="ignore")))
        except OSError:
            continue
    return {"torch_prefixed": sorted(n for n in names if n.startswith("TORCH_")),
            "plain": sorted(n for n in names if not n.startswith("TORCH_"))}
