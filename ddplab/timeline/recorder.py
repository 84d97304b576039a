"""Recorder: the rank-side notebook that the training loop and the choke point write into.

Teaches: what to stamp and from where. The loop stamps phases
(``with rec.phase("backward"):``); the communication choke point stamps each
bucket's grads-ready, launch and completion. Completion on gloo is stamped
by a callback on the work's future, which runs on one of gloo's background
threads the moment the result is there, not when the Python hook next looks.

On GPUs a CPU stamp is only when the host enqueued the all-reduce. Torch does
not expose NCCL's stream, so completion comes from a CUDA event recorded
after ``work.wait()`` on a side stream (source ``cuda_event``), and is
labelled so; ``TORCH_NCCL_ENABLE_TIMING=1`` with the work's duration is the
alternative torch offers. With a device timer every phase of an iteration,
the end-of-backward wait included, is taken from device events, so the
phases are on one clock (``cuda_events``).

A recorder that is off costs one attribute check per event: the choke point
holds ``None`` instead of a recorder.

Leaves out: memory, kernel-level GPU activity (use torch.profiler for those).
"""
from __future__ import annotations

import contextlib
import threading

from ddplab.timeline.clock import now
from ddplab.timeline.records import BucketRecord, IterationRecord, Timeline


class Recorder:
    def __init__(self, strategy: str, rank: int, world_size: int, backend: str = "gloo",
                 meta: dict | None = None):
        self.timeline = Timeline(strategy, world_size, backend, meta=dict(meta or {}))
        self.rank = rank
        self._it: IterationRecord | None = None
        self._buckets: dict[int, BucketRecord] = {}
        self._lock = threading.Lock()  # completion stamps arrive on gloo's threads
        # Launched, not yet completed, per bucket index, oldest first: a completion
        # may arrive just after the loop moved on to the next iteration (a future's
        # callbacks can run after wait() has returned), and still finds its record.
        self._in_flight: dict[int, list] = {}
        # On GPUs: a ddplab.timeline.cuda_events.CudaStamps (ddplab.contracts.protocols'
        # DeviceTimer); the choke point then times all-reduces with CUDA events,
        # resolved at the end of each iteration.
        self.device_timer = None

    @property
    def cuda_stamps(self):  # the name used before the protocol had one
        return self.device_timer

    @cuda_stamps.setter
    def cuda_stamps(self, timer):
        self.device_timer = timer

    # -- iterations and phases (called by the training loop) -------------------
    def begin_iteration(self, iteration: int, flags=()) -> None:
        self.end_iteration()
        self._it = IterationRecord(self.rank, iteration, start=now(), flags=set(flags))
        self._buckets = {}

    def flag(self, *flags: str) -> None:
        if self._it is not None:
            self._it.flags.update(flags)

    @contextlib.contextmanager
    def phase(self, name: str, source: str = "cpu"):
        t0 = now()
        gpu = self.device_timer
        e0 = gpu.phase_event() if gpu is not None else None
        try:
            yield
        finally:
            if self._it is not None:
                self._it.phases[name] = (t0, now())
                self._it.sources[name] = source
                if gpu is not None:  # replaced by GPU time when the iteration ends
                    gpu.add_phase(name, e0, gpu.phase_event())

    def set_phase(self, name: str, start: float, end: float, source: str) -> None:
        if self._it is not None:
            self._it.phases[name] = (start, end)
            self._it.sources[name] = source

    def phase_span(self, name: str):
        """(start, end) of ``name`` in the current iteration, or None."""
        return None if self._it is None else self._it.phases.get(name)

    def split_phase(self, name: str, at: float, second: str, source: str = "derived",
                    event=None) -> bool:
        """Cut the current iteration's phase ``name`` at ``at``: ``name`` keeps the
        first part, ``second`` gets the rest (stamped with ``source``).

        E.g. torch DDP waits for its buckets INSIDE backward: its last grad-ready
        splits "backward" into backward's compute and the "wait". Returns False
        (and changes nothing) when ``at`` is not inside the phase. With a device
        timer the phases are GPU times, so the cut needs the device ``event``
        recorded at that moment; a host time alone is refused (False), never mixed in.
        """
        if self.device_timer is not None:
            if event is None or self._it is None:
                return False
            self.device_timer.add_split(name, event, second)
        span = self.phase_span(name)
        if span is None or at is None or not span[0] <= at <= span[1]:
            return False
        self._it.phases[name] = (span[0], at)
        self._it.phases[second] = (at, span[1])
        self._it.sources[second] = source
        return True

    def end_iteration(self) -> None:
        if self._it is None:
            return
        if self.device_timer is not None:
            self.device_timer.resolve(self)  # one synchronize per iteration, after the step
        self._it.end = now()
        back, wait = self._it.phases.get("backward"), self._it.phases.get("wait")
        if back and wait and back[0] <= wait[0] <= back[1]:
            # The wait ran inside loss.backward() (the autograd engine's final
            # callback): backward's compute ended where the wait began.
            self._it.phases["backward"] = (back[0], wait[0])
        with self._lock:
            self.timeline.iterations.append(self._it)
            self.timeline.buckets.extend(self._buckets[i] for i in sorted(self._buckets))
        self._it, self._buckets = None, {}

    # -- buckets (called by ddplab.sync.comm) ------------------------------------
    def _bucket(self, index: int) -> BucketRecord | None:
        if self._it is None:
            return None
        b = self._buckets.get(index)
        if b is None:
            b = self._buckets[index] = BucketRecord(self.rank, self._it.iteration, index, 0)
        return b

    def grad_ready(self, index: int, t: float | None = None, source: str = "cpu",
                   first: float | None = None) -> None:
        """The bucket's last gradient is ready at ``t`` (its first at ``first``, when known)."""
        b = self._bucket(index)
        if b is not None:
            t = now() if t is None else t
            if first is not None:
                b.grads_ready_first = first
            elif b.grads_ready_first is None:
                b.grads_ready_first = t
            b.grads_ready = t
            b.sources["grads_ready"] = source

    def launch(self, index: int, nbytes: int, params=(), t: float | None = None) -> BucketRecord | None:
        """The bucket handed to the backend; its record (None outside an iteration)."""
        b = self._bucket(index)
        if b is not None:
            b.launch = now() if t is None else t
            b.nbytes, b.params = nbytes, tuple(params)
            b.sources["launch"] = "cpu"
            with self._lock:
                self._in_flight.setdefault(index, []).append(b)
            if b.grads_ready is None:  # manual strategies: ready = launched after backward
                b.grads_ready = b.launch
                b.sources["grads_ready"] = "derived"
        return b

    def comm_done(self, index: int, t: float | None = None, source: str = "cpu",
                  start: float | None = None, start_source: str | None = None,
                  simulated: bool = False) -> None:
        with self._lock:
            waiting = self._in_flight.get(index)
            if not waiting:
                return
            b = waiting.pop(0)
            b.comm_end = now() if t is None else t
            b.sources["comm_end"] = source
            if start is not None:
                b.comm_start = start
                b.sources["comm_start"] = start_source or source
            b.simulated = b.simulated or simulated

    # -- the protocol ddplab.sync.comm speaks: record(event, t, **info) ---------
    def record(self, event: str, t: float, **info) -> None:
        kind = info.get("kind", "grad")
        if event == "grad_ready" and info.get("bucket") is not None:
            self.grad_ready(info["bucket"], t)
        elif event == "launch" and kind == "grad" and info.get("bucket") is not None:
            self.launch(info["bucket"], info.get("nbytes", 0), info.get("params", ()), t)
        elif event == "done" and kind == "grad" and info.get("bucket") is not None:
            self.comm_done(info["bucket"], t, source=info.get("source", "cpu"),
                           start=info.get("start"), start_source=info.get("start_source"),
                           simulated=info.get("simulated", False))
        elif event == "wait_start":
            self._wait_start = t
            gpu = self.device_timer  # the wait as the GPU sees it, on the phases' clock
            self._wait_event = gpu.phase_event() if gpu is not None else None
        elif event == "wait_end" and self._it is not None:
            start = getattr(self, "_wait_start", None)
            self._it.phases["wait"] = (t if start is None else start, t)
            self._it.sources["wait"] = "cpu"
            self._wait_start = None
            if getattr(self, "_wait_event", None) is not None:
                self.device_timer.add_phase("wait", self._wait_event, self.device_timer.phase_event())
                self._wait_event = None

    def result(self) -> Timeline:
        self.end_iteration()
        return self.timeline
