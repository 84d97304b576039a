"""The one choke point every gradient synchronization talks through.

Teaches: a data-parallel strategy is "compute locally, then make the ranks
agree". All the agreeing here happens in three functions, ``all_reduce``,
``broadcast`` and ``broadcast_coalesced``, so there is exactly one place
that

- counts what was sent: payload bytes and calls per *kind* of traffic
  (``"grad"`` for gradient all-reduces, ``"params"`` and ``"buffers"`` for
  broadcasts from rank 0, ``"used_map"`` for find_unused_parameters'
  small all-reduce) and, for gradients, bytes per bucket and the order
  buckets were launched in. Wrap one training step in ``with counting() as c``
  to get that step's numbers;
- tells an optional recorder when things happened (``grad_ready``,
  ``launch``, ``done``, ``wait_start``, ``wait_end``; see below). With
  no recorder the cost is one ``is None`` test per call;
- applies the simulated link (ddplab.netsim) where the process group does not
  (``ddplab.sync.links``: on a rank's observing groups the link sits on the group).

Payload bytes are what each rank hands to the collective (numel x element
size), the number the lab calls ``comm_bytes_per_step``. What a ring
all-reduce really puts on each link is 2(p-1)/p times that; the metrics
module converts.

``torch.distributed.all_reduce`` is looked up when each call is made, not at
import, so a test or a lab can patch it and see every strategy go through it.

Comm hooks (``comm_hooks.py``) send through ``all_reduce`` too, so a
compressed bucket is counted at its compressed size. Leaves out, compared
with torch's reducer: NCCL stream handling, coalescing managers. Every call
here is also a plain torch collective: what is in flight is real gloo/nccl
work.

References: torch.distributed.all_reduce / broadcast (async_op=True returns a
``Work``; ``Work.get_future()``); torch/csrc/distributed/c10d/reducer.cpp.
"""
from __future__ import annotations

import contextlib
import os
from collections import Counter

import torch
import torch.distributed as dist

from ddplab.contracts.clock import now
from ddplab.contracts.protocols import EventRecorder  # noqa: F401 - what recorders look like
from ddplab.pg import backend as rank_backend
from ddplab.pg.inner import payload_bytes
from ddplab.sync.links import link, link_on, link_paused, set_link, using_link  # noqa: F401 - set_link, using_link: ddplab.sync.comm's names
from ddplab.timeline.on_group import record_launch

# Stamps are seconds on this rank's clock (ddplab.contracts.clock, the one clock every
# layer shares); ddplab.timeline moves them onto rank 0's clock later.

# What a recorder receives (``ddplab.contracts.protocols.EventRecorder``:
# ``record(event, t, **info)``, ``t`` from ``now()``):
# - "grad_ready": bucket, param (name): a gradient is final for this backward;
# - "launch": bucket, kind, nbytes, params (names): handed to the backend;
# - "done": bucket, kind (and start, simulated=True, source over a simulated
#   link): the result is available. It comes from a callback on the work's
#   future, on the backend's own thread, so it may arrive out of order and
#   while the main thread is still in backward. For a CPU tensor (gloo);
# - "enqueued": the same callback for a device tensor (NCCL): torch completes
#   such a future once the collective is queued on the GPU, so its host stamp
#   says nothing about when the transfer ran (a device timer says that);
# - "wait_start" / "wait_end": the strategy's end-of-backward wait.
# ``bucket`` is the bucket index (per-parameter strategies: the parameter's
# index; None for broadcasts).


class ListRecorder:
    """Keeps every event as ``(event, t, info)``; enough for tests and notebooks."""

    def __init__(self):
        self.events: list = []

    def record(self, event, t, **info):
        # list.append is atomic under the GIL, so gloo's threads may call this too.
        self.events.append((event, t, info))

    def of(self, event: str, **match) -> list:
        """The events named ``event`` whose info has every ``match`` item."""
        return [(t, info) for e, t, info in self.events
                if e == event and all(info.get(k) == v for k, v in match.items())]

    def first(self, event: str, **match) -> float | None:
        ts = [t for t, _ in self.of(event, **match)]
        return min(ts) if ts else None

    def clear(self) -> None:
        self.events.clear()


class CommCounter:
    """Calls and payload bytes seen at the choke point.

    ``calls`` and ``bytes`` are keyed by kind (``"grad"``, ``"params"``,
    ``"buffers"``, ``"used_map"``). ``bucket_bytes`` maps a gradient bucket's index to the
    bytes it carried, and ``launch_order`` lists gradient buckets in the
    order their all-reduces were launched.
    """

    def __init__(self):
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()
        self.bucket_bytes: dict = {}
        self.launch_order: list = []

    @property
    def grad_calls(self) -> int:
        return self.calls["grad"]

    @property
    def grad_bytes(self) -> int:
        return self.bytes["grad"]

    def add(self, kind: str, nbytes: int, bucket) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        if kind == "grad" and bucket is not None:
            self.bucket_bytes[bucket] = self.bucket_bytes.get(bucket, 0) + nbytes
            self.launch_order.append(bucket)

    def __repr__(self):
        return (f"CommCounter(calls={dict(self.calls)}, bytes={dict(self.bytes)}, "
                f"buckets={len(self.bucket_bytes)})")


# Everything since this process imported ddplab.sync; plus any counters
# opened with ``counting()`` (nested blocks each see their own traffic).
totals = CommCounter()
_open_counters: list = [totals]


@contextlib.contextmanager
def counting():
    """``with counting() as c: step()`` -> ``c`` holds what that step sent."""
    c = CommCounter()
    _open_counters.append(c)
    try:
        yield c
    finally:
        _open_counters.remove(c)


def _count(kind, nbytes, bucket):
    for c in _open_counters:
        c.add(kind, nbytes, bucket)


def _after_launch(work, group, recorder, kind, nbytes, bucket, params, device, linked_here=False,
                  op="all_reduce"):
    """Route ``work`` over the simulated link (if the group does not) and stamp launch and done.

    The link (``ddplab.sync.links``) sits on every observing process group; on any other group,
    or for a transfer made of several collectives (``linked_here``), it is applied here."""
    installed = link()
    if installed is not None and (linked_here or not link_on(group)):
        # the device: a GPU's simulated work must make the GPU wait for the real one
        work = installed.wrap(work, nbytes, group, device=device, op=op)
    if recorder is not None:
        record_launch(recorder, _linked(work), bucket=bucket, kind=kind, nbytes=nbytes,
                      params=params, on_device=device.type != "cpu")
    return work


def _linked(work):
    """The simulated work behind an observing group's work, if a link wrapped it."""
    inner = getattr(work, "work", None)
    return inner if hasattr(inner, "done_stamp") else work


# ``make test-gpu`` sets DDPLAB_REQUIRE_DEVICE_GRADS=1: on an NCCL rank a gradient
# all-reduce of a CPU tensor then raises. The group would carry it (through gloo),
# but a lab that left its model on the CPU would time the wrong thing in silence.
REQUIRE_DEVICE_GRADS = os.environ.get("DDPLAB_REQUIRE_DEVICE_GRADS") == "1"


def _nccl(group) -> bool:
    return rank_backend.backend_name(group) == "nccl"

_cpu_on_purpose = 0  # open cpu_gradients_on_purpose() blocks (any thread: torch DDP's hooks too)


@contextlib.contextmanager
def cpu_gradients_on_purpose():
    """Within the block, CPU gradients on an NCCL rank are intended: what the code shows does
    not depend on the device (a float64 reference, bytes counted, a simulated link's wait)."""
    global _cpu_on_purpose
    _cpu_on_purpose += 1
    try:
        yield
    finally:
        _cpu_on_purpose -= 1


def _check_device(tensor, group, kind) -> None:
    if kind == "grad" and not _cpu_on_purpose and tensor.device.type == "cpu" and _nccl(group):
        raise RuntimeError(
            f"a gradient all-reduce on an NCCL rank carried a CPU tensor ({tuple(tensor.shape)}, "
            f"{tensor.dtype}): the model or its data stayed on the CPU. Put them on "
            "ddplab.device() (DDPLAB_REQUIRE_DEVICE_GRADS=1 makes this an error).")


def all_reduce(tensor: torch.Tensor, group=None, async_op: bool = False, *, op=None,
               kind: str = "grad", bucket=None, params=(), recorder=None):
    """``torch.distributed.all_reduce`` (SUM by default), counted and recorded.

    With ``async_op=True`` returns the work (``.wait()``, ``.get_future()``);
    otherwise waits and returns ``None``, as torch does.
    """
    if REQUIRE_DEVICE_GRADS:
        _check_device(tensor, group, kind)
    nbytes = payload_bytes(tensor)  # for a sparse tensor, this rank's indices and values
    _count(kind, nbytes, bucket)
    if tensor.is_sparse and _nccl(group):  # NCCL has no sparse all-reduce: gather instead
        from ddplab.sync.sparse_gather import all_reduce_by_gather

        if op not in (None, dist.ReduceOp.SUM):
            raise ValueError(f"a sparse all-reduce on an NCCL rank can only SUM, not {op}")
        with link_paused(group):  # its gathers are one transfer of nbytes, delayed once below
            work = all_reduce_by_gather(tensor, group)
        return _finish(_after_launch(work, group, recorder, kind, nbytes, bucket, params,
                                     tensor.device, linked_here=True), async_op)
    # looked up now, not at import: whoever patches torch.distributed sees us
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group,
                           async_op=True)
    return _finish(_after_launch(work, group, recorder, kind, nbytes, bucket, params,
                                 tensor.device), async_op)


def _finish(work, async_op):
    """torch's convention: the work with ``async_op=True``, else wait and return None."""
    if async_op:
        return work
    work.wait()
    return None


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, *,
              kind: str = "params", recorder=None):
    """``torch.distributed.broadcast`` from global rank ``src``, counted and recorded."""
    nbytes = tensor.numel() * tensor.element_size()
    _count(kind, nbytes, None)
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    return _finish(_after_launch(work, group, recorder, kind, nbytes, None, (), tensor.device,
                                 op="broadcast"), async_op)


def broadcast_coalesced(tensors, src: int, group=None, *, kind: str = "buffers", recorder=None):
    """Broadcast many tensors with one collective per dtype/device.

    Copies each group into one flat buffer, broadcasts it, and copies back:
    a BatchNorm's three buffers then cost one or two broadcasts, not three.
    """
    groups: dict = {}
    for t in tensors:
        # .data: same storage, its own version counter. Writing through it
        # leaves the buffer's counter alone (as torch's buffer sync does), so
        # a graph that saved the buffer in an earlier forward stays valid.
        groups.setdefault((t.dtype, t.device), []).append(t.data)
    with torch.no_grad():
        for ts in groups.values():
            if len(ts) == 1:
                broadcast(ts[0], src, group, kind=kind, recorder=recorder)
                continue
            flat = torch.cat([t.reshape(-1) for t in ts])
            broadcast(flat, src, group, kind=kind, recorder=recorder)
            offset = 0
            for t in ts:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def record(recorder, event: str, **info) -> None:
    """Strategies call this for their own events; a no-op with no recorder."""
    if recorder is not None:
        recorder.record(event, now(), **info)
