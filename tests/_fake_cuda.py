"""A fake of the few ``torch.cuda`` calls ddplab's device timer makes, on a fake clock.

The model: the host runs ahead; each stream finishes its queued work at
``busy_until`` (device seconds, on the same clock as the host). An event
recorded on a stream completes when the stream has done everything queued
before it: ``max(host now, stream.busy_until)``. ``work.wait()`` of a fake NCCL
work makes the current stream wait for the collective's end, as torch's does.
"""
from __future__ import annotations

import contextlib


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class Stream:
    def __init__(self, dev):
        self.dev, self.busy_until = dev, 0.0

    def wait_stream(self, other) -> None:
        self.busy_until = max(self.busy_until, other.busy_until)


class Event:
    def __init__(self, dev, enable_timing=False):
        self.dev, self.t = dev, None

    def record(self, stream=None) -> None:
        s = stream or self.dev.current
        self.t = max(self.dev.clock(), s.busy_until)

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1000.0


class Device:
    """The ``torch.cuda`` calls ``CudaStamps`` makes, plus ``compute(seconds)`` to queue kernels."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.main = Stream(self)
        self.current = self.main

    def compute(self, seconds: float) -> None:
        self.main.busy_until = max(self.main.busy_until, self.clock()) + seconds

    def current_device(self):
        return 0

    def Stream(self, device=None):  # noqa: N802 - torch.cuda's name
        return Stream(self)

    def Event(self, enable_timing=False):  # noqa: N802 - torch.cuda's name
        return Event(self, enable_timing)

    def synchronize(self, device=None) -> None:
        pass

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, s):
        previous, self.current = self.current, s
        try:
            yield
        finally:
            self.current = previous


class NcclWork:
    """A collective that ends at device time ``end``; ``wait()`` is a stream wait.

    As ``WorkNCCL::wait``: without a limit the current stream waits for the collective
    and the host goes on; with one the host blocks until the end (the clock advances to
    it) or, if the end is further than the limit, raises NCCL's timeout (tests/_fake_nccl.py
    is the whole group; this is one work on the fake clock)."""

    def __init__(self, dev: Device, end: float):
        self.dev, self.end = dev, end
        self.get_future = _complete_now  # an NCCL future is complete at enqueue

    def wait(self, timeout=None) -> bool:
        s = self.dev.current
        s.busy_until = max(s.busy_until, self.end)
        if timeout is not None:
            limit = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
            if self.end - self.dev.clock() > limit:
                import torch.distributed as dist

                self.dev.clock.advance(limit)
                raise dist.DistBackendError(
                    f"Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE) "
                    f"ran for {int(limit * 1000)} milliseconds before timing out.")
            self.dev.clock.t = max(self.dev.clock.t, self.end)
        return True

    def is_completed(self) -> bool:
        return self.dev.clock() >= self.end


def _complete_now():
    import torch

    f = torch.futures.Future()
    f.set_result([])
    return f
