"""One bucket's life in a step: mark ready, fill, all-reduce, write back.

Teaches what the full ``BucketedDDP`` does with a bucket, and why it does
it in another order than the reference (``ddplab.sync.core.bucketed``)
and torch's reducer. Which parameters share a bucket is ``layout.py``.

As each gradient becomes final its hook MARKS its slot ready
(``mark_ready``); nothing is copied yet. When the last slot is marked the
bucket is ready and ``fill`` copies every gradient into its slice of the
flat buffer, divided by the world size (not when a comm hook reduces: the
hook divides, as in torch). BucketedDDP then launches one async all-reduce
over the buffer (or calls the comm hook), and after the wait
``write_back`` copies each slice back into ``param.grad``. The reference
and torch's reducer (``mark_variable_ready_dense``) copy each gradient as
it arrives instead; the result is the same.

Why the copies wait for the whole bucket. A call from Python into torch
costs a microsecond or more of host time however small the tensor, and one
call per gradient in and one out were most of what this class cost over
torch's C++ reducer. So ``fill`` takes one of three named ways, picked per
step from what the gradients are:

- ``_fill_fused``: every gradient is a dense tensor: small ones (under
  ``FUSE_BELOW_NUMEL`` elements) in ONE ``torch._foreach_copy_`` plus one
  division, large ones one ``torch.div(..., out=slice)`` each (their bytes
  are the cost, and copy-then-divide would pass over them twice);
- ``_fill_views`` (``gradient_as_bucket_view=True``): ``param.grad`` IS its
  slice, autograd accumulated into it in place, nothing to copy; a fresh
  ``.grad`` (after ``zero_grad(set_to_none=True)``) is copied in once and
  pointed back at the slice, as torch's reducer does;
- ``_fill_one_by_one``: some ``.grad`` is None (unused on this rank: it
  contributes zeros, as in torch) or sparse where a dense one was expected
  (an error naming it).

Sparse gradients get a bucket of one, without a flat buffer (``sparse.py``).
Figures: docs/benchmarks.md (benchmarks/per_tensor.py).

Leaves out, compared with torch: per-device bucket lists, copying in C++.

References: torch/csrc/distributed/c10d/reducer.cpp
(``mark_variable_ready_dense``, ``finalize_bucket_dense``,
``initialize_bucket_views``); picotron/data_parallel/bucket.py.
"""
from __future__ import annotations

import torch

from ddplab.sync import comm
from ddplab.sync.layout import MB, TORCH_DEFAULT_FIRST_BUCKET_MB, assign_buckets, check_bucket_cap  # noqa: F401
from ddplab.sync.sparse import not_sparse_error

# Smaller gradients are copied by one fused call per bucket, larger ones one
# call each, divided on the way (module docstring).
FUSE_BELOW_NUMEL = 2 ** 16


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

    def mark_ready(self, slot: int) -> None:
        """Mark ``params[slot].grad`` final for this step; ``fill`` copies it later."""
        if not self.ready_slots[slot]:
            self.ready_slots[slot] = True
            self.n_ready += 1

    def fill(self) -> None:
        """Copy every gradient into its slice (module docstring: three ways)."""
        grads = [p.grad for p in self.params]
        if self.as_view:
            self._fill_views(grads)
        elif any(g is None or g.is_sparse for g in grads):
            self._fill_one_by_one(range(self.size), grads)
        else:
            self._fill_fused(grads)
            return  # divided on the way
        if self.divide:
            self.buffer.div_(self.world_size)

    def _fill_fused(self, grads) -> None:
        ws, views = self.world_size, self.views
        if not self._large:  # the usual case: one copy, one division of the whole buffer
            torch._foreach_copy_(views, grads)
            if self.divide:
                self.buffer.div_(ws)
            return
        if self._small:  # one call for all of them: per-call cost, not bytes, is theirs
            small = [views[s] for s in self._small]
            torch._foreach_copy_(small, [grads[s] for s in self._small])
            if self.divide:
                torch._foreach_div_(small, ws)
        for s in self._large:  # one pass each: bytes are theirs
            if self.divide:
                torch.div(grads[s], ws, out=views[s])
            else:
                views[s].copy_(grads[s])

    def _fill_views(self, grads) -> None:
        moved = [s for s, (g, v) in enumerate(zip(grads, self.views))
                 if g is not v and (g is None or g.data_ptr() != v.data_ptr())]
        self._fill_one_by_one(moved, grads)
        for s in moved:
            if grads[s] is not None:
                self.params[s].grad = self.views[s]

    def _fill_one_by_one(self, slots, grads) -> None:
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
                    p.grad = view  # unused here, used on another rank (fill gave it zeros)
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
