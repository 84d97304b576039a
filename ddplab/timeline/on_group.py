"""Drawing a reducer from outside: record what the observing process group is handed.

Teaches: a timeline of gradient synchronization needs no cooperation from the
code that synchronizes. Every all-reduce reaches the rank's process group
(``ddplab.pg.group``), whoever makes it: torch DDP's C++ reducer, the
reference reducers in ``ddplab.sync.core``, a learner's class. A
``GroupRecorder`` installed on that group (``with rec.watching():``) turns the
all-reduces of one iteration into that iteration's buckets, numbered in the
order they were launched:

- "launch": when the group was handed the tensor, and its payload bytes;
- "done": when the work's future completed (over a simulated link, the
  link's modelled end and who decided it);
- "grad_ready": the last gradient that became final before the launch.
  Post-accumulate-grad hooks stamp each gradient; they are registered
  before the reducer's own hooks (``params=`` at construction, before the
  reducer is built; torch DDP's hooks run after any of these), so the
  gradient whose hook launched a bucket has been stamped when it launches.
  Only the first launch after a stamp gets it: buckets launched together
  (held for an earlier one) are drawn ready at their launch (``derived``).

It also counts the bytes and calls of each iteration: a strategy that does
not count its own traffic gets ``comm_bytes_per_step`` from here.

Sharded data parallel (FSDP, torch's ``fully_shard``) makes all-gathers and
reduce-scatters instead, and a sharded optimizer (ZeRO-1: ddplab's
``ShardedOptimizer``, torch's ``ZeroRedundancyOptimizer``) broadcasts each
owner's updated parameters after its step (drawn when the recorder is made
with ``broadcasts=True``): each one is drawn as a bucket too,
in launch order, with its ``op`` and ``phase``: "backward" when made while the
autograd engine runs a node, "forward" before that, "after backward" after,
or the phase the block names (``watching(phase="step")`` around an
optimizer's step). Bytes are counted two ways. ``nbytes``: the payload handed
to the group (what a rank passes in: its shard for an all-gather, the full
tensor for the others). ``ring_bytes``: what each rank sends over a ring of
p ranks for that call, the textbook cost: all-reduce of N bytes 2(p-1)/p N
(it IS a reduce-scatter then an all-gather), reduce-scatter of N bytes
(p-1)/p N, all-gather of shards s (p-1) s, and broadcast of N bytes along a
chain (every rank but the last forwards N bytes) (p-1)/p N per rank on
average: the root and the middle ranks send N, the last sends nothing.
FSDP's two all-gathers and one reduce-scatter of N bytes of weights send
3(p-1)/p N: 1.5x DDP's one all-reduce (docs/facts.md); so do ZeRO-1's
all-reduce of the gradients and broadcast of the parameters.

``record_launch`` is the one place a launch and its end are stamped: ddplab's
own strategies (``ddplab.sync.comm``) stamp through it too.

Leaves out, compared with a reducer that records itself: which parameters a
bucket holds (the group sees a flat buffer; torch DDP's layout comes from its
logging data, ``ddplab.sync.ddp_trace``), and lists of gathers and
point-to-point calls (not drawn, not counted). The group sees tensors, not
buckets: EVERY all-reduce in the window is drawn as one, also one made for
another purpose (a logged loss, ``find_unused_parameters``' map of used
parameters, PowerSGD's two per bucket). That is why ddplab's full reducers,
which make such calls, stamp their own buckets (``ddplab.sync.comm``). On NCCL the device timer stamps
the transfer (never run on a GPU where this was written).
References: torch.Tensor.register_post_accumulate_grad_hook;
torch/csrc/distributed/c10d/reducer.cpp (mark_bucket_ready launches buckets
in index order).
"""
from __future__ import annotations

import contextlib

import torch

from ddplab.contracts.clock import now
from ddplab.pg.group import ObserverBase, observe
from ddplab.pg.inner import payload_bytes
from ddplab.pg.works import ForwardingWork


def record_launch(recorder, work, *, bucket, kind, nbytes, params=(), on_device=False):
    """Stamp "launch" now and "done" (or, on a device, "enqueued") when ``work`` completes;
    returns the future that completes once "done" is stamped (None with a device timer).

    Over a simulated link ``work`` has ``done_stamp()``: the stamp is the modelled end and
    says who decided it. On NCCL without a link a device timer, if the recorder has one,
    times the transfer on the GPU instead (a host callback would only say it was queued).
    """
    recorder.record("launch", now(), bucket=bucket, kind=kind, nbytes=nbytes, params=tuple(params))
    linked = hasattr(work, "done_stamp")
    timer = getattr(recorder, "device_timer", None)  # optional part of EventRecorder
    if timer is not None and not linked:
        timer.launched(work, bucket, kind)
        return None

    def stamp_done(_fut):
        extra = work.done_stamp() if linked else {}
        event = "enqueued" if on_device and not linked else "done"
        recorder.record(event, now(), bucket=bucket, kind=kind, **extra)

    return work.get_future().then(stamp_done)


class _StampedAtWait(ForwardingWork):
    """A work without a future (gloo's reduce-scatter): stamps "done" when its wait returns."""

    def __init__(self, work, stamp):
        super().__init__(work)
        self.stamp = stamp

    def wait(self, timeout=None):
        ok = self.work.wait() if timeout is None else self.work.wait(timeout)
        self.stamp()
        return ok


# Bytes each rank sends on a ring of p ranks, per payload byte handed to the group.
RING_FACTOR = {
    "all_reduce": lambda p: 2 * (p - 1) / p,  # a reduce-scatter, then an all-gather
    "reduce_scatter_tensor": lambda p: (p - 1) / p,  # handed the full tensor
    "all_gather_into_tensor": lambda p: p - 1,  # handed its shard: sends it to p-1 ranks
    "broadcast": lambda p: (p - 1) / p,  # along a chain p-1 ranks forward it: per rank on average
}


class GroupRecorder(ObserverBase):
    """Watches the observing group: each iteration's all-reduces become its buckets.

    ``recorder``: a ``ddplab.timeline.recorder.Recorder`` (None: count only);
    ``params``: the parameters whose gradient-ready moments to stamp (before the
    reducer that uses them is built); ``broadcasts``: draw and count broadcasts too
    (a sharded optimizer's step). Off by default: torch DDP also broadcasts rank 0's
    buffers before each forward (``broadcast_buffers``), which is not gradient
    synchronization. Call ``begin_iteration()`` before each iteration and
    ``end_iteration()`` after its backward and synchronization.
    """

    def __init__(self, recorder=None, params=(), broadcasts=False):
        self.recorder = recorder
        self.ops = set(RING_FACTOR) - (set() if broadcasts else {"broadcast"})
        self.launches: list[list[int]] = []  # per finished iteration: elements per all-reduce
        self.named_phase = None  # the phase watching(phase=...) names, e.g. "step"
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready)
                         for p in params if p.requires_grad] if recorder is not None else []
        self.begin_iteration()

    def begin_iteration(self) -> None:
        self.sizes: list[int] = []  # this iteration's all-reduces, in launch order
        self.nbytes = 0
        self.ring_bytes = 0  # each rank's bytes on a ring (see the module docstring)
        self.calls: list[tuple] = []  # (op, phase, payload bytes) of every drawn collective
        self.seen_backward = False
        self.on_cpu = False  # did an all-reduce carry a CPU tensor (on a GPU rank: a mistake)
        self.last_ready = None  # the newest gradient-ready stamp not yet given to a launch
        self.backward_end = None  # the newest gradient-ready stamp of the iteration
        self.backward_end_event = None
        # the futures that complete once a "done" is stamped: end_iteration waits for them, as
        # a work's wait() can return before the callbacks on its future have run
        self.stamping: list = []

    def _grad_ready(self, _param) -> None:
        self.last_ready = self.backward_end = now()
        timer = getattr(self.recorder, "device_timer", None)
        if timer is not None:  # the same moment on the GPU's clock
            self.backward_end_event = timer.phase_event()

    @contextlib.contextmanager
    def watching(self, group=None, phase=None):
        """Within the block, this recorder sees every op on the (default) observing group;
        ``phase`` names the phase of the calls made in it (e.g. "step")."""
        self.named_phase = phase
        try:
            with observe(self, group):
                yield self
        finally:
            self.named_phase = None

    # -- the observer's side (ddplab.contracts.protocols.Observer) ------------------------
    def launched(self, op, tensors, group, peer):
        if op not in self.ops:
            return None
        index = len(self.calls)
        if op == "all_reduce":
            self.sizes.append(sum(t.numel() for t in tensors))
        nbytes = sum(payload_bytes(t) for t in tensors)
        self.nbytes += nbytes
        self.ring_bytes += RING_FACTOR[op](group.size()) * nbytes
        if self.named_phase is not None:
            phase = self.named_phase
        elif torch._C._current_autograd_node() is not None:  # the engine is running a node
            phase, self.seen_backward = "backward", True
        else:  # torch's fully_shard reduce-scatters its last layer in backward's final callback
            phase = "after backward" if self.seen_backward or self.backward_end else "forward"
        self.calls.append((op, phase, nbytes))
        self.on_cpu = self.on_cpu or any(t.device.type == "cpu" for t in tensors)
        if self.recorder is None:
            return None
        if self.last_ready is not None:  # the gradient whose hook launched this bucket
            self.recorder.record("grad_ready", self.last_ready, bucket=index)
            self.last_ready = None
        return index, nbytes, any(t.device.type != "cpu" for t in tensors)

    def started(self, token, work):
        if token is None:
            return None
        index, nbytes, on_device = token
        try:
            work.get_future()
        except RuntimeError:  # gloo's reduce-scatter has none: "done" is when its wait returns
            self.recorder.record("launch", now(), bucket=index, kind="grad", nbytes=nbytes,
                                 params=self.calls[index][:2])
            return _StampedAtWait(work, lambda: self.recorder.record(
                "done", now(), bucket=index, kind="grad"))
        stamped = record_launch(self.recorder, work, bucket=index, kind="grad", nbytes=nbytes,
                                params=self.calls[index][:2], on_device=on_device)
        if stamped is not None:
            self.stamping.append((work.get_future(), stamped))
        return None

    def end_iteration(self) -> dict:
        """This iteration's facts: where backward's compute ended (the last gradient-ready
        stamp, and its device event) and how many all-reduces it launched."""
        for fut, stamped in self.stamping:  # each finished launch's "done" is recorded by now
            if fut.done():  # (one still running, or hung, is not waited for here)
                with contextlib.suppress(RuntimeError):
                    stamped.wait()
        self.launches.append(self.sizes)
        out = {"backward_compute_end": self.backward_end, "n_buckets": len(self.sizes),
               "backward_compute_end_event": self.backward_end_event, "nbytes": self.nbytes,
               "on_cpu": self.on_cpu, "ring_bytes": self.ring_bytes, "calls": self.calls}
        self.begin_iteration()
        return out

    def remove(self) -> None:
        """Take the gradient-ready hooks off the parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []
