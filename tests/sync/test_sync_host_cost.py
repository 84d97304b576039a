"""BucketedDDP's host cost per gradient tensor: copies are fused per bucket.

The cost of a hook-based reducer is Python calls per tensor. These tests pin
the structure that makes it cheap, with counts rather than timings (a loaded
machine cannot make them flaky): the number of torch ops that move gradients
into and out of a bucket does not grow with the number of small gradients in
it. And the fused path and the per-tensor path for large gradients (mixed in
one bucket) still give torch DDP's gradients. The timings themselves:
benchmarks/per_tensor.py (docs/benchmarks.md, "Per-tensor host cost").
"""
from __future__ import annotations

import collections

import pytest

# aten ops that move or scale gradient data (forward/backward compute is not counted)
COPY_OPS = ("copy_", "div", "div_", "mul", "mul_", "_foreach_copy_", "_foreach_div_", "zero_",
            "clone")


def _copy_ops_per_backward(n_layers, view):
    import torch
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode

    from ddplab.sync import BucketedDDP

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in COPY_OPS:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = BucketedDDP(nn.Sequential(*[nn.Linear(4, 4) for _ in range(n_layers)]),
                        gradient_as_bucket_view=view)
    x = torch.randn(2, 4)
    for _ in range(2):  # the second backward is the steady state (views: .grad is the slice)
        loss = model(x).sum()
        with Count() as count:
            loss.backward()
    assert len(model.buckets) == 1
    return dict(count.ops)


@pytest.mark.parametrize("view", [False, True], ids=["copies", "gradient_as_bucket_view"])
def test_copies_into_and_out_of_a_bucket_do_not_grow_with_its_number_of_gradients(cluster1, view):
    few, many = cluster1.run(lambda: (_copy_ops_per_backward(5, view),
                                      _copy_ops_per_backward(50, view)))[0]
    # before the copies were fused: one division-copy in and one copy out per gradient (10 vs 100 each)
    assert few == many, (few, many)
    assert sum(many.values()) <= 3, many  # copy in, divide, copy back: one call each


def _mixed_bucket_step(comm_hook):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ddplab.sync import BucketedDDP

    def build():
        torch.manual_seed(0)  # fc1.weight is large (copied one by one), the rest small (fused)
        return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 3))

    ours = BucketedDDP(build())
    ddp = nn.parallel.DistributedDataParallel(build(), bucket_cap_mb=25)
    if comm_hook:
        ours.register_comm_hook(None, default_hooks.allreduce_hook)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        x = torch.randn(5, 256, generator=g)
        for m in (ours, ddp):
            m.zero_grad(set_to_none=True)
            m(x).pow(2).sum().backward()
    big = ours.module[0].weight.numel()
    return big, [(a.grad - b.grad).abs().max().item()
                 for a, b in zip(ours.module.parameters(), ddp.module.parameters())]


@pytest.mark.parametrize("comm_hook", [False, True], ids=["divide_on_copy", "comm_hook"])
def test_large_and_small_gradients_in_one_bucket_average_like_torch(cluster2, comm_hook):
    from ddplab.sync.bucket import FUSE_BELOW_NUMEL

    for big, diffs in cluster2.run(_mixed_bucket_step, comm_hook):
        assert big >= FUSE_BELOW_NUMEL  # the per-tensor path really ran beside the fused one
        assert max(diffs) < 1e-5, diffs
