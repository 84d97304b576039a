"""The recorder suite's core on NCCL ranks: compare()'s rows drawn from the group, over the fake.

Two ranks of a ddplab Cluster rejoin as ``ddplab_nccl`` whose NCCL half is the fake
ProcessGroupNCCL (tests/_fake_nccl.py), in its host-device mode (``host_device``):

What this exercises: the NCCL branches the recorders take when the rank's backend is
``nccl``: StrategyRunner gives the recorder a device timer (``CudaStamps``); the
observing group's GroupRecorder hands each all-reduce's work to it instead of a host
callback (an NCCL future is complete at enqueue); the work is the fake's async WorkNCCL on
the group's NCCL stream, waited on from the timer's side stream; blocking ops are turned
into async ones by the group; the rows' sources, bytes and the gpu-check's reading of them.

What it does not: ``device()`` answers ``cpu`` here, so models, data and every tensor are
CPU tensors routed to the fake NCCL half, not CUDA tensors; the fake GPU's streams and
events run on the host clock (the host is the device: an event's time is when the host got
there, after the fake's work.wait() blocked until gloo moved the data), so durations are
host durations of real gloo transfers, not kernel times; and in this mode a work's future
completes when the transfer has, not at enqueue (the observing-group suite holds the fake
to that contract). A real GPU run is make gpu-check's.
(In make check: test-unit-more.)
"""
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

DRAWN = "observing process group"


def _device_and_backend():
    import torch.distributed as dist

    from ddplab.pg.backend import backend_name, device

    return str(device()), backend_name(), str(dist.get_backend())


FAKE_NCCL_ON_HOST = True  # stamped on the host, as the recorder stamps NCCL


@pytest.fixture
def cluster(fake_nccl_cluster):
    """Two ranks on the fake NCCL (tests/conftest.py), back on it before each test."""
    return fake_nccl_cluster


def test_the_seam_is_what_the_docstring_says(cluster):
    assert cluster.run(_device_and_backend) == [("cpu", "nccl", "ddplab_nccl")] * 2


def test_rows_drawn_from_the_group_are_device_timed_after_their_gradients(cluster):
    from ddplab.measure import compare

    result = compare(cluster, ["core_manual", "core_bucketed", "ddp"], steps=2, n_params=2e5,
                     bucket_cap_mb=0.25)
    for name, row in result.metrics.items():
        assert row["comm_path"] == DRAWN and row["ranks_agree"], name
    assert len({row["comm_bytes_per_step"] for row in result.metrics.values()}) == 1
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import gpu_check

    for name, tl in result.timelines.items():
        if name == "ddp" and not tl.buckets:  # torch DDP is timed unrecorded; its traced copy draws
            continue
        doc = tl.to_dict()
        sources = {b["sources"].get("comm_end") for b in doc["buckets"]}
        assert sources == {"cuda_event"}, (name, sources)
        ok, figure = gpu_check.judge_transfers(doc, need_after_ready=True)
        assert ok, (name, figure)
