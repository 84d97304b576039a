"""What every gradient-synchronizing wrapper does besides reducing gradients.

Teaches the parts of torch's DistributedDataParallel that are easy to forget
because they are not "the all-reduce":

- start equal: parameters and buffers are broadcast from rank 0 when the
  wrapper is built, so every rank trains the same model;
- keep buffers equal: with ``broadcast_buffers=True`` (torch's default) the
  buffers (BatchNorm's running statistics) are broadcast from rank 0 at the
  start of every forward that records a graph, also inside ``no_sync``. A
  forward under ``torch.no_grad()`` broadcasts only right after a
  synchronizing forward, as torch's does: ranks that evaluate different
  numbers of batches under no_grad must not wait for each other. The copy
  back into the buffers goes through ``.data``, so their autograd version
  counters do not move and a graph that saved a buffer (two forwards before
  one backward) stays valid, as in torch;
- only trainable parameters take part: frozen ones (``requires_grad=False``)
  get no hook, and a parameter tied to another module
  (``out.weight = emb.weight``) is one tensor, listed once by
  ``module.named_parameters()``, so it is reduced once;
- whether a backward synchronizes is decided at forward time (as torch does):
  inside ``with model.no_sync():`` the hooks do nothing and gradients simply
  accumulate in ``param.grad``;
- the wait is automatic: a hook on the forward's output tensors (found in
  tensors, lists, tuples, dicts and dataclasses, as torch looks for them)
  queues a callback on the autograd engine when backward reaches them,
  which runs once that backward has finished and calls
  ``finish_gradient_synchronization()``; calling it again is a no-op. Queued
  from the outputs, the callback belongs to the outer backward even when a
  reentrant checkpoint runs a nested backward inside it;
- misuse fails loudly: no process group, nothing to train, a parameter that
  got no gradient (its all-reduce would never start; the error names it), a
  gradient hook that fires twice in one backward (reentrant checkpointing
  reusing a layer: its all-reduce has left already), and a forward after a
  backward that broke off (an exception inside backward, caught), whose
  launched all-reduces were never waited for. The last two are errors in
  torch's DDP too.

Leaves out, compared with torch DDP (BucketedDDP adds ``find_unused_parameters``,
``static_graph``, ``gradient_as_bucket_view`` and comm hooks; see
``bucketed.py``): device placement
(``device_ids``), the check that every rank holds same-shaped parameters,
Join, mixed precision, and torch's rule that skips the buffer broadcast at a
grad-enabled forward that follows a ``no_sync`` or no-grad forward (here
every grad-enabled forward broadcasts; tests/sync/test_sync_equivalence.py shows
torch's pattern): a module whose buffers change under no_grad (BatchNorm in
train mode, evaluated under no_grad) then trains on with rank 0's buffers
where torch keeps each rank's until the next synchronizing forward.
A backward that broke off leaves the wrapper refusing every forward, as
torch's does: wrap the module again to start over.
``broadcast_buffers`` keeps torch's long-standing name; torch 2.13 renamed it
``forward_sync_buffers`` and its deprecated ``broadcast_buffers=False`` also
skips the buffer broadcast at construction. Here buffers are always
broadcast at construction, whatever ``broadcast_buffers`` says (torch's
``forward_sync_buffers`` behaves the same way).

References: torch/nn/parallel/distributed.py (``_sync_module_states``,
``_pre_forward``, ``no_sync``); torch.autograd.Variable._execution_engine
.queue_callback; picotron's data_parallel.py.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn

from ddplab.sync import comm
from ddplab.sync.unused import output_tensors

HOW_TO_START = ("Start ranks first: ddplab.Cluster(world_size=2) then cluster.run(fn), or "
                "ddplab.launch(fn, world_size=2); under torchrun call ddplab.init_from_env() "
                "or torch.distributed.init_process_group(...).")


def require_process_group(who: str, group=None):
    """The group's world size, or an error that says how to get a group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{who}: no process group is initialised, so there are no other "
                           f"ranks to synchronize with. {HOW_TO_START}")
    return dist.get_world_size(group)


def source_rank(group) -> int:
    """Global rank of the group's rank 0 (torch's broadcast takes a global rank)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def trainable_parameters(module: nn.Module) -> list:
    """``[(name, param)]`` that need synchronizing: frozen skipped, tied listed once."""
    # named_parameters() drops duplicates, so a tied weight appears once
    # (under its first name): its hook fires once with the summed gradient.
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


class GradSyncModule(nn.Module):
    """Base for OverlapDDP and BucketedDDP; subclasses reduce the gradients.

    A subclass implements ``_grad_ready(index, param)`` (called from the hook
    of ``self._params[index]``), ``_wait_launched()`` (wait for what it
    launched and write averaged gradients back), ``_not_ready()`` (names of
    parameters that got no gradient) and ``_reset()``. With
    ``mark_used=True`` the hooks also write 1 into ``grad_marks[index]``
    (also inside no_sync); the subclass reads and clears it.
    """

    def __init__(self, module: nn.Module, process_group=None, broadcast_buffers: bool = True,
                 recorder=None, *, mark_used: bool = False):
        super().__init__()
        who = type(self).__name__
        if not isinstance(module, nn.Module):
            raise TypeError(f"{who} wraps a torch.nn.Module, got {type(module).__name__}")
        named = trainable_parameters(module)
        if not named:
            raise ValueError(f"{who}: the module has no parameter with requires_grad=True, so "
                             "there are no gradients to synchronize. Unfreeze a parameter, or do "
                             "not wrap this module.")
        self.world_size = require_process_group(who, process_group)
        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.recorder = recorder
        self.require_backward_grad_sync = True  # torch's name; no_sync() clears it
        self._src = source_rank(process_group)
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._expect_hooks = False  # set at forward: this backward should sync
        self._hooks_fired = False  # some hook ran: work may be in flight until the callback
        self._callback_queued = False  # the end-of-backward callback is queued
        self._sync_buffers_next = True  # torch's require_forward_param_sync (no_grad forwards)
        # grad_marks: 1 at a parameter's index once its gradient has been
        # accumulated, also inside no_sync (so micro-steps count). Written by
        # the hooks, read and cleared by the subclass (unused-parameter policy).
        self.grad_marks = bytearray(len(named)) if mark_used else None
        self._sync_module_states()
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                         for i, p in enumerate(self._params)]
        self._output_hook = self._make_output_hook()

    # -- construction and forward ----------------------------------------------
    def _sync_module_states(self):
        states = [p.detach() for p in self.module.parameters()] + list(self.module.buffers())
        comm.broadcast_coalesced(states, self._src, self.process_group, kind="params",
                                 recorder=self.recorder)

    def forward(self, *args, **kwargs):
        if self._hooks_fired:
            raise self._broken_backward_error()
        grad_enabled = torch.is_grad_enabled()
        # Every grad-enabled forward broadcasts (also inside no_sync); a no_grad
        # forward only right after a synchronizing one, as in torch. So ranks
        # that evaluate a different number of batches under no_grad still pair.
        if self.broadcast_buffers and (grad_enabled or self._sync_buffers_next):
            buffers = list(self.module.buffers())  # re-read: a module may reassign them
            if buffers:
                comm.broadcast_coalesced(buffers, self._src, self.process_group,
                                         kind="buffers", recorder=self.recorder)
        self._sync_buffers_next = grad_enabled and self.require_backward_grad_sync
        if grad_enabled:
            # A forward under no_grad (evaluation between forward and
            # backward) has no backward and must not cancel the pending one.
            self._expect_hooks = self.require_backward_grad_sync
            # A backward that raised before any parameter's hook may have queued
            # a callback the engine then dropped: the next backward queues its own.
            self._callback_queued = False
        out = self.module(*args, **kwargs)
        if grad_enabled and self._expect_hooks:
            for t in output_tensors(out):
                if t.grad_fn is not None:
                    t.register_hook(self._output_hook)
        return out

    def _broken_backward_error(self) -> RuntimeError:
        return RuntimeError(
            f"{type(self).__name__} on rank {dist.get_rank()}: the previous backward stopped "
            "before it finished (an exception raised inside backward and caught?). Some "
            "gradients' all-reduces were launched and never waited for, and parameter(s) "
            f"{', '.join(self._not_ready()) or '(none)'} never got their gradient. Going on "
            "would let those all-reduces write into this step's gradients. torch's "
            "DistributedDataParallel refuses here too (\"Expected to have finished reduction in "
            "the prior iteration\"). Let the exception end the training loop; to start again, "
            "call model.zero_grad(set_to_none=True) and wrap the module again on every rank.")

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside this block only accumulate gradients."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # -- backward ---------------------------------------------------------------
    def _make_hook(self, index):
        # The hook lives on the parameter, so it holds the wrapper weakly: a
        # notebook that wraps the same model again leaves no live old wrapper.
        wrapper = weakref.ref(self)

        def hook(param):  # post-accumulate-grad hooks receive the PARAMETER
            self = wrapper()
            if self is None:
                return
            if self.grad_marks is not None:
                self.grad_marks[index] = 1
            if not self._expect_hooks:
                return
            if not self._hooks_fired:
                self._hooks_fired = True
                if not self._callback_queued:  # the forward's outputs were not reached first
                    self._queue_callback()
            if self.recorder is not None:  # off: not even the bucket lookup
                comm.record(self.recorder, "grad_ready", bucket=self._bucket_of(index),
                            param=self._names[index])
            self._grad_ready(index, param)
        return hook

    def _make_output_hook(self):
        wrapper = weakref.ref(self)

        def output_hook(grad):
            # Runs when backward reaches the forward's outputs, before any
            # parameter's hook, in the OUTER backward. Queued from a parameter's
            # hook instead, the callback would belong to the backward that hook
            # runs in: with reentrant activation checkpointing that is a nested
            # backward, which ends before the first layers' gradients exist.
            self = wrapper()
            if self is not None and self._expect_hooks and not self._callback_queued:
                self._queue_callback()
        return output_hook

    def _queue_callback(self):
        self._callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(
            self.finish_gradient_synchronization)

    def _bucket_of(self, index) -> int:
        return index

    def finish_gradient_synchronization(self) -> None:
        """Wait for every launched all-reduce and leave averaged gradients in
        ``param.grad``. Runs by itself at the end of backward; idempotent."""
        self._callback_queued = False
        if not self._hooks_fired:
            return
        comm.record(self.recorder, "wait_start")
        try:
            self._wait_launched()
            missing = self._not_ready()
        finally:
            self._hooks_fired = False
            self._expect_hooks = False  # a second backward without forward does not sync
            self._reset()
            comm.record(self.recorder, "wait_end")
        if missing:
            rank = dist.get_rank()
            raise RuntimeError(
                f"{type(self).__name__} on rank {rank}: parameter(s) {', '.join(missing)} got no "
                "gradient in this backward, so their all-reduce never started and the other "
                f"ranks would wait for it. {self._missing_hint()}")

    def _missing_hint(self) -> str:
        return ("Make every trainable parameter take part in the loss, or freeze it "
                "(p.requires_grad_(False)) before wrapping. (For parameters that sit out some "
                "iterations or some ranks, BucketedDDP and torch's DistributedDataParallel take "
                "find_unused_parameters=True.)")

    def _ready_twice(self, index) -> RuntimeError:
        """Case: a parameter's gradient hook fires a second time in one backward."""
        return RuntimeError(
            f"{type(self).__name__} on rank {dist.get_rank()}: parameter {self._names[index]} "
            "got its gradient twice in one backward, after its all-reduce had already been "
            "launched (reentrant activation checkpointing, torch.utils.checkpoint(..., "
            "use_reentrant=True), around a layer that is also used outside it?). Its averaged "
            "gradient would be wrong. torch's DistributedDataParallel refuses this too (\"mark "
            "a variable ready only once\"). Use torch.utils.checkpoint(..., use_reentrant=False), "
            "or BucketedDDP(..., static_graph=True), which learns how often each hook fires.")

    def _grad_ready(self, index, param):
        raise NotImplementedError

    def _wait_launched(self):
        raise NotImplementedError

    def _not_ready(self) -> list:
        raise NotImplementedError

    def _reset(self):
        raise NotImplementedError
