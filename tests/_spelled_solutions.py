"""Correct solutions written the other ways learners write them: imported names,
``distributed_c10d``, futures, a flat buffer, ``all_reduce`` with AVG, a bucket as a
``reduce_scatter`` + ``all_gather``. The graders must pass each and see its collectives."""
import contextlib

import torch
import torch.distributed as dist
from torch.distributed import all_reduce, broadcast, distributed_c10d

from ddplab.checks import loss_fn
from ddplab.sync import assign_buckets


# -- average_gradients ---------------------------------------------------------------------
def avg_imported(model):
    # a name imported before the grader could patch anything: pickled by reference
    for p in model.parameters():
        if p.grad is not None:
            all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())


def avg_c10d_async(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    works = [distributed_c10d.all_reduce(g, async_op=True) for g in grads]
    for w, g in zip(works, grads):
        w.wait()
        g /= dist.get_world_size()


def avg_flat_futures(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, async_op=True).get_future().wait()
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


# -- OverlapDDP ----------------------------------------------------------------------------
class OverlapImported(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module, self.futures = module, []
        for t in module.state_dict().values():
            broadcast(t, 0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        work = all_reduce(p.grad, async_op=True)
        world = dist.get_world_size()
        self.futures.append(work.get_future().then(lambda f, g=p.grad: g.div_(world)))

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        torch.futures.wait_all(self.futures)
        self.futures = []


class OverlapC10d(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module, self.pending = module, []
        for p in module.parameters():
            distributed_c10d.broadcast(p.detach(), src=0)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda q: self.pending.append(
                        (q.grad, distributed_c10d.all_reduce(q.grad, async_op=True))))

    def forward(self, *a):
        return self.module(*a)

    def finish_gradient_synchronization(self):
        while self.pending:
            g, w = self.pending.pop(0)
            w.wait()
            g.div_(dist.get_world_size())


# -- BucketedDDP -----------------------------------------------------------------------------
class BucketedImported(torch.nn.Module):
    """Buckets launched in index order once full, each an imported ``all_reduce`` of a flat
    buffer; the copy back happens in the future's callback."""

    def __init__(self, module, bucket_cap_mb):
        super().__init__()
        self.module = module
        for p in module.parameters():
            broadcast(p.data, 0)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = [[params[i] for i in b] for b in assign_buckets(params, bucket_cap_mb)]
        self.where = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self._reset()
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _reset(self):
        self.left = [len(b) for b in self.buckets]
        self.launched, self.futures = 0, []

    def _ready(self, p):
        self.left[self.where[id(p)]] -= 1
        while self.launched < len(self.buckets) and self.left[self.launched] == 0:
            bucket = self.buckets[self.launched]
            flat = torch.cat([q.grad.flatten() for q in bucket])
            fut = all_reduce(flat, async_op=True).get_future()
            self.futures.append(fut.then(lambda f, b=bucket, t=flat: self._unflatten(b, t)))
            self.launched += 1

    @staticmethod
    def _unflatten(bucket, flat):
        flat /= dist.get_world_size()
        for q, piece in zip(bucket, flat.split([q.numel() for q in bucket])):
            q.grad.copy_(piece.view_as(q))

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        for f in self.futures:
            f.wait()
        self._reset()


# -- no_sync ---------------------------------------------------------------------------------
def acc_exit_stack(model, optimizer, micro_batches):
    *early, last = micro_batches
    with model.no_sync():
        for x, y in early:
            (loss_fn(model(x), y) / len(micro_batches)).backward()
    x, y = last
    (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()


def acc_one_context_per_batch(model, optimizer, micro_batches):
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.ExitStack() as stack:
            if i < n - 1:
                stack.enter_context(model.no_sync())
            loss = loss_fn(model(x), y)
            loss.div(n).backward()
    optimizer.step()
