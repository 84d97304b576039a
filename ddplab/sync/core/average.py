"""Averaging gradients by hand, after backward: the whole of data parallelism in one loop.

What it teaches. Each rank runs forward and backward on its own slice of
the batch. Then, for every parameter, the ranks all-reduce (SUM) their
gradients and divide by the world size, so every rank holds the mean
gradient. With a mean loss and equal slices that is the gradient one
process would get on the union of the slices, and the optimizer step
keeps the replicas equal (they must start equal: broadcast first).

    broadcast_parameters(model)         # once: every rank starts from rank 0's weights
    for x, y in my_batches:
        loss_fn(model(x), y).backward()
        average_gradients(model)        # communication starts only now
        optimizer.step(); optimizer.zero_grad()

``average_gradients_flat`` makes ONE all-reduce out of all the gradients
(one flat buffer per dtype): fewer, larger messages, the first half of the
idea behind buckets. The second half, starting while backward still runs,
is ``overlap.py`` and ``bucketed.py``.

What it leaves out, compared with torch's DistributedDataParallel: any
overlap with backward; buckets of a bounded size; buffers (BatchNorm's
running statistics) are broadcast once, by ``broadcast_parameters``, not at
every forward; and any check that every rank has gradients for the same
parameters. A parameter whose ``.grad`` is None is skipped: if another rank
has one, the ranks' all-reduces no longer pair up. Sparse gradients are
refused. ``ddplab.average_gradients`` (the full version) reduces sparse
gradients, and counts and records every call.

References: "Writing Distributed Applications with PyTorch" (torch
tutorial, its ``average_gradients``); d2l.ai, "Multiple GPUs"
(``allreduce``); torch.distributed.all_reduce.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _gradients(model: nn.Module) -> list:
    # parameters() lists a tied weight once, so it is reduced once.
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if any(g.is_sparse for g in grads):
        raise NotImplementedError(
            "ddplab.sync.core.average_gradients takes dense gradients only; this model has a "
            "sparse one (nn.Embedding(sparse=True)). ddplab.average_gradients reduces those.")
    return grads


def broadcast_parameters(model: nn.Module, group=None) -> None:
    """Copy the parameters and buffers of the group's rank 0 to every rank."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t, src=src, group=group)


def average_gradients(model: nn.Module, group=None) -> None:
    """All-reduce (SUM) every gradient, one call per parameter, and divide by the world size."""
    world_size = dist.get_world_size(group)
    with torch.no_grad():
        for grad in _gradients(model):
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
            grad.div_(world_size)


def average_gradients_flat(model: nn.Module, group=None) -> None:
    """The same result with one all-reduce per dtype: gradients copied into one flat buffer."""
    world_size = dist.get_world_size(group)
    by_dtype: dict = {}
    for grad in _gradients(model):  # torch.cat needs one dtype (and one device)
        by_dtype.setdefault((grad.dtype, grad.device), []).append(grad)
    with torch.no_grad():
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(world_size)
            offset = 0
            for g in grads:  # copy each slice back into its parameter's .grad
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
