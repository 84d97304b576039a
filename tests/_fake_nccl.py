"""A fake ``ProcessGroupNCCL`` for CPU tests: torch 2.13's NCCL contract, data moved by real gloo.

There is no GPU here, so NCCL code runs against this. It keeps the contract the
observing group (ddplab/pg/group.py) must live with, each point as
ProcessGroupNCCL.hpp/.cpp and distributed_c10d.py (torch 2.13) have it:

- A blocking collective (``opts.asyncOp`` False, as c10d passes it since
  torch 2.8) returns **None**, for every collective kind; barrier too.
- With ``asyncOp`` True it returns a work whose future is **complete at
  enqueue** and holds the outputs (a coalesced block's: ``[]``);
  ``is_completed()`` turns True only when the transfer ended; ``result()``
  gives the outputs; ``is_success()`` raises NotImplementedError
  ("WorkNCCL::isSuccess() is deprecated").
- ``wait()`` without a limit is a stream wait; ``wait(timeout)`` blocks the host
  and, past the limit, raises ``DistBackendError`` with NCCL's own text
  ("... WorkNCCL(SeqNum=N, OpType=ALLREDUCE, ...) ran for N milliseconds
  before timing out.") and aborts the communicator: later ops raise.
- One group depth **per thread, shared by every instance**
  (``_start_coalescing``/``_end_coalescing``): an op issued on any instance
  while a group is open joins it (``FakeNCCL.swallowed`` lists collectives
  that did) and runs only when the group ends; a communicator connected while a
  group is open ends it (``FakeNCCL.groups_ended_by_connect``).
- ``barrier`` ignores ``opts.device``: ``device_ids[0]``, else the first device
  the group used (eager connection counts), else ``rank % device_count``
  (``barrier_devices`` lists each choice, ``barrier_reasons`` which rule made it).
- Connection is lazy (at the first op, which every rank must then reach:
  here a gloo group's constructor, which waits for all ranks) unless
  ``eager_connect_single_device(device)`` ran (``connected``: "eager",
  the first op's name, or None).
- ``shutdown()`` and ``abort()``: later ops raise ``DistBackendError``.

Where it differs, because the host is the device here: a blocking op has run
when it returns (NCCL's returns before it runs; a hang blocks the host at the
op, not at the next host sync), and a stream wait waits on the host too; a
future is complete at enqueue but its tensors are only certain after the
work's ``wait()`` (on a GPU, stream order makes them so for later kernels).

API for tests, and for the recording's CUDA-event stamping (tests/_fake_cuda.py):

- ``installed(device_count=2, gpu=0, cuda=None)``: a context manager (and
  ``install(...)``, its undo-less form for rank processes) that makes
  ``dist.ProcessGroupNCCL`` this class, sends every tensor of an observing
  group to its NCCL half (``inner.on_gpu``) and names ``cuda:<gpu>`` the
  rank's GPU (``inner.current_gpu``). ``cuda``: a ``_fake_cuda.Device``
  whose streams the works use (else streams are plain labels).
- ``FakeNCCL.instances`` (every one made), ``.ops`` ((op, blocking) in issue
  order), ``.works``, ``.env`` (the TORCH_NCCL_* settings it was made under),
  ``.barrier_devices``, ``.connected``, ``.shut``, ``.aborted``, ``.stream``
  (the group's NCCL stream). With ``cuda``, an op queued on a stream keeps it
  busy ``FakeNCCL.op_seconds`` after the later of the host's now and what that
  stream (for an async op, also the caller's current stream, which NCCL's waits
  for) already holds.
- ``FakeWork.stream``: where the op ran: the caller's current stream for a
  blocking op, the group's NCCL stream otherwise; ``.op``, ``.seq``,
  ``.outputs``, ``.enqueued_at`` (time.monotonic()).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time

import torch
import torch.distributed as dist

OP_TYPES = {"allreduce": "ALLREDUCE", "allreduce_coalesced": "COALESCED", "broadcast": "BROADCAST",
            "reduce": "REDUCE", "allgather": "ALLGATHER", "allgather_coalesced": "COALESCED",
            "_allgather_base": "_ALLGATHER_BASE", "allgather_into_tensor_coalesced": "COALESCED",
            "gather": "GATHER", "scatter": "SCATTER", "reduce_scatter": "REDUCE_SCATTER",
            "_reduce_scatter_base": "_REDUCE_SCATTER_BASE",
            "reduce_scatter_tensor_coalesced": "COALESCED", "alltoall_base": "ALLTOALL_BASE",
            "alltoall": "ALLTOALL", "barrier": "BARRIER", "send": "SEND", "recv": "RECV"}
# where each collective's outputs are among its arguments (the future's value)
_OUTPUTS = {"allreduce": 0, "allreduce_coalesced": 0, "broadcast": 0, "reduce": 0, "allgather": 0,
            "allgather_coalesced": 0, "_allgather_base": 0, "allgather_into_tensor_coalesced": 0,
            "gather": 0, "scatter": 0, "reduce_scatter": 0, "_reduce_scatter_base": 0,
            "reduce_scatter_tensor_coalesced": 0, "alltoall_base": 0, "alltoall": 0}


ENV_READ = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
            "NCCL_BLOCKING_WAIT", "TORCH_NCCL_ENABLE_TIMING", "NCCL_ENABLE_TIMING")


class _Thread(threading.local):
    depth = 0
    pending: list  # (instance, op, args, work) issued while a group is open

    def __init__(self):
        self.pending = []


class FakeNCCL:
    """Stands for ``dist.ProcessGroupNCCL(store, rank, size, options)``."""

    class Options:
        def __init__(self, is_high_priority_stream=False):
            self._timeout = None

    _thread = _Thread()  # NCCL's group depth: one per thread, every communicator
    instances: list = []
    swallowed: list = []
    groups_ended_by_connect = 0
    device_count = 2
    cuda = None  # a tests/_fake_cuda.Device, when streams should be modelled
    op_seconds = 0.0  # with ``cuda``: how long each op keeps its stream busy (device seconds)
    future_at_end = False  # host-device mode only (host_device): futures complete at the end

    def __init__(self, store, rank, size, options):
        self.store, self.rank_, self.size_, self.options = store, rank, size, options
        self.gloo = None
        self.connected = None
        self.used_device = None
        self.shut = self.aborted = False
        self.seq = 0
        self.ops, self.works, self.barrier_devices, self.barrier_reasons = [], [], [], []
        # what ProcessGroupNCCL's constructor reads from the environment
        self.env = {k: v for k, v in os.environ.items() if k in ENV_READ}
        self.stream = self.cuda.Stream() if self.cuda is not None else f"nccl stream of {id(self)}"
        FakeNCCL.instances.append(self)

    # -- connecting --------------------------------------------------------------------------
    def _connect(self, why):
        if self.gloo is not None:
            return
        if self._thread.depth:  # NCCL ends the open groups when it makes a communicator
            FakeNCCL.groups_ended_by_connect += 1
            self._thread.depth = 0
            self._launch_pending()
        timeout = self.options._timeout or datetime.timedelta(seconds=60)
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("fake-nccl/", self.store),
                                          self.rank_, self.size_, timeout)
        self.connected = why

    def eager_connect_single_device(self, device):
        self._connect("eager")
        if self.used_device is None:
            self.used_device = torch.device(device)

    def _check(self):
        if self.shut or self.aborted:
            raise dist.DistBackendError(f"NCCL communicator was aborted on rank {self.rank_}.")

    # -- issuing -----------------------------------------------------------------------------
    def _op(self, op, args, opts=None):
        self._check()
        self._connect(op)
        blocking = opts is not None and hasattr(opts, "asyncOp") and not opts.asyncOp
        self.seq += 1
        self.ops.append((op, blocking))
        outputs = list(_tensors(args[_OUTPUTS[op]])) if op in _OUTPUTS else []
        stream = (self.cuda.current if self.cuda is not None else "current stream") if blocking \
            else self.stream
        work = FakeWork(self, op, outputs, stream)
        self.works.append(work)
        if self.cuda is not None:  # the device's side: where and when the op runs
            if not blocking:  # ProcessGroupNCCL makes its stream wait for the caller's
                stream.busy_until = max(stream.busy_until, self.cuda.current.busy_until)
            stream.busy_until = max(stream.busy_until, self.cuda.clock()) + self.op_seconds
        if self._thread.depth:  # joins the open group, whoever opened it
            self._thread.pending.append((self, op, args, opts, work))
            if op not in ("send", "recv"):
                FakeNCCL.swallowed.append((op, self.rank_))
            return None if blocking else work
        work.real = getattr(self.gloo, op)(*args, *([opts] if opts is not None else []))
        work.arm()
        if blocking:  # the host is the device here: run it now (see the module's docstring)
            work.real.wait()
            return None
        return work

    def _launch_pending(self):
        pending, self._thread.pending = self._thread.pending, []
        for inst, op, args, opts, work in pending:
            work.real = getattr(inst.gloo, op)(*args, *([opts] if opts is not None else []))
            work.arm()
        return [w for *_, w in pending]

    def _start_coalescing(self):  # the Backend binding's signature: no device
        self._check()
        self._connect("coalescing")
        self._thread.depth += 1

    def _end_coalescing(self):
        self._thread.depth -= 1
        if self._thread.depth:
            return None
        block = FakeWork(self, "coalesced", [], self.stream, parts=self._launch_pending())
        block.arm()
        self.works.append(block)
        return block

    def barrier(self, opts):
        if opts.device_ids:
            device, why = torch.device("cuda", opts.device_ids[0]), "device_ids"
        elif self.used_device is not None:
            device, why = self.used_device, "used"
        else:  # opts.device is not looked at
            device, why = torch.device("cuda", self.rank_ % self.device_count), "guess"
        self.barrier_devices.append(device)
        self.barrier_reasons.append(why)
        if self.used_device is None:
            self.used_device = device
        return self._op("barrier", (), opts)

    def shutdown(self):
        self.shut = True
        if self.gloo is not None:
            self.gloo.shutdown()

    def abort(self):
        self.aborted = True
        if self.gloo is not None:
            self.gloo.abort()

    def rank(self):
        return self.rank_

    def size(self):
        return self.size_

    def __getattr__(self, name):  # every other collective: the same contract
        if name not in OP_TYPES:
            raise AttributeError(name)

        def issue(*args):
            if name in ("send", "recv"):
                return self._op(name, args)
            *rest, opts = args
            return self._op(name, tuple(rest), opts)
        return issue


class FakeWork:
    """A WorkNCCL: future complete at enqueue, a stream wait, a capped host wait."""

    def __init__(self, pg, op, outputs, stream, parts=None):
        self.pg, self.op, self.outputs, self.stream = pg, op, outputs, stream
        self.seq, self.real, self.parts = pg.seq, None, parts
        self.ended = False
        self.enqueued_at = time.monotonic()
        self.future = torch.futures.Future()
        if not FakeNCCL.future_at_end:
            self.future.set_result(list(outputs))  # complete at enqueue, as a CUDA future is

    def arm(self):
        """Host-device mode: the future completes when gloo's transfer(s) did (see host_device)."""
        if FakeNCCL.future_at_end and not self.future.done():
            reals = [p.real for p in self.parts] if self.parts is not None else [self.real]
            done = torch.futures.collect_all([r.get_future() for r in reals])
            done.then(lambda _: self.future.set_result(list(self.outputs)))

    def _reals(self):
        if self.parts is not None:
            return [p.real for p in self.parts]
        if self.real is None:
            raise AssertionError(f"waited on {self.op}, which was swallowed into an NCCL group "
                                 "that is still open on this thread")
        return [self.real]

    def wait(self, timeout=None):
        if self.pg.cuda is not None:  # the current stream waits for this work's stream
            s = self.pg.cuda.current
            if not isinstance(self.stream, str):
                s.busy_until = max(s.busy_until, self.stream.busy_until)
        if self.ended:  # a WorkNCCL may be waited on again (a gloo work only once)
            return True
        limit = None if timeout is None else (timeout.total_seconds()
                                              if isinstance(timeout, datetime.timedelta) else timeout)
        for real in self._reals():
            try:
                real.wait() if limit is None else real.wait(datetime.timedelta(seconds=limit))
            except RuntimeError as exc:
                ran_ms = int((time.monotonic() - self.enqueued_at) * 1000)
                if limit is not None and ran_ms >= limit * 1000 * 0.9:
                    self.pg.aborted = True  # WorkNCCL::wait aborts the communicators, then throws
                    raise dist.DistBackendError(
                        f"[PG ID 0 PG GUID 0 Rank {self.pg.rank_}] Watchdog caught collective "
                        f"operation timeout: WorkNCCL(SeqNum={self.seq}, "
                        f"OpType={OP_TYPES.get(self.op, 'COALESCED')}, Timeout(ms)={int(limit * 1000)}) "
                        f"ran for {ran_ms} milliseconds before timing out.") from None
                raise dist.DistBackendError(str(exc)) from None
        self.ended = True
        return True

    synchronize = wait

    def get_future(self):
        return self.future

    def is_completed(self):
        if self.ended:
            return True
        try:
            return all(r.is_completed() for r in self._reals())
        except AssertionError:
            return False

    def is_success(self):
        raise NotImplementedError("WorkNCCL::isSuccess() is deprecated")

    def exception(self):
        return None

    def result(self):
        return list(self.outputs)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for t in x:
            yield from _tensors(t)


def install(device_count: int = 2, gpu: int = 0, cuda=None) -> None:
    """Make this process's NCCL the fake (for rank processes; no undo)."""
    from ddplab.pg import inner

    FakeNCCL.device_count, FakeNCCL.cuda = device_count, cuda
    dist.ProcessGroupNCCL = FakeNCCL
    inner.on_gpu = lambda tensor: True
    inner.current_gpu = lambda: torch.device("cuda", gpu)


@contextlib.contextmanager
def installed(device_count: int = 2, gpu: int = 0, cuda=None):
    """Within the block this process's NCCL is the fake (see ``install``); state is reset."""
    from ddplab.pg import inner

    saved = (getattr(dist, "ProcessGroupNCCL", None), inner.on_gpu, inner.current_gpu,
             FakeNCCL.device_count, FakeNCCL.cuda)
    FakeNCCL.instances, FakeNCCL.swallowed, FakeNCCL.groups_ended_by_connect = [], [], 0
    FakeNCCL._thread = _Thread()
    install(device_count, gpu, cuda)
    try:
        yield FakeNCCL
    finally:
        for pg in FakeNCCL.instances:
            if not (pg.shut or pg.aborted) and pg.gloo is not None:
                pg.gloo.shutdown()
        (nccl, inner.on_gpu, inner.current_gpu, FakeNCCL.device_count, FakeNCCL.cuda) = saved
        if nccl is None:
            del dist.ProcessGroupNCCL
        else:
            dist.ProcessGroupNCCL = nccl


class HostClock:
    """A ``_fake_cuda`` clock that is ddplab's own host clock: the host is the device."""

    def __call__(self) -> float:
        from ddplab.contracts.clock import now

        return now()


def host_device() -> None:
    """Fake-NCCL rank mode for suites that build models (graders, recorders, compare).

    ``ddplab.pg.backend.device()`` answers ``cpu`` (in the backend module and in every
    loaded ddplab module that imported the name), so models and data stay CPU tensors, and
    ``torch.cuda``'s stream and event calls are a ``_fake_cuda.Device`` on the host clock
    (the fake NCCL's works run on its streams). The group is still ``ddplab_nccl`` and every
    tensor goes to its NCCL half (``install``). No undo: for rank processes only.

    One divergence from the contract, because here the host IS the device: a work's future
    completes when gloo's transfer did, not at enqueue. On a GPU, what a future's callback
    queues (a comm hook's division) runs on a stream ordered after the collective; on the
    host, the callback itself runs, so at enqueue it would read the tensor before gloo wrote
    it. The complete-at-enqueue contract is the observing-group suite's (test_observed_fake_nccl)."""
    import sys

    from _fake_cuda import Device

    from ddplab.pg import backend

    original = backend.device

    def device(group=None):
        return torch.device("cpu")

    for name, module in list(sys.modules.items()):
        if name.startswith("ddplab") and getattr(module, "device", None) is original:
            module.device = device
    import _fake_cuda

    dev = Device(HostClock())

    class Event(_fake_cuda.Event):  # types, as torch's own code checks isinstance(x, torch.cuda.Event)
        def __init__(self, enable_timing=False):
            super().__init__(dev, enable_timing)

    class Stream(_fake_cuda.Stream):
        def __init__(self, device=None, priority=0):
            super().__init__(dev)

    torch.cuda.Event, torch.cuda.Stream = Event, Stream
    for name in ("synchronize", "current_stream", "stream", "current_device"):
        setattr(torch.cuda, name, getattr(dev, name))
    FakeNCCL.cuda, FakeNCCL.future_at_end = dev, True


def rejoin(store_path: str, device_count: int = 2, gpu=None, on_host=False) -> str:
    """On a rank of a gloo Cluster: rejoin as an NCCL rank whose NCCL is the fake.

    The default group is remade as ``ddplab_nccl`` on a fresh FileStore at ``store_path``
    (the same on every rank); ``gpu``: this rank's GPU index (default: its rank);
    ``on_host``: also ``host_device()``."""
    from ddplab.pg.group import register

    rank, size = dist.get_rank(), dist.get_world_size()
    timeout = datetime.timedelta(seconds=30)
    dist.destroy_process_group()
    install(device_count, rank if gpu is None else gpu)
    if on_host:
        host_device()
    register()
    dist.init_process_group("ddplab_nccl", store=dist.FileStore(store_path, size), rank=rank,
                            world_size=size, timeout=timeout)
    return str(dist.get_backend())


def backend_string() -> str:
    """The rank's group backend as torch names it: ``'ddplab_nccl'`` once on the fake."""
    import torch.distributed as dist

    return str(dist.get_backend())
