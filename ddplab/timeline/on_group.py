"""Drawing a reducer from outside: record what the observing process group is handed.

Teaches: a timeline of gradient synchronization needs no cooperation from the
code that synchronizes. Every all-reduce reaches the rank's process group
(``ddplab.cluster.observed``), whoever makes it: torch DDP's C++ reducer, the
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

``record_launch`` is the one place a launch and its end are stamped: ddplab's
own strategies (``ddplab.sync.comm``) stamp through it too.

Leaves out, compared with a reducer that records itself: which parameters a
bucket holds (the group sees a flat buffer; torch DDP's layout comes from its
logging data, ``ddplab.sync.ddp_trace``), and anything that is not an
all-reduce (broadcasts, gathers) as a bucket. The group sees tensors, not
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

from ddplab.cluster.observed import Observing, observing
from ddplab.cluster.wrapped import payload_bytes
from ddplab.contracts.clock import now


def record_launch(recorder, work, *, bucket, kind, nbytes, params=(), on_device=False):
    """Stamp "launch" now and "done" (or, on a device, "enqueued") when ``work`` completes.

    Over a simulated link ``work`` has ``done_stamp()``: the stamp is the modelled end and
    says who decided it. On NCCL without a link a device timer, if the recorder has one,
    times the transfer on the GPU instead (a host callback would only say it was queued).
    """
    recorder.record("launch", now(), bucket=bucket, kind=kind, nbytes=nbytes, params=tuple(params))
    linked = hasattr(work, "done_stamp")
    timer = getattr(recorder, "device_timer", None)  # optional part of EventRecorder
    if timer is not None and not linked:
        timer.launched(work, bucket, kind)
        return

    def stamp_done(_fut):
        extra = work.done_stamp() if linked else {}
        event = "enqueued" if on_device and not linked else "done"
        recorder.record(event, now(), bucket=bucket, kind=kind, **extra)

    work.get_future().then(stamp_done)


class GroupRecorder(Observing):
    """Watches the observing group: each iteration's all-reduces become its buckets.

    ``recorder``: a ``ddplab.timeline.recorder.Recorder`` (None: count only);
    ``params``: the parameters whose gradient-ready moments to stamp (before the
    reducer that uses them is built). Call ``begin_iteration()`` before each
    iteration and ``end_iteration()`` after its backward and synchronization.
    """

    def __init__(self, recorder=None, params=()):
        self.recorder = recorder
        self.launches: list[list[int]] = []  # per finished iteration: elements per all-reduce
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready)
                         for p in params if p.requires_grad] if recorder is not None else []
        self.begin_iteration()

    def begin_iteration(self) -> None:
        self.sizes: list[int] = []  # this iteration's all-reduces, in launch order
        self.nbytes = 0
        self.on_cpu = False  # did an all-reduce carry a CPU tensor (on a GPU rank: a mistake)
        self.last_ready = None  # the newest gradient-ready stamp not yet given to a launch
        self.backward_end = None  # the newest gradient-ready stamp of the iteration
        self.backward_end_event = None

    def _grad_ready(self, _param) -> None:
        self.last_ready = self.backward_end = now()
        timer = getattr(self.recorder, "device_timer", None)
        if timer is not None:  # the same moment on the GPU's clock
            self.backward_end_event = timer.phase_event()

    @contextlib.contextmanager
    def watching(self, group=None):
        """Within the block, this recorder sees every op on the (default) observing group."""
        with observing(self, group):
            yield self

    # -- the observer's side (ddplab.contracts.protocols.Observer) ------------------------
    def launched(self, op, tensors, group, peer):
        if op != "all_reduce":
            return None
        index = len(self.sizes)
        self.sizes.append(sum(t.numel() for t in tensors))
        nbytes = sum(payload_bytes(t) for t in tensors)
        self.nbytes += nbytes
        self.on_cpu = self.on_cpu or any(t.device.type == "cpu" for t in tensors)
        if self.recorder is None:
            return None
        if self.last_ready is not None:  # the gradient whose hook launched this bucket
            self.recorder.record("grad_ready", self.last_ready, bucket=index)
            self.last_ready = None
        return index, nbytes, any(t.device.type != "cpu" for t in tensors)

    def started(self, token, work):
        if token is not None:
            index, nbytes, on_device = token
            record_launch(self.recorder, work, bucket=index, kind="grad", nbytes=nbytes,
                          on_device=on_device)
        return None

    def end_iteration(self) -> dict:
        """This iteration's facts: where backward's compute ended (the last gradient-ready
        stamp, and its device event) and how many all-reduces it launched."""
        self.launches.append(self.sizes)
        out = {"backward_compute_end": self.backward_end, "n_buckets": len(self.sizes),
               "backward_compute_end_event": self.backward_end_event, "nbytes": self.nbytes,
               "on_cpu": self.on_cpu}
        self.begin_iteration()
        return out

    def remove(self) -> None:
        """Take the gradient-ready hooks off the parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []
