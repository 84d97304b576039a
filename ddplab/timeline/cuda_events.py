"""Timing NCCL all-reduces with CUDA events, because CPU stamps would lie on GPUs.

Teaches: on a GPU, ``dist.all_reduce(t, async_op=True)`` returns as soon as
the collective is *queued* on NCCL's own stream. A CPU timestamp taken then
(or when a future's callback runs) says when the host asked, not when NCCL
ran. torch does not hand out NCCL's stream, but ``work.wait()`` makes the
*current* stream wait for it. So:

- start: an event recorded on the compute stream at launch (the collective
  cannot start before the kernels that produced the gradients);
- end: on a side stream, ``work.wait()`` then an event; that event completes
  when NCCL's kernel has finished;
- both are converted to this rank's CPU clock through a reference event
  whose CPU time is known (recorded and synchronized once per recorder).

Stamps made this way carry the source ``cuda_event``. The alternative torch
offers is ``TORCH_NCCL_ENABLE_TIMING=1`` and the work's duration; the
profiler is the third. GPU-only: nothing here runs on a CPU-only machine, and
the tests that exercise it are marked ``gpu``.

Leaves out: overlap of several NCCL streams, multi-GPU ranks.
References: torch.cuda.Event(enable_timing=True), Event.elapsed_time;
torch.distributed Work.wait semantics on NCCL (stream wait, not host wait).
"""
from __future__ import annotations

from ddplab.timeline.clock import now


class CudaStamps:
    """Events for one rank's all-reduces, resolved to CPU-clock seconds later."""

    def __init__(self, device=None):
        import torch

        self.torch = torch
        self.device = device if device is not None else torch.cuda.current_device()
        self.side = torch.cuda.Stream(device=self.device)
        self.pending: list = []  # (bucket, kind, start_event, end_event)
        self.phases: list = []  # (phase name, start_event, end_event)
        # Reference: an event that has certainly completed at CPU time ref_cpu.
        torch.cuda.synchronize(self.device)
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record()
        self.ref.synchronize()
        self.ref_cpu = now()

    def launched(self, work, bucket, kind) -> None:
        """Call right after the collective was queued."""
        torch = self.torch
        start = torch.cuda.Event(enable_timing=True)
        start.record()  # compute stream: after the kernels that made the gradients
        end = torch.cuda.Event(enable_timing=True)
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            work.wait()  # the side stream now waits for NCCL's stream
            end.record(self.side)
        self.pending.append((bucket, kind, start, end))

    def phase_event(self):
        """An event recorded now on the compute stream (a phase boundary as the GPU sees it)."""
        e = self.torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def add_phase(self, name, start_event, end_event) -> None:
        self.phases.append((name, start_event, end_event))

    def to_cpu_clock(self, event) -> float:
        return self.ref_cpu + self.ref.elapsed_time(event) / 1000.0

    def resolve(self, recorder) -> None:
        """Synchronize once and hand the recorder GPU-timed phases and completions."""
        if not self.pending and not self.phases:
            return
        self.torch.cuda.synchronize(self.device)
        for name, start, end in self.phases:
            recorder.set_phase(name, self.to_cpu_clock(start), self.to_cpu_clock(end), "cuda_event")
        self.phases.clear()
        for bucket, kind, start, end in self.pending:
            t_start = self.ref_cpu + self.ref.elapsed_time(start) / 1000.0
            t_end = self.ref_cpu + self.ref.elapsed_time(end) / 1000.0
            recorder.record("done", t_end, bucket=bucket, kind=kind, start=t_start,
                            source="cuda_event")
        self.pending.clear()
