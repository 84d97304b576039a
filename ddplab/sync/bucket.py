"""Buckets: which gradients travel together, and one bucket's life in a step.

Teaches the two halves of bucketing.

1. Assignment (``assign_buckets``), done once when the wrapper is built.
   Parameters are taken in REVERSE ``module.parameters()`` order, because
   backward produces the last layers' gradients first: the first bucket
   fills first and can leave first. A bucket closes when adding the next
   parameter would take it over ``bucket_cap_mb`` (MB = 2**20 bytes); a
   parameter larger than the cap gets a bucket of its own. A change of dtype
   or device also closes a bucket, since one flat buffer has one of each.

   ``first_bucket_cap_mb`` gives bucket 0 a cap of its own. A small first
   bucket lets the first all-reduce leave as soon as the first ~1 MiB of
   gradients is ready, instead of waiting for 25 MiB of them. This is what
   torch's ``bucket_cap_mb=None`` (its default) means on torch 2.13:
   ``_BucketCapacityConfig.create`` in torch/nn/parallel/distributed.py
   takes 25 MiB for the cap and ``dist._DEFAULT_FIRST_BUCKET_BYTES``
   (1 MiB) for the first bucket, and the reducer rebuilds its buckets
   with the limits [first, cap]. Passing ``bucket_cap_mb=25`` explicitly
   makes the first cap equal to the cap: no small first bucket. So
   ``BucketedDDP(m, first_bucket_cap_mb=1.0)`` is laid out like torch's
   ``DistributedDataParallel(m)``, and ``BucketedDDP(m)`` like
   ``DistributedDataParallel(m, bucket_cap_mb=25)``
   (tests/test_sync_options.py checks both against torch's logging data).

   torch's reducer differs in ways worth knowing: it closes a bucket only
   AFTER it has gone over the cap (so its buckets are usually a little
   larger than the cap); iteration 0 uses one bucket holding everything and
   the buckets are rebuilt in the order gradients became ready before
   iteration 1; and with ``find_unused_parameters=True`` it never rebuilds,
   keeping a layout made in ``parameters()`` order and then reversed, so
   its small bucket is the LAST one (the first layers). Here the layout
   never changes and the small bucket is always bucket 0.

2. A step (``Bucket``): as each gradient becomes final its hook marks its
   slot ready. When the last one arrives the bucket is ready: every
   gradient is copied into its slice of the bucket's flat buffer, divided by
   the world size (not when a comm hook reduces: the hook divides, as in
   torch), BucketedDDP launches one async all-reduce over the whole buffer
   (or calls the comm hook), and after waiting copies each slice back into
   ``param.grad``.

   What it costs, and why the copies wait for the whole bucket. A call from
   Python into torch costs a microsecond or more of host time however small
   the tensor (``torch.div(g, n, out=v)``: about 5 us for a 32x32 gradient
   on this project's loaded 2-core machine; ``v.copy_(g)`` about 1.3 us).
   One such call per gradient in and one out were most of what this class
   cost over torch's C++ reducer (4.3-4.5 us per tensor, issue 17). So the
   hook only marks a slot, and small gradients (under ``FUSE_BELOW_NUMEL``
   elements) go in with ONE ``torch._foreach_copy_`` per bucket plus one
   division of the buffer, and back with one more (about 0.9 us per tensor
   in all, the loop in C++). Large ones still take a call each, dividing on
   the way: their bytes are the cost, and copy-then-divide would pass over
   them twice (a 25 MiB bucket: 5.8 ms instead of 4.0 ms here). The wait
   costs nothing: a bucket cannot leave before its last gradient anyway.
   torch's reducer copies each gradient as it arrives, in C++.

   With ``gradient_as_bucket_view=True`` ``param.grad`` IS the slice: the
   copy in and the copy back disappear, and so does one gradient-sized
   allocation. autograd accumulates into an existing ``.grad`` in place, so
   from the second backward on the gradient lands in the bucket directly
   and what is left is one division of the buffer per bucket.
   After ``zero_grad(set_to_none=True)`` the next backward makes a fresh
   ``.grad``; it is copied in once and ``.grad`` is pointed back at the
   slice, as torch's reducer does.

Sparse gradients get a bucket of one, without a flat buffer (``sparse.py``).

Leaves out, compared with torch: bucket rebuilding,
per-bucket caps (``bucket_cap_mb_list``) and per-device bucket lists.

References: torch/csrc/distributed/c10d/reducer.cpp
(``compute_bucket_assignment_by_size``, ``mark_variable_ready_dense``,
``finalize_bucket_dense``, ``rebuild_buckets``); torch/nn/parallel/
distributed.py (``_BucketCapacityConfig``); picotron/data_parallel/bucket.py.
"""
from __future__ import annotations

import math
import numbers

import torch

from ddplab.sync import comm
from ddplab.sync.sparse import not_sparse_error

MB = 2 ** 20  # bucket_cap_mb is in MiB, as in torch
# torch's first bucket when bucket_cap_mb is left at None
# (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES on 2.13; a test pins it).
TORCH_DEFAULT_FIRST_BUCKET_MB = 1.0
# Smaller gradients are copied by one fused call per bucket, larger ones one
# call each, divided on the way (module docstring, "What it costs").
FUSE_BELOW_NUMEL = 2 ** 16


def check_bucket_cap(bucket_cap_mb, name: str = "bucket_cap_mb") -> float:
    """A cap in MB as a float, or a ValueError that says what to pass."""
    ok = (isinstance(bucket_cap_mb, numbers.Real) and not isinstance(bucket_cap_mb, bool)
          and not math.isnan(bucket_cap_mb) and bucket_cap_mb > 0)
    if not ok:
        hint = ""
        if bucket_cap_mb is None and name == "bucket_cap_mb":
            hint = (" (torch's bucket_cap_mb=None means 25 MB with a 1 MB first bucket: here "
                    "that is bucket_cap_mb=25.0, first_bucket_cap_mb=1.0)")
        raise ValueError(
            f"{name} must be a positive number of megabytes (MB = 2**20 bytes), got "
            f"{bucket_cap_mb!r}{hint}. Pass e.g. 25.0 (torch's default), a small value such as "
            "0.001 for many small buckets, or float('inf') for one bucket holding every gradient.")
    return float(bucket_cap_mb)


def assign_buckets(params, bucket_cap_mb: float, first_bucket_cap_mb: float | None = None, *,
                   sparse=frozenset()) -> list:
    """Group parameter indices into buckets; see the module docstring.

    ``params`` is the list of parameters in ``module.parameters()`` order;
    returns a list of buckets, each a list of indices into ``params``.
    Bucket 0 is capped by ``first_bucket_cap_mb`` (default: the same cap).
    Indices in ``sparse`` (sparse gradients, see ``sparse.py``) get a
    bucket of their own, as in torch.
    """
    cap = check_bucket_cap(bucket_cap_mb) * MB
    limit = cap if first_bucket_cap_mb is None else \
        check_bucket_cap(first_bucket_cap_mb, "first_bucket_cap_mb") * MB
    buckets, current, size, kind = [], [], 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if i in sparse:
            if current:
                buckets.append(current)
                current, size, limit = [], 0, cap
            buckets.append([i])
            kind = None
            continue
        if current and (size + nbytes > limit or (p.dtype, p.device) != kind):
            buckets.append(current)
            current, size, limit = [], 0, cap
        current.append(i)
        size += nbytes
        kind = (p.dtype, p.device)
    if current:
        buckets.append(current)
    return buckets


class Bucket:
    """Some parameters, one flat gradient buffer, and this step's progress.

    ``divide``: divide by the world size in ``fill`` (False when a comm
    hook reduces). ``as_view``: ``param.grad`` is kept pointing at the
    parameter's slice of ``buffer`` (gradient_as_bucket_view).
    """

    def __init__(self, index: int, params: list, names: list, world_size: int,
                 as_view: bool = False):
        self.index = index
        self.params = params
        self.names = tuple(names)
        self.world_size = world_size
        self.divide = True
        self.as_view = as_view
        self.size = len(params)
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.nbytes = numel * self.buffer.element_size()
        # One view per parameter, shaped like it: copying a gradient in and
        # out is then a plain copy whatever the gradient's layout.
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self._large = [s for s, p in enumerate(params) if p.numel() >= FUSE_BELOW_NUMEL]
        self._small = [s for s, p in enumerate(params) if p.numel() < FUSE_BELOW_NUMEL]
        if as_view:  # gradients that exist already move into the bucket now, as in torch
            with torch.no_grad():
                for p, view in zip(params, self.views):
                    if p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = view
        self.reset()

    def reset(self) -> None:
        self.ready_slots = [False] * self.size
        self.n_ready = 0
        self.work = None  # the all-reduce, without a comm hook
        self.future = None  # what the comm hook returned

    @property
    def ready(self) -> bool:
        return self.n_ready == self.size

    def add_grad(self, slot: int, grad=None) -> None:
        """Mark ``slot``'s gradient (``params[slot].grad``) final; ``fill``
        copies it when the whole bucket is ready."""
        if not self.ready_slots[slot]:
            self.ready_slots[slot] = True
            self.n_ready += 1

    def fill(self) -> None:
        """Copy every gradient into its slot, divided by the world size (not
        with a comm hook). A ``.grad`` of None (no gradient on this rank this
        step) contributes zeros, as in torch."""
        grads = [p.grad for p in self.params]
        if self.as_view:
            self._fill_views(grads)
            if self.divide:
                self.buffer.div_(self.world_size)
            return
        try:
            self._copy_in(grads)
        except (TypeError, RuntimeError):  # a None or a sparse gradient: slot by slot
            self._fill_slowly(range(self.size), grads)
            if self.divide:
                self.buffer.div_(self.world_size)

    def _copy_in(self, grads) -> None:
        # Small gradients: one fused copy for all of them, then one division
        # (the per-call cost, not the bytes, is what they cost). Large ones:
        # copy and divide in one pass each (the bytes are what they cost).
        ws, views = self.world_size, self.views
        if not self._large:
            torch._foreach_copy_(views, grads)
            if self.divide:
                self.buffer.div_(ws)
            return
        if self._small:
            small = [views[s] for s in self._small]
            torch._foreach_copy_(small, [grads[s] for s in self._small])
            if self.divide:
                torch._foreach_div_(small, ws)
        for s in self._large:
            if self.divide:
                torch.div(grads[s], ws, out=views[s])
            else:
                views[s].copy_(grads[s])

    def _fill_views(self, grads) -> None:
        # autograd accumulated in place into the slice: nothing to copy; else
        # (a fresh .grad after zero_grad(set_to_none=True)) copy once and
        # point .grad back at the slice, as torch's reducer does.
        moved = [s for s, (g, v) in enumerate(zip(grads, self.views))
                 if g is not v and (g is None or g.data_ptr() != v.data_ptr())]
        if moved:
            self._fill_slowly(moved, grads)
            for s in moved:
                if grads[s] is not None:
                    self.params[s].grad = self.views[s]

    def _fill_slowly(self, slots, grads) -> None:
        for s in slots:
            grad, view = grads[s], self.views[s]
            if grad is None:
                view.zero_()
            elif grad.is_sparse:
                raise not_sparse_error(self.names[s])
            else:
                view.copy_(grad)

    def launch(self, group, recorder=None) -> None:
        self.work = comm.all_reduce(self.buffer, group, async_op=True, bucket=self.index,
                                    params=self.names, recorder=recorder)

    def wait(self) -> torch.Tensor:
        """Block until this step's reduction is done; the reduced flat tensor."""
        if self.future is None:
            self.work.wait()
            return self.buffer
        out = self.future.wait()
        if isinstance(out, (list, tuple)) and len(out) == 1:
            out = out[0]  # a Work's future holds [tensor]
        if not (isinstance(out, torch.Tensor) and out.numel() == self.buffer.numel()):
            raise TypeError(
                f"the comm hook's future for bucket {self.index} gave {type(out).__name__}, "
                f"expected a tensor of {self.buffer.numel()} elements like bucket.buffer()")
        return out

    def write_back(self, reduced: torch.Tensor, skip=()) -> None:
        """Leave the reduced gradients in ``param.grad``; slots in ``skip``
        (unused on every rank) keep their ``.grad`` untouched, as in torch."""
        same = reduced.data_ptr() == self.buffer.data_ptr()
        if self.as_view:
            if not same:  # a hook returned a new tensor: the views must see it
                self.buffer.copy_(reduced)
            for slot, (p, view) in enumerate(zip(self.params, self.views)):
                if slot not in skip and p.grad is None:
                    p.grad = view  # unused here, used on another rank (add_grad did the rest)
            return
        if same and not skip:
            try:  # ONE call copies the whole bucket back into the .grad tensors
                torch._foreach_copy_([p.grad for p in self.params], self.views)
                return
            except TypeError:  # a .grad of None (unused here, used elsewhere): slot by slot
                pass
        offset = 0
        for slot, (p, view) in enumerate(zip(self.params, self.views)):
            n = p.numel()
            if slot not in skip:
                out = view if same else reduced[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = out.clone()
                else:
                    p.grad.copy_(out)
            offset += n

    def missing(self) -> list:
        return [n for n, ok in zip(self.names, self.ready_slots) if not ok]
