"""On GPUs, all-reduces are timed with CUDA events, never drawn from host stamps (GPU only)."""
import pytest

import ddplab
from ddplab.measure import compare

pytestmark = pytest.mark.gpu


def test_nccl_timeline_uses_cuda_events_and_keeps_causality(gpu_world):
    with ddplab.Cluster(gpu_world) as c:
        assert c.backend == "nccl"
        r = compare(c, "manual,bucketed,ddp", steps=3, n_params=2e6, bucket_cap_mb=1.0)
    assert r.to_json()["backend"] == "nccl"
    for name in ("manual", "bucketed", "ddp"):
        tl = r.timelines[name]
        assert tl.backend == "nccl"
        for b in tl.buckets:
            assert b.sources.get("comm_end") == "cuda_event", (name, b.sources)
            assert b.comm_end >= b.comm_start
        for it in tl.iterations:
            assert it.sources.get("backward") == "cuda_event"
        assert r.metrics[name]["ranks_agree"]
