"""Every strategy on CUDA equals torch DDP on CUDA (GPU only; world size 1 on a 1-GPU machine).

At world size 1 the NCCL all-reduce is local, so what this checks is that the
hooks, buckets, division and device placement of each strategy give torch's
numbers on the GPU, with the gradients living (and reduced) on the GPU.
"""
import pytest
import torch

import ddplab

pytestmark = pytest.mark.gpu


def _train_on_rank(strategy, steps=4):
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.sync import BucketedDDP, OverlapDDP, average_gradients

    device = ddplab.device()
    rank = dist.get_rank()

    def model(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                             nn.Linear(32, 4)).double().to(device)

    ours, ref = model(rank), model(0)  # ranks start apart: the wrappers must broadcast
    if strategy == "overlap":
        ours = OverlapDDP(ours)
    elif strategy == "bucketed":
        ours = BucketedDDP(ours, bucket_cap_mb=0.002)
    elif strategy.startswith("manual"):
        for p in ours.parameters():
            dist.broadcast(p.data, 0)
    ref = DDP(ref, device_ids=[device.index] if device.type == "cuda" else None)
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gaps, kinds = [], set()
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(16, 8, generator=g, dtype=torch.float64).to(device)
        y = torch.randn(16, 4, generator=g, dtype=torch.float64).to(device)
        for m, opt in ((ours, opt_a), (ref, opt_b)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            if m is ours and strategy.startswith("manual"):
                average_gradients(m, flat=strategy == "manual_flat")
            opt.step()
        kinds.update(p.grad.device.type for p in ours.parameters())
        gaps.append(max((a - b).abs().max().item()
                        for a, b in zip(ours.parameters(), ref.parameters())))
    return gaps, kinds


@pytest.mark.parametrize("strategy", ["manual", "manual_flat", "overlap", "bucketed"])
def test_each_strategy_on_cuda_equals_torch_ddp(gpu_world, strategy):
    with ddplab.Cluster(gpu_world) as c:
        assert c.backend == "nccl"
        out = c.run(_train_on_rank, strategy)
    for gaps, kinds in out:
        assert kinds == {"cuda"}
        assert max(gaps) < 1e-12, gaps
