"""ddplab.record on NCCL: GPU-timed gradients and buckets, against a fake NCCL and a fake GPU.

One rank (world size 1, in this process) joins ``ddplab_nccl`` whose NCCL half is
tests/_fake_nccl.py's ProcessGroupNCCL, with streams and events from tests/_fake_cuda.py
on a fake clock: backward's kernels take known device times (``Tick``), each NCCL op keeps
its stream busy ``OP_S``, and the host runs ahead. So the right answer is known: each
bucket's all-reduce runs on the group's NCCL stream for OP_S, after its gradients.

What this exercises: which stream each all-reduce is queued on, which event ends it (on
the recorder's side stream after ``work.wait()``), the gradients' events, their
resolution onto the host clock, and the files' sources. What it does not: real kernels,
a real NCCL stream, several ranks (make gpu-check runs the example script on a GPU).
"""
import json
import sys
from pathlib import Path

import _fake_nccl
import pytest
import torch
import torch.distributed as dist
from _fake_cuda import Clock, Device, Event

from ddplab.timeline import cuda_events, recorder

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

OP_S = 0.004  # each NCCL op: 4 ms on its stream
BACKWARD_S = 0.010  # the kernels between the two layers' gradients


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    from ddplab.measure import recording
    from ddplab.pg.group import register

    clock = Clock()
    dev = Device(clock)
    for module in (cuda_events, recorder, recording):  # host stamps on the same fake clock
        monkeypatch.setattr(module, "now", clock)
    for name in ("Event", "Stream", "synchronize", "current_stream", "stream", "current_device"):
        monkeypatch.setattr(torch.cuda, name, getattr(dev, name))
    with _fake_nccl.installed(device_count=1, cuda=dev) as fake:
        monkeypatch.setattr(fake, "op_seconds", OP_S)
        register()
        dist.init_process_group("ddplab_nccl", store=dist.FileStore(str(tmp_path / "store"), 1),
                                rank=0, world_size=1)
        try:
            yield clock, dev, fake
        finally:
            dist.destroy_process_group()


def model(dev, clock):
    class Tick(torch.autograd.Function):  # kernels the fake GPU runs (the host queues them fast)
        @staticmethod
        def forward(ctx, x):
            dev.compute(0.002)
            clock.advance(0.0002)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            dev.compute(BACKWARD_S)
            clock.advance(0.0005)
            return g

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = torch.nn.Linear(64, 512), torch.nn.Linear(512, 600)

        def forward(self, x):
            return self.b(Tick.apply(self.a(x)))

    return Net()


def train(gpu, tmp_path, steps=5, hook=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddplab

    clock, dev, fake = gpu
    ddp = DDP(model(dev, clock), bucket_cap_mb=0.01)  # b (1.2 MB) closes the first bucket
    rec = ddplab.record(ddp, steps=range(2, steps), out=tmp_path / "run")
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(steps):
        ddp(torch.randn(2, 64)).sum().backward()
        # On a GPU, DDP's wait for each bucket's future at the end of backward makes the
        # compute stream wait for NCCL's (c10 Future::wait synchronizes the current stream
        # with the future's events); the fake's futures are CPU futures, so do it here.
        for pg in fake.instances:
            dev.main.wait_stream(pg.stream)
        opt.step()
        opt.zero_grad()
        clock.advance(0.001)
    rec.wait()  # the files are written on a thread of their own
    return rec, json.loads((tmp_path / "run.json").read_text())


def test_each_bucket_is_timed_on_the_gpu_after_its_gradients(gpu, tmp_path):
    rec, doc = train(gpu, tmp_path)
    buckets = doc["buckets"]
    assert len(buckets) == 3 * 2  # steps 2, 3, 4; the rebuilt layout's two buckets
    for b in buckets:
        assert b["sources"]["comm_end"] == "cuda_event" and b["sources"]["grads_ready"] == "cuda_event"
        assert b["sources"]["comm_start"] == "cuda_event_queued"
        assert b["comm_end"] - b["comm_start"] == pytest.approx(OP_S)  # the op's time on its stream
        assert b["comm_end"] > b["grads_ready"] >= b["grads_ready_first"]
    for it in doc["iterations"]:
        assert {it["sources"][p] for p in ("forward", "backward")} == {"cuda_event"}
        mine = sorted((b for b in buckets if b["iteration"] == it["iteration"]), key=lambda b: b["index"])
        # the second bucket waited for backward's kernels between the layers
        assert mine[1]["grads_ready"] - mine[0]["grads_ready"] == pytest.approx(BACKWARD_S)
        assert it["phases"]["wait"][1] == pytest.approx(mine[1]["comm_end"])
    assert {g["source"] for g in doc["grads"]} == {"cuda_event"}
    # what make gpu-check reads from the run it records on a GPU
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import gpu_check

    assert gpu_check.judge_transfers(doc, need_after_ready=True)[0]


def test_the_end_is_an_event_on_the_side_stream_after_the_work_on_the_nccl_stream(gpu, tmp_path,
                                                                               monkeypatch):
    clock, dev, fake = gpu
    seen = []
    launched = cuda_events.CudaStamps.launched

    def spy(self, work, bucket, kind, grads=None):
        launched(self, work, bucket, kind, grads)
        (nccl,) = [pg for pg in fake.instances if pg.works]
        op = nccl.works[-1]  # the all-reduce just queued
        end = self.pending[-1][3]
        seen.append((op.op, op.stream is nccl.stream, end.stream_seen, end.t, nccl.stream.busy_until))

    monkeypatch.setattr(cuda_events.CudaStamps, "launched", spy)
    plain = Event.record

    def record(self, stream=None):  # also note which stream the event went on
        self.stream_seen = "main" if (stream or self.dev.current) is dev.main else "side"
        plain(self, stream)

    monkeypatch.setattr(Event, "record", record)
    train(gpu, tmp_path)
    assert len(seen) == 6
    for op, on_nccl_stream, stream, t_end, nccl_free in seen:
        assert op == "allreduce" and on_nccl_stream  # async: on the group's NCCL stream
        assert stream == "side"  # the recorder's side stream, made to wait on the work
        assert t_end == pytest.approx(nccl_free)  # when NCCL's stream finished that op


def test_a_blocking_op_that_returns_no_work_is_ended_on_the_callers_stream(gpu):
    clock, dev, fake = gpu
    stamps = cuda_events.CudaStamps(0)
    rec = recorder.Recorder("ddp", 0, 1, "nccl")
    rec.device_timer = stamps
    rec.begin_iteration(0)
    dev.compute(0.003)
    rec.launch(0, 16, t=clock())
    before = stamps.phase_event()  # the gradients' event, recorded before the op
    t = torch.ones(4)
    assert fake.instances[0].allreduce([t], _blocking()) is None  # NCCL's answer, torch >= 2.8
    stamps.launched(None, 0, "grad", (before, before))
    rec.end_iteration()
    (b,) = rec.timeline.buckets
    assert b.sources["comm_end"] == "cuda_event"
    assert (b.comm_start, b.comm_end) == pytest.approx((0.003, 0.003 + OP_S))  # the caller's stream


def _blocking():
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    return opts


def test_a_comm_hook_of_yours_is_not_timed_and_the_run_says_so(gpu, tmp_path):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    rec, doc = train(gpu, tmp_path, hook=allreduce_hook)
    assert "queued" in doc["meta"]["comm_end_not_measured"]
    assert all(b.get("comm_end") is None for b in doc["buckets"])  # never a host "done"
