"""Overlap communication with backward: one async all-reduce per parameter, from its hook.

What it teaches. A parameter's gradient is final as soon as autograd has
accumulated it into ``param.grad``, and for the last layers that happens
long before backward reaches the first ones. So every parameter gets a
post-accumulate-grad hook (``autograd_hook``; torch calls it with the
PARAMETER, its gradient is ``param.grad``) that divides the gradient by the
world size and launches ``dist.all_reduce(..., async_op=True)`` at once.
Backward goes on computing earlier layers while the backend's threads move
the later layers' gradients. The first hook of a backward queues
``finalize_backward`` on the autograd engine; it runs when backward ends
and waits for every launched all-reduce.

    model = OverlapDDP(model)
    loss_fn(model(x), y).backward()   # all-reduces leave during backward
    optimizer.step()                  # gradients are averaged already

Like torch's DDP it also broadcasts rank 0's parameters and buffers when
built, the buffers again at every forward that records a graph, skips
frozen parameters, reduces a tied parameter once (``parameters()`` lists it
once) and has ``no_sync()``: backward passes of forwards run inside it
only accumulate gradients.

Why torch does not do exactly this: one collective per parameter pays the
per-message latency once per tensor (``bucketed.py`` groups them), and the
ranks pair all-reduces by the ORDER they are called in, which here is the
order gradients become ready. A model whose data decides the order of two
same-shaped layers makes ranks add up different parameters' gradients.
torch launches buckets in a fixed order instead.

What it leaves out, compared with torch's DistributedDataParallel: buckets
and the fixed launch order; ``find_unused_parameters``, ``static_graph``,
comm hooks (see ``bucketed.py``, and the full ``ddplab.BucketedDDP``);
torch's exact rule for buffers (it skips the broadcast at a forward that
follows a ``no_sync`` one, and broadcasts at a no_grad forward right after a
synchronizing one; here every grad-enabled forward broadcasts, a no_grad
forward never does); reentrant activation checkpointing (the callback is queued from
the first hook, which may run in a nested backward); WHERE torch queues that
callback: in ``mark_variable_ready`` once its last bucket is launched, so a
parameter without a gradient lets torch's backward return and its next
forward raise, where this one raises at the end of that backward
(``bucketed.py`` does it torch's way). ``ddplab.OverlapDDP``
(the full version) checks the launch order across ranks, queues its
callback from the forward's outputs and records every collective.

References: torch.Tensor.register_post_accumulate_grad_hook;
torch.distributed.all_reduce(async_op=True); Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn


class OverlapDDP(nn.Module):
    def __init__(self, module: nn.Module, process_group=None, broadcast_buffers: bool = True,
                 **unsupported):
        super().__init__()
        if unsupported:
            raise TypeError(
                f"ddplab.sync.core.OverlapDDP does not take {', '.join(sorted(unsupported))}: it "
                "is the reference to read, not every option. ddplab.OverlapDDP records its "
                "collectives (recorder=); ddplab.BucketedDDP and torch's DistributedDataParallel "
                "take torch's options (find_unused_parameters, static_graph, ...).")
        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.world_size = dist.get_world_size(process_group)
        self.src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        self.require_backward_grad_sync = True  # torch's name; no_sync() clears it
        self.expect_autograd_hooks = False  # set at forward: this backward synchronizes
        self.finalize_queued = False
        self.works = {}  # parameter index -> its all-reduce, in launch order
        # Frozen parameters need no gradient; parameters() lists a tied one once.
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in module.named_parameters()}
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

    def autograd_hook(self, index: int, param: torch.Tensor):
        """Runs once ``param.grad`` holds this backward's gradient: launch its all-reduce."""
        if not self.expect_autograd_hooks:
            return  # inside no_sync: the gradient just accumulates
        if not self.finalize_queued:
            self.finalize_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize_backward)
        if index in self.works:
            raise RuntimeError(f"parameter {self.names[id(param)]} got its gradient twice in one "
                               "backward, after its all-reduce had left. ddplab.BucketedDDP("
                               "static_graph=True) and torch's DDP handle that.")
        # Divide first, then SUM: every rank ends with the mean, nothing left to do after.
        param.grad.div_(self.world_size)
        self.works[index] = dist.all_reduce(param.grad, op=dist.ReduceOp.SUM,
                                            group=self.process_group, async_op=True)

    def finalize_backward(self):
        """End of backward: wait for every all-reduce; the gradients are then averaged."""
        for work in self.works.values():
            work.wait()
        missing = [self.names[id(p)] for i, p in enumerate(self.params) if i not in self.works]
        self.works, self.finalize_queued, self.expect_autograd_hooks = {}, False, False
        if missing:
            raise RuntimeError(
                f"parameter(s) {', '.join(missing)} got no gradient in this backward, so their "
                "all-reduce never started. Make every trainable parameter take part in the "
                "loss, or freeze it; for parameters that sit out some steps use "
                "ddplab.BucketedDDP or torch's DDP with find_unused_parameters=True.")
