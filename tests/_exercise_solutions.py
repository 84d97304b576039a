"""Reference solutions to the four exercises, as a learner would write them (plain torch.distributed).

The tests plant mistakes by changing one line of these at a time; labs/0N-*.ipynb hold the same code.
"""
import contextlib

import torch
import torch.distributed as dist

from ddplab.checks import loss_fn
from ddplab.sync import assign_buckets


def my_average_gradients(model):
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:          # a frozen parameter has no gradient
            dist.all_reduce(p.grad)     # SUM over ranks, in place
            p.grad /= world


class MyOverlapDDP(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.works = []
        for p in module.parameters():
            dist.broadcast(p.data, src=0)       # every rank starts from rank 0's weights
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.grad_ready)

    def grad_ready(self, param):                # the hook receives the PARAMETER
        param.grad /= self.world_size
        self.works.append(dist.all_reduce(param.grad, async_op=True))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for work in self.works:
            work.wait()
        self.works.clear()


class MyBucketedDDP(torch.nn.Module):
    def __init__(self, module, bucket_cap_mb):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = [[params[i] for i in b] for b in assign_buckets(params, bucket_cap_mb)]
        self.bucket_of = {p: k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        self.next_bucket = 0
        self.in_flight = []
        for p in params:
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def grad_ready(self, param):
        self.ready[self.bucket_of[param]] += 1
        # launch every full bucket that has no unlaunched bucket before it
        while (self.next_bucket < len(self.buckets)
               and self.ready[self.next_bucket] == len(self.buckets[self.next_bucket])):
            bucket = self.buckets[self.next_bucket]
            flat = torch.cat([p.grad.reshape(-1) for p in bucket]) / self.world_size
            self.in_flight.append((bucket, flat, dist.all_reduce(flat, async_op=True)))
            self.next_bucket += 1

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for bucket, flat, work in self.in_flight:
            work.wait()
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.in_flight.clear()
        self.ready = [0] * len(self.buckets)
        self.next_bucket = 0


def my_accumulation_step(model, optimizer, micro_batches):
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        last = i == n - 1
        with (contextlib.nullcontext() if last else model.no_sync()):
            loss = loss_fn(model(x), y) / n     # the mean over all micro-batches
            loss.backward()
    optimizer.step()
