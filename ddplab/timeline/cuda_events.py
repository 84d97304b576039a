"""Timing NCCL all-reduces with CUDA events, because CPU stamps would lie on GPUs.

Teaches: on a GPU, ``dist.all_reduce(t, async_op=True)`` returns as soon as
the collective is *queued* on NCCL's own stream. A CPU timestamp taken then
(or when a future's callback runs) says when the host asked, not when NCCL
ran: ddplab calls such a stamp "enqueued". torch does not hand out NCCL's
stream, but ``work.wait()`` makes the *current* stream wait for it. So:

- inputs ready: an event recorded on the compute stream at launch (the
  collective cannot start before the kernels that produced the gradients);
- end: on a side stream, ``work.wait()`` then an event; that event completes
  when NCCL's kernel has finished;
- start: one process group's collectives run one after another on its NCCL
  stream, so a bucket starts when its inputs are ready AND the collective
  queued before it has ended (source ``cuda_event_queued``): the time a
  bucket spends queued behind the previous one is not transfer time;
- phases (forward, backward, the end-of-backward wait, step) from events on
  the compute stream, all resolved together: every phase and every
  completion of one rank is on that rank's device clock, never a mix of
  host stamps and GPU events (a host stamp says when the CPU got there, and
  the CPU runs ahead of the GPU by whatever is queued);
- all of it is moved onto this rank's CPU clock through one reference event
  whose CPU time is known (recorded and synchronized once per recorder),
  so ranks can still be lined up.

Stamps made this way carry the source ``cuda_event``. The alternative torch
offers is ``TORCH_NCCL_ENABLE_TIMING=1`` and the work's duration; the
profiler is the third. Cost: two events and a switch to the side stream per
collective, paid by recorded runs only (``compare`` times strategies that
need it unrecorded). Tests replace the few ``torch.cuda`` calls made here
with a fake device (tests/_fake_cuda.py).

Leaves out: several NCCL streams (torch uses one per group and device),
multi-GPU ranks.
References: torch.cuda.Event(enable_timing=True), Event.elapsed_time;
torch.distributed Work.wait semantics on NCCL (stream wait, not host wait);
ProcessGroupNCCL's one stream per device per group.
"""
from __future__ import annotations

from ddplab.timeline.clock import now


class CudaStamps:
    """Events for one rank's all-reduces and phases, resolved to CPU-clock seconds later."""

    def __init__(self, device=None):
        import torch

        self.cuda = cuda = torch.cuda
        self.device = device if device is not None else cuda.current_device()
        self.side = cuda.Stream(device=self.device)
        self.pending: list = []  # (bucket, kind, ready_event, end_event, grads), in launch order
        self.phases: list = []  # (phase name, start_event, end_event)
        self.splits: list = []  # (phase name, event, second phase name)
        self.stream_free = None  # when the last resolved collective ended (CPU clock)
        # Reference: an event that has certainly completed at CPU time ref_cpu.
        cuda.synchronize(self.device)
        self.ref = cuda.Event(enable_timing=True)
        self.ref.record()
        self.ref.synchronize()
        self.ref_cpu = now()

    def launched(self, work, bucket, kind, grads=None) -> None:
        """Call right after the collective was queued.

        ``work`` None: a blocking NCCL op (torch >= 2.8 returns no work for one) that ran on
        the caller's current stream, so its end is an event recorded there now (and its
        start is known only from ``grads``: the launch's event comes after the op).
        ``grads``: (first, last) events recorded when the bucket's first and last gradients
        became ready (None for one not recorded yet: the launch's event stands in); they
        become the bucket's ready times (source ``cuda_event``)."""
        cuda = self.cuda
        ready = cuda.Event(enable_timing=True)
        ready.record()  # compute stream: after the kernels that made the gradients
        end = cuda.Event(enable_timing=True)
        if work is None:
            end.record()  # after the op, on the stream it ran on
        else:
            self.side.wait_stream(cuda.current_stream(self.device))
            with cuda.stream(self.side):
                work.wait()  # the side stream now waits for NCCL's stream
                end.record(self.side)
        self.pending.append((bucket, kind, ready, end, grads))

    def phase_event(self):
        """An event recorded now on the compute stream (a phase boundary as the GPU sees it)."""
        e = self.cuda.Event(enable_timing=True)
        e.record()
        return e

    def add_phase(self, name, start_event, end_event) -> None:
        self.phases.append((name, start_event, end_event))

    def add_split(self, name, event, second) -> None:
        """Cut phase ``name`` at ``event``: the rest becomes phase ``second``."""
        self.splits.append((name, event, second))

    def to_cpu_clock(self, event) -> float:
        return self.ref_cpu + self.ref.elapsed_time(event) / 1000.0

    def resolve(self, recorder) -> None:
        """Synchronize once and hand the recorder GPU-timed phases and completions."""
        if not self.pending and not self.phases:
            return
        self.cuda.synchronize(self.device)
        t = self.to_cpu_clock
        spans = {name: (t(start), t(end)) for name, start, end in self.phases}
        for name, event, second in self.splits:
            if name in spans:
                start, end = spans[name]
                cut = min(max(t(event), start), end)
                spans[name], spans[second] = (start, cut), (cut, end)
        for name, (start, end) in spans.items():
            recorder.set_phase(name, start, end, "cuda_event")
        self.phases.clear()
        self.splits.clear()
        # the previous collective's end on the group's NCCL stream (kept across iterations:
        # nothing makes the next step's first bucket wait less for it)
        stream_free = self.stream_free
        for bucket, kind, ready, end, grads in self.pending:
            t_ready, t_end = t(ready), t(end)
            if grads is not None:  # the gradients' own events: when the bucket was ready
                first, last = grads  # None: that gradient had no event yet (ready by the launch)
                t_ready = t(last) if last is not None else t_ready
                first = min(t(first), t_ready) if first is not None else t_ready
                recorder.grad_ready(bucket, t_ready, source="cuda_event", first=first)
            t_start = t_ready if stream_free is None else min(max(t_ready, stream_free), t_end)
            stream_free = t_end
            recorder.record("done", t_end, bucket=bucket, kind=kind, start=t_start,
                            source="cuda_event", start_source="cuda_event_queued")
        self.stream_free = stream_free
        self.pending.clear()


class GradEvents:
    """Each parameter's gradient-ready moment as a GPU event (``ddplab.record`` on NCCL).

    The event is recorded in the parameter's post-accumulate-grad hook, on the stream that
    made the gradient, so it completes when the gradient really is there."""

    def __init__(self, timer: CudaStamps):
        self.timer = timer
        self.step: dict = {}  # parameter index -> (order, event), this step's
        self.all: list = []  # (GradRecord, event), every recorded step's

    def new_step(self) -> None:
        self.step = {}

    def ready(self, index: int, record):
        event = self.timer.phase_event()
        self.step[index] = (len(self.step), event)
        self.all.append((record, event))
        return event

    def span(self, indices):
        """(first, last) events of these parameters' gradients; last is None when one has
        no event yet (its hook runs after the launch: the launch's event stands in)."""
        got = [self.step.get(i) for i in indices]
        have = [g for g in got if g is not None]
        first = min(have, key=lambda g: g[0])[1] if have else None
        last = max(have, key=lambda g: g[0])[1] if have and len(have) == len(got) else None
        return first, last

    def resolve(self) -> None:
        """After the timer's synchronize: every GradRecord gets its GPU time."""
        for record, event in self.all:
            record.ready, record.source = self.timer.to_cpu_clock(event), "cuda_event"


def waits_from_buckets(timeline) -> None:
    """A GPU-timed run's wait per step: from backward's end to its last all-reduce's end."""
    for it in timeline.iterations:
        back = it.phases.get("backward")
        ends = [b.comm_end for b in timeline.buckets
                if b.iteration == it.iteration and b.comm_end is not None]
        if back is not None and ends and max(ends) > back[1]:
            it.phases["wait"] = (back[1], max(ends))
            it.sources["wait"] = "derived"
