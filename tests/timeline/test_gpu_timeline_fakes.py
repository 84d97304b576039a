"""GPU timelines against a fake device: one clock per device, comm that queues on NCCL's stream.

The device timer (ddplab.timeline.cuda_events) is driven by tests/_fake_cuda.py: the
host runs ahead of a GPU whose kernels take known times, so the right answer is known.
"""
import pytest
from _fake_cuda import Clock, Device, NcclWork

from ddplab.timeline import cuda_events, recorder
from ddplab.timeline.recorder import Recorder


@pytest.fixture
def gpu(monkeypatch):
    import torch

    clock = Clock()
    for module in (cuda_events, recorder):  # host stamps on the same fake clock
        monkeypatch.setattr(module, "now", clock)
    dev = Device(clock)
    for name in ("Event", "Stream", "synchronize", "current_stream", "stream", "current_device"):
        monkeypatch.setattr(torch.cuda, name, getattr(dev, name))
    rec = Recorder("bucketed", 0, 2, "nccl")
    rec.device_timer = cuda_events.CudaStamps(0)
    return clock, dev, rec


def test_the_end_of_backward_wait_is_on_the_gpu_clock_like_backward(gpu):
    clock, dev, rec = gpu
    rec.begin_iteration(0)
    with rec.phase("backward"):
        dev.compute(0.030)  # backward's kernels: 30 ms on the GPU, queued in 1 ms of host time
        clock.advance(0.001)
        rec.record("wait_start", clock())  # the autograd callback, as the host reaches it
        NcclWork(dev, end=0.045).wait()  # the compute stream waits for the last bucket
        clock.advance(0.001)
        rec.record("wait_end", clock())
    rec.end_iteration()
    it = rec.timeline.iterations[0]
    assert it.sources["backward"] == it.sources["wait"] == "cuda_event"
    assert it.phases["backward"] == pytest.approx((0.0, 0.030))  # compute, on the GPU
    assert it.phases["wait"] == pytest.approx((0.030, 0.045))  # exposed communication


def test_a_bucket_queued_behind_another_starts_when_that_one_ends(gpu):
    clock, dev, rec = gpu
    rec.begin_iteration(0)
    with rec.phase("backward"):
        for bucket, (kernel, nccl_end) in enumerate([(0.010, 0.030), (0.002, 0.050)]):
            dev.compute(kernel)  # this bucket's gradients
            rec.launch(bucket, 1024, t=clock())
            rec.device_timer.launched(NcclWork(dev, nccl_end), bucket, "grad")
        rec.record("wait_start", clock())
        NcclWork(dev, 0.050).wait()
        rec.record("wait_end", clock())
    rec.end_iteration()
    b0, b1 = rec.timeline.buckets
    assert (b0.comm_start, b0.comm_end) == pytest.approx((0.010, 0.030))
    # ready at 12 ms, but NCCL's stream was busy with bucket 0 until 30 ms
    assert (b1.comm_start, b1.comm_end) == pytest.approx((0.030, 0.050))
    assert b1.sources["comm_start"] == "cuda_event_queued" and b1.sources["comm_end"] == "cuda_event"


def test_torch_ddps_wait_is_cut_on_the_gpu_clock_or_not_at_all(gpu):
    clock, dev, rec = gpu
    rec.begin_iteration(0)
    with rec.phase("backward"):
        dev.compute(0.020)
        last_ready = rec.device_timer.phase_event()  # DDP's last grad-ready, on the GPU
        NcclWork(dev, 0.035).wait()  # DDP waits for its buckets inside backward
        clock.advance(0.001)
    assert not rec.split_phase("backward", 0.0005, "wait")  # a host time alone: refused
    assert rec.split_phase("backward", 0.0005, "wait", event=last_ready)
    rec.end_iteration()
    it = rec.timeline.iterations[0]
    assert it.phases["backward"] == pytest.approx((0.0, 0.020))
    assert it.phases["wait"] == pytest.approx((0.020, 0.035))
    assert it.sources["wait"] == "cuda_event"
