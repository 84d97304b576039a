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
per-message latency many times over; BucketedDDP groups them. Even with
nobody to talk to (world size 1) each launch is a Python call into the
backend and a Work object, tens of microseconds of host time per tensor
over torch DDP, where BucketedDDP is at torch DDP's cost
(benchmarks/per_tensor.py; figures in docs/benchmarks.md).

Launch order. Ranks pair collectives by the order they are called in, and
here all-reduces start in the order gradients become ready. That order is
the same on every rank only when every rank runs the same graph: if the
data decides the order of two same-shaped layers, rank 0 may launch
``a.weight`` where rank 1 launches ``b.weight``, and the ranks add up the
wrong tensors. torch's DDP avoids this by launching buckets in a fixed
order (BucketedDDP does the same). OverlapDDP keeps launching early and
instead CHECKS: at the end of each synchronizing backward one more
all-reduce, of two int64 numbers (a fingerprint of this rank's launch
order and its negation, MAX), tells every rank whether all orders agreed;
if not, backward raises an error naming where the orders first differ
(the gradients of that step are wrong, so the step must not be taken).
Cost: one 16-byte all-reduce per step, waited for with the others (about
one all-reduce latency; over a simulated link its 2(p-1) alpha). On a GPU,
reading the answer at once would make the host wait for every all-reduce
of the step, a sync torch's reducer does not make; there the answer is
copied to the host without waiting and read at the next synchronizing
backward, so the error comes one step late and says so.

Leaves out, compared with torch's DistributedDataParallel: buckets and the
fixed launch order (see above: detected, not prevented), and
``static_graph``'s hooks that fire more than once per backward (an error
here; see ``wrapper_duties`` for that and the rest: buffers, no_sync, unused
parameters).

References: torch.Tensor.register_post_accumulate_grad_hook;
torch.distributed.all_reduce(async_op=True); Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddplab.sync import comm
from ddplab.sync.wrapper_duties import GradSyncModule


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
        self._pending_check = None  # on a GPU: (host copy, its event, launch order), read later

    def _grad_ready(self, index, param):
        if index in self._works:  # its all-reduce has left with the first gradient
            raise self._ready_twice(index)
        grad = param.grad
        grad.div_(self.world_size)
        self._works[index] = comm.all_reduce(grad, self.process_group, async_op=True,
                                             bucket=index, params=(self._names[index],),
                                             recorder=self.recorder)

    def _wait_launched(self):
        check = None
        if len(self._works) == len(self._params):  # else the missing-gradient error follows
            # hash() of a tuple of ints is the same in every process (no hash seed)
            h = hash(tuple(self._works)) % 2**62  # so that -h fits in int64 too
            # on the parameters' device: a group may reduce only device tensors (nccl)
            check = torch.tensor([h, -h], dtype=torch.int64, device=self._params[0].device)
            check_work = comm.all_reduce(check, self.process_group, async_op=True,
                                         op=dist.ReduceOp.MAX, kind="launch_order",
                                         recorder=self.recorder)
        for work in self._works.values():
            work.wait()
        previous, self._pending_check = self._pending_check, None
        if check is not None:
            check_work.wait()
            if self._read_later(check):
                self._pending_check = self._copy_to_host(check) + (tuple(self._works),)
            elif check[0].item() != -check[1].item():  # some rank's fingerprint differs
                raise self._order_error(tuple(self._works))
        if previous is not None:  # the previous step's answer (GPU), long finished by now
            self._read_check(*previous)

    @staticmethod
    def _read_later(check) -> bool:
        return check.device.type != "cpu"

    @staticmethod
    def _copy_to_host(check):
        # pinned memory and no wait: the copy is queued behind the check's all-reduce
        host = torch.empty(check.shape, dtype=check.dtype, pin_memory=check.is_cuda)
        host.copy_(check, non_blocking=True)
        done = torch.cuda.Event() if check.is_cuda else None
        if done is not None:
            done.record()
        return host, done

    def _read_check(self, host, done, order) -> None:
        if done is not None:
            done.synchronize()  # the previous step's copy: finished long ago
        if host[0].item() != -host[1].item():
            raise self._order_error(order, late=True)

    def _order_error(self, order, late: bool = False) -> RuntimeError:
        # Only on the error path: every rank's whole order, to say where they part.
        rank, ws = dist.get_rank(self.process_group), self.world_size
        orders = torch.zeros(ws, len(self._params), dtype=torch.int64,
                             device=self._params[0].device)
        orders[rank] = torch.tensor(list(order), device=orders.device)
        comm.all_reduce(orders, self.process_group, kind="launch_order")
        orders = orders.cpu()
        first = next(i for i in range(orders.shape[1]) if len(set(orders[:, i].tolist())) > 1)
        which = ", ".join(f"rank {r}: {self._names[orders[r, first]]}" for r in range(ws))
        return RuntimeError(
            f"OverlapDDP on rank {dist.get_rank()}: the ranks launched their per-parameter "
            f"all-reduces in different orders in {'the previous' if late else 'this'} backward; "
            f"all-reduce number {first} was "
            f"{which}. Ranks pair all-reduces by order, so they added up different parameters' "
            + ("gradients, and the PREVIOUS step's gradients were wrong (on a GPU this is read one "
               "step late, so that the host never waits for the all-reduces). " if late else
               "gradients and this step's gradients are wrong. ") + "The order gradients become ready "
            "depends on the data here (layers applied in a data-dependent order?). Use "
            "BucketedDDP, which launches in a fixed order as torch's DDP does, or apply the "
            "layers in the same order on every rank.")

    def _not_ready(self):
        return [n for i, n in enumerate(self._names) if i not in self._works]

    def _reset(self):
        self._works = {}
