"""Two GPU fixes that CPU ranks never exercise, checked against fakes.

- Lab 04's straggler sleeps ``factor - 1`` times its usual forward+backward compute.
  On a GPU the host only queues kernels (about a millisecond) while the GPU computes
  for tens of milliseconds: the compute time must come from the device's clock (the
  recorder's device timer), or the straggler would barely straggle. A fake GPU
  (tests/_fake_cuda.py) takes known kernel times while the host runs ahead.
- Lab 07's autocast follows the data's device: ``torch.autocast("cpu")`` around a
  CUDA model casts nothing. No CUDA here, so the device type the lesson asks
  autocast for is what is checked, with the batch's device faked.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from _fake_cuda import Clock, Device

from ddplab.measure import runners
from ddplab.measure.spec import RunSpec
from ddplab.timeline import cuda_events, recorder

FORWARD_S, BACKWARD_S, HOST_S = 0.020, 0.030, 0.0005  # GPU kernels; the host's share


@pytest.fixture
def gpu(monkeypatch):
    clock = Clock()
    for module in (cuda_events, recorder):  # host stamps on the same fake clock
        monkeypatch.setattr(module, "now", clock)
    dev = Device(clock)
    for name in ("Event", "Stream", "current_stream", "stream", "current_device"):
        monkeypatch.setattr(torch.cuda, name, getattr(dev, name))

    def synchronize(device=None):  # the host waits until the GPU has done its queued work
        clock.advance(max(0.0, dev.main.busy_until - clock()))

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return clock, dev


class Kernels(torch.autograd.Function):
    """Identity whose forward and backward queue GPU work (and take a little host time)."""

    dev = clock = None

    @staticmethod
    def forward(ctx, x):
        Kernels.dev.compute(FORWARD_S)
        Kernels.clock.advance(HOST_S)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        Kernels.dev.compute(BACKWARD_S)
        Kernels.clock.advance(HOST_S)
        return g


def test_the_straggler_sleeps_in_proportion_to_device_compute_time(gpu, monkeypatch):
    clock, dev = gpu
    Kernels.dev, Kernels.clock = dev, clock
    slept = []

    def sleep(seconds):  # the straggler's pause, on the fake clock (the GPU idles meanwhile)
        slept.append(seconds)
        clock.advance(seconds)

    monkeypatch.setattr(runners.time, "sleep", sleep)
    spec = RunSpec(strategies="none", model="mlp", n_params=1e4, depth=2, batch_size=4,
                   straggler=(0, 3.0), warmup=1, steps=3)
    runner = runners.StrategyRunner("none", spec, rank=0, world_size=1, backend="gloo")
    runner.recorder.device_timer = cuda_events.CudaStamps(0)  # what an NCCL rank gets
    model = runner.model
    runner.model = lambda x: Kernels.apply(model(x))
    for i in range(4):
        runner.step(i)
    compute = FORWARD_S + BACKWARD_S
    # the compute of each step, as the GPU saw it (the sleep taken out)
    assert runner.compute_s == pytest.approx([compute] * 4, abs=1e-6)
    # no pause before the first step is known, then (factor - 1) x the device compute,
    # not x the host's ~1 ms of launches
    assert slept == pytest.approx([2 * compute] * 3, abs=1e-6)


class OnDevice(torch.Tensor):
    """A CPU tensor that says it lives on another device (no CUDA here): what the lesson
    reads to choose autocast's device."""

    kind = "cpu"

    @property
    def device(self):
        return torch.device(self.kind, 0) if self.kind != "cpu" else torch.device("cpu")


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_autocast_is_asked_for_the_device_the_batch_is_on(monkeypatch, device_type):
    from ddplab.lessons import training

    asked = []

    def autocast(device, dtype=None, **kwargs):
        asked.append((device, dtype))
        return contextlib.nullcontext()  # CPU ranks: run the step itself in float32

    real_batch = training.tiny_batch

    def batch_on_device(*args, **kwargs):
        x, y = real_batch(*args, **kwargs)
        x = x.as_subclass(OnDevice)
        x.kind = device_type
        return x, y

    monkeypatch.setattr(torch, "autocast", autocast)
    monkeypatch.setattr(training, "tiny_batch", batch_on_device)
    monkeypatch.setattr(training, "_wrap", lambda strategy, net, lr: (net, None))  # one process
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    out = training.traffic_on_rank(16, "bucketed", 1, False, torch.bfloat16)
    assert asked == [(device_type, torch.bfloat16)]
    assert out["grad_dtypes"] == ["torch.float32"]  # the step ran (autocast faked away)
