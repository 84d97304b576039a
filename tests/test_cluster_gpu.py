"""NCCL ranks, one GPU each: only where GPUs are visible (skipped on CPU machines)."""
import pytest
import torch

import ddplab

pytestmark = pytest.mark.gpu


def _on_gpu():
    import torch.distributed as dist

    t = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return torch.cuda.current_device(), dist.get_backend(), t


def test_auto_picks_nccl_with_a_gpu_per_rank_and_results_come_back_on_cpu():
    with ddplab.Cluster(2) as c:
        assert c.backend == "nccl"
        out = c.run(_on_gpu)
    assert [dev for dev, _, _ in out] == [0, 1]
    assert all(b == "nccl" and t.device.type == "cpu" and t.sum().item() == 12 for _, b, t in out)
    assert not torch.cuda.is_initialized()  # the kernel never touched CUDA


def test_nccl_rank_failure_is_reported_and_ranks_replaced():
    def fail():
        import torch.distributed as dist

        if dist.get_rank() == 0:
            raise RuntimeError("rank zero gives up")
        dist.all_reduce(torch.ones(1, device="cuda"))

    with ddplab.Cluster(2, backend="nccl", timeout=20) as c:
        with pytest.raises(ddplab.RankError, match="rank zero gives up"):
            c.run(fail)
        assert c.run(lambda: 1) == [1, 1]
