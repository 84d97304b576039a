"""Buckets: torch's DistributedDataParallel in one file, in plain torch.distributed calls.

What it teaches. Gradients travel in buckets: a few MiB of them copied into
one flat buffer and all-reduced in ONE async call, launched while backward
is still computing earlier layers. The names are torch's (reducer.cpp):

1. ``compute_bucket_assignment_by_size``, once: parameters in REVERSE
   ``parameters()`` order (backward produces the last layers' gradients
   first). A parameter is added to the open bucket of its dtype and device
   (one flat buffer holds one dtype), and the bucket closes once its size
   REACHES the cap, so buckets end a little over it. ``bucket_cap_mb`` is in
   MiB; left at None it means torch's default: a 1 MiB first bucket per
   dtype (the first gradients can leave sooner), then 25 MiB. The buckets
   still open at the end come last; torch takes those from a hash map, so
   their order among themselves is the map's (``ddplab.sync.layout`` says
   what was measured); here, the reverse of the order their dtypes appeared.
2. ``autograd_hook``: a post-accumulate-grad hook on each parameter.
3. ``mark_variable_ready``: copy the gradient into its slice of the
   bucket's buffer, divided by the world size; the bucket is ready when its
   last gradient is in. Once the LAST bucket has been launched, queue
   ``finalize_backward`` on the autograd engine (torch queues it there too).
4. ``mark_bucket_ready``: launch buckets strictly in INDEX order. Ranks pair
   collectives by call order, so a rank whose bucket 2 happened to be ready
   before bucket 1 must still send bucket 1 first.
5. ``finalize_backward``: when backward ends, wait for every bucket and copy
   the averaged slices back into ``param.grad``.

A parameter that gets no gradient leaves its bucket unlaunched, so
``finalize_backward`` is never queued: backward returns as if nothing were
wrong, with gradients NOT averaged, and the NEXT grad-enabled forward raises
(torch's ``ensure_prior_reduction_finished``, "Expected to have finished
reduction in the prior iteration").

    model = BucketedDDP(model, bucket_cap_mb=25)
    loss_fn(model(x), y).backward()     # buckets leave during backward
    optimizer.step()
    with model.no_sync():               # gradient accumulation: no communication
        loss_fn(model(x2), y2).backward()

What it leaves out, compared with torch's DistributedDataParallel:
- torch uses ONE bucket per dtype in the first iteration (unless
  ``bucket_cap_mb_list``, or ``find_unused_parameters=True`` without
  ``static_graph``), then REBUILDS the buckets once, by the rule above, in
  the order gradients became ready in that iteration (it never rebuilds
  with ``find_unused_parameters=True`` unless ``static_graph=True``). Here
  the reverse-``parameters()`` layout is kept from the start: the same as
  torch's rebuilt layout when backward produces gradients in reverse
  declaration order (a plain stack of layers; the order of buckets still
  open at the end aside, above), different when a model declares layers in
  another order than it uses them (then the full ``ddplab.BucketedDDP``,
  which rebuilds, matches torch);
- ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``,
  ``bucket_cap_mb_list``, comm hooks and sparse gradients: refused
  here, all in ``ddplab.BucketedDDP``;
- torch's exact rule for buffers (it skips the broadcast at a forward that
  follows a ``no_sync`` one, and broadcasts at a no_grad forward right after
  a synchronizing one): here every grad-enabled forward broadcasts, a
  no_grad forward never does; reentrant activation checkpointing; copying
  each gradient in C++;
- after the "no gradient" error torch's reducer stays broken (every later
  forward raises again); the reference forgets the unfinished step, so a
  notebook can go on after the fix.

References: torch/csrc/distributed/c10d/reducer.cpp (``autograd_hook``,
``mark_variable_ready`` and its ``queue_callback`` once ``next_bucket_ ==
buckets_.size()``, ``mark_variable_ready_dense``, ``mark_bucket_ready``,
``finalize_backward``, ``ensure_prior_reduction_finished``,
``compute_bucket_assignment_by_size``, ``rebuild_buckets``; read at
pytorch/pytorch commit ad78a7b33a49, the nearest snapshot to v2.13.0 at hand);
torch/nn/parallel/distributed.py (``_BucketCapacityConfig``); picotron's
data_parallel/bucket.py and data_parallel.py.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn

MB = 2 ** 20  # bucket_cap_mb counts MiB, as in torch
DEFAULT_BUCKET_CAP_MB = 25.0  # torch's, when bucket_cap_mb is None
FIRST_BUCKET_CAP_MB = 1.0  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES, default cap only


def compute_bucket_assignment_by_size(params, bucket_cap_mb=None) -> list:
    """Buckets as lists of indices into ``params``, bucket 0 first (filled first by backward)."""
    if bucket_cap_mb is None:
        limits = [int(FIRST_BUCKET_CAP_MB * MB), int(DEFAULT_BUCKET_CAP_MB * MB)]
    else:
        limits = [int(bucket_cap_mb * MB)]  # whole bytes: torch truncates the same way
    buckets = []
    open_buckets = {}  # (dtype, device) -> [indices, bytes, which limit]
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        indices, size, k = open_buckets.get(key, ([], 0, 0))
        indices.append(i)
        size += p.numel() * p.element_size()
        if size >= limits[k]:  # added first, closed once it reaches the cap
            buckets.append(indices)
            indices, size, k = [], 0, min(k + 1, len(limits) - 1)
        open_buckets[key] = (indices, size, k)
    # Still open: torch's order here is its hash map's; the reverse of first appearance.
    buckets += [indices for indices, _, _ in reversed(open_buckets.values()) if indices]
    return buckets


class Bucket:
    """Some parameters, one flat buffer for their gradients, and this step's progress."""

    def __init__(self, index: int, params: list):
        self.index = index
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        # One view of the buffer per parameter, shaped like it.
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.reset()

    def reset(self):
        self.pending = len(self.params)  # gradients still to come in this backward
        self.work = None  # the all-reduce, once launched


class BucketedDDP(nn.Module):
    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None,
                 process_group=None, broadcast_buffers: bool = True, **unsupported):
        super().__init__()
        if unsupported:
            raise TypeError(
                f"ddplab.sync.core.BucketedDDP does not take {', '.join(sorted(unsupported))}: "
                "it is the reference to read, not every option. ddplab.BucketedDDP takes torch's "
                "options (find_unused_parameters, static_graph, gradient_as_bucket_view, "
                "bucket_cap_mb_list, register_comm_hook, recorder).")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB or None (torch's "
                             f"default: 25 with a 1 MiB first bucket), got {bucket_cap_mb!r}")
        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.world_size = dist.get_world_size(process_group)
        self.src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        self.require_backward_grad_sync = True  # torch's name; no_sync() clears it
        self.expect_autograd_hooks = False  # set at forward: this backward synchronizes
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        if any(p.is_sparse or getattr(m, "sparse", False) is True for m in module.modules()
               for p in m.parameters(recurse=False)):
            raise NotImplementedError("sparse gradients (nn.Embedding(sparse=True)) are not in "
                                      "the reference; ddplab.BucketedDDP gives them buckets of one")
        self.buckets = []
        self.locate = {}  # parameter index -> (bucket, its view of the bucket's buffer)
        layout = compute_bucket_assignment_by_size(self.params, bucket_cap_mb)
        self.bucket_indices = layout  # for each bucket, indices into self.params
        for b, indices in enumerate(layout):
            bucket = Bucket(b, [self.params[i] for i in indices])
            self.buckets.append(bucket)
            for i, view in zip(indices, bucket.views):
                self.locate[i] = (bucket, view)
        self.next_bucket = 0  # the lowest bucket index not launched yet
        self.ready = set()  # parameter indices marked ready in this backward
        self._sync_module_states()
        # Wrapping the same model again (a notebook cell run twice) must not leave the old
        # wrapper's hooks on the parameters, launching all-reduces of their own.
        for handle in getattr(module, "_ddplab_reference_hooks", []):
            handle.remove()
        module._ddplab_reference_hooks = [
            param.register_post_accumulate_grad_hook(functools.partial(self.autograd_hook, index))
            for index, param in enumerate(self.params)]

    def _sync_module_states(self):
        # Every rank starts from rank 0's weights and buffers.
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t, src=self.src, group=self.process_group)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self.ensure_prior_reduction_finished()
            if self.broadcast_buffers:  # BatchNorm statistics: rank 0's on every rank
                for b in self.module.buffers():
                    dist.broadcast(b.data, src=self.src, group=self.process_group)
            # Decided now, as torch does: the backward of THIS forward synchronizes or not.
            self.expect_autograd_hooks = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside this block only accumulate gradients."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # -- backward: hook -> mark_variable_ready -> mark_bucket_ready -> finalize_backward --
    def autograd_hook(self, index: int, param: torch.Tensor):
        """Runs once ``param.grad`` holds this backward's gradient."""
        if not self.expect_autograd_hooks:
            return  # inside no_sync: the gradient just accumulates in param.grad
        self.mark_variable_ready(index)

    def mark_variable_ready(self, index: int):
        """Copy the gradient into its bucket, divided by the world size."""
        if index in self.ready:
            raise RuntimeError(f"parameter {self.names[index]} got its gradient twice in one "
                               "backward, after its bucket may have left. ddplab.BucketedDDP("
                               "static_graph=True) and torch's DDP handle that.")
        self.ready.add(index)
        bucket, view = self.locate[index]
        torch.div(self.params[index].grad, self.world_size, out=view)
        bucket.pending -= 1
        if bucket.pending == 0:
            self.mark_bucket_ready()
        if self.next_bucket == len(self.buckets):  # every bucket launched: wait at the end
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize_backward)

    def mark_bucket_ready(self):
        """Launch every ready bucket that has no unlaunched bucket before it."""
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            bucket = self.buckets[self.next_bucket]
            bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM,
                                          group=self.process_group, async_op=True)
            self.next_bucket += 1

    def finalize_backward(self):
        """End of backward: wait for each bucket, copy the averages back into ``param.grad``."""
        for bucket in self.buckets[:self.next_bucket]:
            bucket.work.wait()
            for param, view in zip(bucket.params, bucket.views):
                param.grad.copy_(view)
        self._reset_step()

    def _reset_step(self):
        for bucket in self.buckets:
            bucket.reset()
        self.next_bucket, self.ready = 0, set()
        self.expect_autograd_hooks = False

    def ensure_prior_reduction_finished(self):
        """At a forward: a backward that marked gradients ready but never finalized is an error."""
        if not self.ready:
            return
        missing = [n for i, n in enumerate(self.names) if i not in self.ready]
        self._reset_step()  # torch's reducer stays broken; the reference lets a notebook go on
        raise RuntimeError(
            "Expected to have finished reduction in the prior iteration: parameter(s) "
            f"{', '.join(missing)} got no gradient in the last backward, so their bucket never "
            "left, that backward returned without averaging, and this forward cannot start a "
            "new step. Make every trainable parameter take part in the loss, or freeze it; "
            "for parameters that sit out some steps use ddplab.BucketedDDP or torch's DDP "
            "with find_unused_parameters=True.")
