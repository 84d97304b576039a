"""Overlap communication with backward: one async all-reduce per parameter.

Teaches the idea that makes DDP faster than ``average_gradients``: a
parameter's gradient is final as soon as autograd has accumulated it, which
for the last layers is long before backward reaches the first layers. So
each parameter gets a hook (``register_post_accumulate_grad_hook``; the hook
receives the parameter, its gradient is ``param.grad``) that launches an
async all-reduce right then. Backward keeps computing the earlier layers
while the backend's threads move the later layers' gradients. At the end of
backward a queued callback waits for all of them.

    model = OverlapDDP(model)
    loss_fn(model(x), y).backward()   # all-reduces start during backward
    optimizer.step()                  # gradients are averaged already

Each gradient is divided by the world size before the SUM all-reduce (as
torch does while copying into its buckets), so after the wait there is
nothing left to do.

What it costs: one collective per parameter. Small messages pay the fixed
per-message latency many times over; BucketedDDP groups them.

Leaves out, compared with torch's DistributedDataParallel: buckets, and the
rule that launches collectives in a fixed order. Here all-reduces start in
the order gradients become ready, which is the same on every rank only
because every rank runs the same graph; a rank whose hooks fired in another
order would pair the wrong tensors. See ``_common`` for the rest (buffers,
no_sync, unused parameters).

References: torch.Tensor.register_post_accumulate_grad_hook;
torch.distributed.all_reduce(async_op=True); Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020.
"""
from __future__ import annotations

from . import comm
from ._common import GradSyncModule


class OverlapDDP(GradSyncModule):
    """Wrap ``module``; each parameter's gradient is all-reduced as soon as it is ready.

    ``.module`` is the wrapped module; ``.no_sync()`` skips synchronization
    for forwards run inside it; ``recorder`` (see ``ddplab.sync.comm``)
    receives grad-ready, launch, done and wait stamps, with the parameter's
    index as the bucket index.
    """

    def __init__(self, module, process_group=None, broadcast_buffers: bool = True, recorder=None):
        super().__init__(module, process_group, broadcast_buffers, recorder)
        self._works: dict = {}  # parameter index -> work, in launch order

    def _grad_ready(self, index, param):
        grad = param.grad
        grad.div_(self.world_size)
        self._works[index] = comm.all_reduce(grad, self.process_group, async_op=True,
                                             bucket=index, params=(self._names[index],),
                                             recorder=self.recorder)

    def _wait_launched(self):
        for work in self._works.values():
            work.wait()

    def _not_ready(self):
        return [n for i, n in enumerate(self._names) if i not in self._works]

    def _reset(self):
        self._works = {}
