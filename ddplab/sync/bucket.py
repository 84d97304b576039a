"""Buckets: which gradients travel together, and one bucket's life in a step.

Teaches the two halves of bucketing.

1. Assignment (``assign_buckets``), done once when the wrapper is built.
   Parameters are taken in REVERSE ``module.parameters()`` order, because
   backward produces the last layers' gradients first: the first bucket
   fills first and can leave first. A bucket closes when adding the next
   parameter would take it over ``bucket_cap_mb`` (MB = 2**20 bytes); a
   parameter larger than the cap gets a bucket of its own. A change of dtype
   or device also closes a bucket, since one flat buffer has one of each.

   torch's reducer differs in two ways worth knowing: it closes a bucket
   only AFTER it has gone over the cap (so its buckets are usually a little
   larger than the cap), and after the first iteration it rebuilds its
   buckets in the order gradients actually became ready (iteration 0 uses
   one bucket holding everything). Here the layout never changes.

2. A step (``Bucket``): as each gradient becomes ready it is copied, already
   divided by the world size, into its slice of the bucket's flat buffer.
   When the last one arrives the bucket is ready; BucketedDDP launches one
   async all-reduce over the whole buffer, and after waiting copies each
   slice back into ``param.grad``.

Leaves out, compared with torch: ``gradient_as_bucket_view`` (there
``param.grad`` IS the slice, saving the copies), the small first bucket
torch uses when ``bucket_cap_mb`` is not given, bucket rebuilding, sparse
gradients, and per-device bucket lists.

References: torch/csrc/distributed/c10d/reducer.cpp
(``compute_bucket_assignment_by_size``, ``mark_variable_ready``);
picotron/data_parallel/bucket.py.
"""
from __future__ import annotations

import math
import numbers

import torch

from . import comm

MB = 2 ** 20  # bucket_cap_mb is in MiB, as in torch


def check_bucket_cap(bucket_cap_mb) -> float:
    """``bucket_cap_mb`` as a float, or a ValueError that says what to pass."""
    ok = (isinstance(bucket_cap_mb, numbers.Real) and not isinstance(bucket_cap_mb, bool)
          and not math.isnan(bucket_cap_mb) and bucket_cap_mb > 0)
    if not ok:
        raise ValueError(
            f"bucket_cap_mb must be a positive number of megabytes (MB = 2**20 bytes), got "
            f"{bucket_cap_mb!r}. Pass e.g. 25.0 (torch's default), a small value such as 0.001 "
            "for many small buckets, or float('inf') for one bucket holding every gradient.")
    return float(bucket_cap_mb)


def assign_buckets(params, bucket_cap_mb: float) -> list:
    """Group parameter indices into buckets; see the module docstring.

    ``params`` is the list of parameters in ``module.parameters()`` order;
    returns a list of buckets, each a list of indices into ``params``.
    """
    cap = check_bucket_cap(bucket_cap_mb) * MB
    buckets, current, size, kind = [], [], 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap or (p.dtype, p.device) != kind):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        kind = (p.dtype, p.device)
    if current:
        buckets.append(current)
    return buckets


class Bucket:
    """Some parameters, one flat gradient buffer, and this step's progress."""

    def __init__(self, index: int, params: list, names: list, world_size: int):
        self.index = index
        self.params = params
        self.names = tuple(names)
        self.world_size = world_size
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.nbytes = numel * self.buffer.element_size()
        # One view per parameter, shaped like it: copying a gradient in and
        # out is then a plain copy whatever the gradient's layout.
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.reset()

    def reset(self) -> None:
        self.ready_slots = [False] * len(self.params)
        self.n_ready = 0
        self.work = None

    @property
    def ready(self) -> bool:
        return self.n_ready == len(self.params)

    def add_grad(self, slot: int, grad: torch.Tensor) -> None:
        """Copy one final gradient in, divided by the world size (one pass, as torch does)."""
        torch.div(grad, self.world_size, out=self.views[slot])
        if not self.ready_slots[slot]:
            self.ready_slots[slot] = True
            self.n_ready += 1

    def launch(self, group, recorder=None) -> None:
        self.work = comm.all_reduce(self.buffer, group, async_op=True, bucket=self.index,
                                    params=self.names, recorder=recorder)

    def wait_and_write_back(self) -> None:
        self.work.wait()
        for p, view in zip(self.params, self.views):
            p.grad.copy_(view)

    def missing(self) -> list:
        return [n for n, ok in zip(self.names, self.ready_slots) if not ok]
