"""What every gradient-synchronizing wrapper does besides reducing gradients.

Teaches the parts of torch's DistributedDataParallel that are easy to forget
because they are not "the all-reduce":

- start equal: parameters and buffers are broadcast from rank 0 when the
  wrapper is built, so every rank trains the same model;
- keep buffers equal: with ``broadcast_buffers=True`` (torch's default) the
  buffers (BatchNorm's running statistics) are broadcast from rank 0 at the
  start of every forward, also inside ``no_sync``;
- only trainable parameters take part: frozen ones (``requires_grad=False``)
  get no hook, and a parameter tied to another module
  (``out.weight = emb.weight``) is one tensor, listed once by
  ``module.named_parameters()``, so it is reduced once;
- whether a backward synchronizes is decided at forward time (as torch does):
  inside ``with model.no_sync():`` the hooks do nothing and gradients simply
  accumulate in ``param.grad``;
- the wait is automatic: the first hook of a backward queues a callback on
  the autograd engine, which runs once backward has finished and calls
  ``finish_gradient_synchronization()``; calling it again is a no-op;
- misuse fails loudly: no process group, nothing to train, or a parameter
  that got no gradient (its all-reduce would never start; the error names it).

Leaves out, compared with torch DDP (BucketedDDP adds ``find_unused_parameters``,
``static_graph``, ``gradient_as_bucket_view`` and comm hooks; see
``bucketed.py``): device placement
(``device_ids``), the check that every rank holds same-shaped parameters,
Join, mixed precision, and torch's rule that skips the buffer broadcast at a
forward that follows a ``no_sync`` or no-grad forward (here every forward
broadcasts; tests/test_sync_equivalence.py shows torch's pattern).
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

from . import comm

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
    parameters that got no gradient) and ``_reset()``.
    """

    def __init__(self, module: nn.Module, process_group=None, broadcast_buffers: bool = True,
                 recorder=None):
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
        self._hooks_fired = False  # some hook ran; the end-of-backward callback is queued
        # Subclasses that track which parameters got a gradient (unused-parameter
        # detection) set a bytearray here; the hooks write 1 at their index,
        # also inside no_sync, so micro-steps count.
        self._seen = None
        self._sync_module_states()
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                         for i, p in enumerate(self._params)]

    # -- construction and forward ----------------------------------------------
    def _sync_module_states(self):
        states = [p.detach() for p in self.module.parameters()] + list(self.module.buffers())
        comm.broadcast_coalesced(states, self._src, self.process_group, kind="params",
                                 recorder=self.recorder)

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())  # re-read: a module may reassign them
            if buffers:
                comm.broadcast_coalesced(buffers, self._src, self.process_group,
                                         kind="buffers", recorder=self.recorder)
        if self._hooks_fired:  # a backward broke off midway: start clean
            self._reset()
            self._hooks_fired = False
        if torch.is_grad_enabled():
            # A forward under no_grad (evaluation between forward and
            # backward) has no backward and must not cancel the pending one.
            self._expect_hooks = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

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
            if self._seen is not None:
                self._seen[index] = 1
            if not self._expect_hooks:
                return
            if not self._hooks_fired:
                self._hooks_fired = True
                torch.autograd.Variable._execution_engine.queue_callback(
                    self.finish_gradient_synchronization)
            if self.recorder is not None:  # off: not even the bucket lookup
                comm.record(self.recorder, "grad_ready", bucket=self._bucket_of(index),
                            param=self._names[index])
            self._grad_ready(index, param)
        return hook

    def _bucket_of(self, index) -> int:
        return index

    def finish_gradient_synchronization(self) -> None:
        """Wait for every launched all-reduce and leave averaged gradients in
        ``param.grad``. Runs by itself at the end of backward; idempotent."""
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
                "ranks would wait for it. Make every trainable parameter take part in the "
                "loss, or freeze it (p.requires_grad_(False)) before wrapping. (For parameters "
                "that sit out some iterations or some ranks, BucketedDDP and torch's "
                "DistributedDataParallel take find_unused_parameters=True.)")

    def _grad_ready(self, index, param):
        raise NotImplementedError

    def _wait_launched(self):
        raise NotImplementedError

    def _not_ready(self) -> list:
        raise NotImplementedError

    def _reset(self):
        raise NotImplementedError
