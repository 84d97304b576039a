"""Synchronizing gradients by hand, after backward: ``average_gradients``.

Teaches the whole of data parallelism in one loop. Every rank runs forward
and backward on its own slice of the batch; then, for every parameter, the
ranks all-reduce (SUM) their gradients and divide by the world size. Each
rank ends up holding the mean gradient over all ranks' data: with a mean
loss and equal slices, exactly the gradient of one process training on the
union of the slices. The optimizer step then keeps the replicas identical.

    loss = loss_fn(model(x), y)
    loss.backward()
    average_gradients(model)     # nothing overlaps: comm starts after backward
    optimizer.step()

``flat=True`` copies all gradients into one flat buffer (one per dtype and
device; a sparse gradient, from ``nn.Embedding(sparse=True)``, is reduced
on its own, as torch's DDP does) and all-reduces that once: fewer, larger messages, which is the
first half of the idea behind buckets. The second half, starting early, is
OverlapDDP and BucketedDDP.

Leaves out, compared with torch's DistributedDataParallel: any overlap with
backward (everything waits for backward to end), buckets of a bounded size,
broadcasting the initial parameters and the buffers (call ``broadcast_
parameters`` yourself or wrap the model), ``no_sync`` (just do not call it),
and any check that every rank has gradients for the same parameters. A
parameter whose gradient is ``None`` on this rank is skipped: if it has one
on another rank, the ranks' all-reduces no longer pair up. The wrappers
catch that; this function does not, on purpose: it is the from-scratch
version.

References: the "average_gradients" function of torch's "Writing Distributed
Applications with PyTorch" tutorial; d2l.ai "Multiple GPUs" (allreduce).
"""
from __future__ import annotations

import torch
from torch import nn

from ddplab.sync import comm
from ddplab.sync.wrapper_duties import require_process_group, source_rank


def _grads(model: nn.Module):
    # parameters() lists a tied weight once, so it is reduced once.
    return [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]


def average_gradients(model: nn.Module, group=None, flat: bool = False, *, recorder=None) -> None:
    """All-reduce (SUM) every gradient of ``model`` and divide by the world size.

    Call after ``loss.backward()`` and before ``optimizer.step()``.
    """
    world_size = require_process_group("average_gradients", group)
    grads = _grads(model)
    comm.record(recorder, "wait_start")
    with torch.no_grad():
        if not flat:
            for i, (name, g) in enumerate(grads):
                comm.all_reduce(g, group, bucket=i, params=(name,), recorder=recorder)
                g.div_(world_size)
        else:
            _average_flat(grads, group, world_size, recorder)
    comm.record(recorder, "wait_end")


def _average_flat(grads, group, world_size, recorder):
    by_kind: dict = {}
    sparse = []
    for name, g in grads:  # torch.cat needs one dtype and one device
        if g.is_sparse:  # rows and values, not a dense block: reduced on its own
            sparse.append((name, g))
        else:
            by_kind.setdefault((g.dtype, g.device), []).append((name, g))
    for i, (name, g) in enumerate(sparse, start=len(by_kind)):
        comm.all_reduce(g, group, bucket=i, params=(name,), recorder=recorder)
        g.div_(world_size)
    for i, named in enumerate(by_kind.values()):
        flat = torch.cat([g.reshape(-1) for _, g in named])
        comm.all_reduce(flat, group, bucket=i, params=tuple(n for n, _ in named),
                        recorder=recorder)
        flat.div_(world_size)
        offset = 0
        for _, g in named:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def broadcast_parameters(model: nn.Module, group=None) -> None:
    """Copy rank 0's parameters and buffers to every rank (the wrappers do this for you)."""
    require_process_group("broadcast_parameters", group)
    states = [p.detach() for p in model.parameters()] + list(model.buffers())
    comm.broadcast_coalesced(states, source_rank(group), group, kind="params")
