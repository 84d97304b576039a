"""NCCL ranks, one GPU each: only where GPUs are visible (skipped on CPU machines).

A 1-GPU machine runs these at world size 1: the all-reduce is then local, but
the group, the device placement, CPU collectives on an NCCL rank and failure
handling are all the real NCCL paths.
"""
import pytest
import torch

import ddplab

pytestmark = pytest.mark.gpu


def _on_gpu():
    import torch.distributed as dist

    t = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(t)
    c = torch.ones(2) * (dist.get_rank() + 1)  # a CPU tensor on the same group goes through gloo
    dist.all_reduce(c)
    return (torch.cuda.current_device(), ddplab.backend_name(), str(ddplab.device()),
            ddplab.pg.backend.backend_description(), t, c)


def test_auto_picks_nccl_with_a_gpu_per_rank_and_results_come_back_on_cpu(gpu_world):
    with ddplab.Cluster(gpu_world) as c:
        assert c.backend == "nccl"
        out = c.run(_on_gpu)
    total = gpu_world * (gpu_world + 1) / 2
    assert [dev for dev, *_ in out] == list(range(gpu_world))
    for r, (_dev, name, device, described, t, cpu) in enumerate(out):
        assert (name, device, described) == ("nccl", f"cuda:{r}", "cpu:gloo,cuda:nccl")
        assert t.device.type == "cpu" and t.sum().item() == 4 * total
        assert cpu.sum().item() == 2 * total
    assert not torch.cuda.is_initialized()  # the kernel never touched CUDA


def test_nccl_rank_failure_is_reported_and_the_cluster_recovers(gpu_world):
    def fail():
        import torch.distributed as dist

        if dist.get_rank() == 0:
            raise RuntimeError("rank zero gives up")
        dist.all_reduce(torch.ones(1, device="cuda"))

    with ddplab.Cluster(gpu_world, backend="nccl", timeout=20) as c:
        with pytest.raises(ddplab.RankError, match="rank zero gives up"):
            c.run(fail)
        assert c.run(lambda: 1) == [1] * gpu_world


def test_named_gpu_is_the_ranks_device():
    last = torch.cuda.device_count() - 1  # answers without a CUDA context
    with ddplab.Cluster(1, gpus=[last]) as c:
        assert c.gpus == (last,)
        assert c.run(lambda: str(ddplab.device())) == [f"cuda:{last}"]
