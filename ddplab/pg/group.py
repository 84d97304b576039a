"""The observing process group: every collective of a rank passes one place that sees it.

Teaches: ``torch.distributed`` hands every collective to a process group
object, whoever calls it: ``dist.all_reduce``, a name imported before any
patch (``from torch.distributed import all_reduce``),
``distributed_c10d.broadcast``, ``P2POp`` with ``batch_isend_irecv``, and
torch DDP's C++ reducer, which never calls a Python function at all but
calls the group's ``allreduce`` for each bucket. A Python subclass of
``dist.ProcessGroup``, registered as a backend with
``dist.Backend.register_backend``, is such an object: this one holds the
real groups (gloo for CPU tensors, NCCL for CUDA tensors, the
``"cpu:gloo,cuda:nccl"`` split of ``ddplab.pg.backend``), hands each
call to the right one and, on the way,

- counts what it issued: torch's Python groups have no sequence number
  (``_get_sequence_number_for_group`` raises "does not yet support sequence
  numbers"), so this group keeps its own; the Cluster compares the counts to
  decide whether ranks can be kept after a failure (``worker.group_state``);
- tells the observers installed on it (``observe(observer)``) what ran, on
  which tensors, and lets them wrap the returned work: a recorder stamps
  launch and done, a simulated link delays completion, a grader notes waits
  and gives a short timeout (``ddplab.contracts.protocols.Observer``).

The Cluster's ranks join through it (``backend.init_string``), so the
learner's code, ddplab's reducers and torch DDP are all seen by one mechanism.
Meeting the peers at start-up has a longer limit than a collective
(``inner.py``), so ranks slow to start are not failed by a short timeout.

Leaves out, compared with torch's own groups: ``reduce``/``gather``/``scatter``
called from C++ (torch's Python trampoline cannot route them here; Python
callers are served), object collectives' internals (they arrive as the
all-gathers and broadcasts they are made of), functional collectives
(``torch.distributed._functional_collectives`` goes through the dispatcher,
not this object), NCCL's coalescing manager for collectives (each collective is
issued alone; NCCL sends and recvs are grouped, ``p2p_blocks.CoalescedP2P``),
``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s wrapper group.

On NCCL (docs/gpu.md): ProcessGroupNCCL answers a blocking op with no work
(torch >= 2.8), so a CUDA op is forwarded with ``asyncOp=True`` and the caller's
blocking call waits on the real work, through the observers; the wait makes the
caller's stream wait for NCCL's, as the blocking op's own stream order would.
Barriers run on the rank's GPU; ``shutdown`` reaches NCCL; unfinished NCCL work
is reported. An earlier form failed on an H200; this form was never run on a GPU,
only on CPU against a fake with ProcessGroupNCCL's contract (tests/_fake_nccl.py).

References: torch/distributed/distributed_c10d.py (Backend.register_backend,
_new_process_group_helper: a creator returning a ProcessGroup subclass
replaces the whole group; ``opts.asyncOp = async_op`` and "the backend has
sync'ed at CPP level"; barrier's device choice; destroy_process_group's
``shutdown``); torch/csrc/distributed/c10d/PyProcessGroup.hpp
(which methods C++ callers can reach in Python); ProcessGroupGloo, ProcessGroupNCCL.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist

from ddplab.pg import inner
from ddplab.pg.inner import gloo_group, nccl_group, seconds
from ddplab.pg.p2p_blocks import CoalescedP2P, close_open_blocks, issue_on_inner
from ddplab.pg.works import ObservedWork, ObserverBase, completed  # noqa: F401 - public here too

UNFINISHED_GPU_WORK = "unfinished GPU work"  # the key of unfinished_device_work's entry
BACKENDS = {"ddplab_gloo": "gloo", "ddplab_nccl": "cpu:gloo,cuda:nccl"}
LIVE: "weakref.WeakSet" = weakref.WeakSet()  # this process's observing groups (subgroups too)


class ObservingGroup(dist.ProcessGroup):
    """A process group that forwards to real gloo (and NCCL) groups and is watched."""

    def __init__(self, store, rank: int, size: int, timeout, description: str):
        super().__init__(rank, size)
        self.description = description
        self.timeout = timeout
        self.store = store  # the group's own (prefixed) store: observers may meet peers there
        # start-up waits longer than a collective may (inner.py)
        self.cpu = gloo_group(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self.cuda = self.device = None
        if "nccl" in description:
            self.device = inner.current_gpu()  # the rank's GPU: barriers run there
            self.cuda = nccl_group(dist.PrefixStore("nccl/", store), rank, size, timeout,
                                   self.device)  # connected now, on that GPU
        self.p2p = CoalescedP2P(self.cuda) if self.cuda is not None else None  # inner.py
        self.issued = 0  # every collective and point-to-point op, the sequence number
        self.device_works: list = []  # NCCL works not yet seen complete (unfinished())
        self.observers: list = []
        LIVE.add(self)

    # -- what the Cluster and torch ask of a group -------------------------------------
    def getBackendName(self) -> str:
        return "ddplab_nccl" if self.cuda is not None else "ddplab_gloo"

    def _get_sequence_number_for_group(self) -> int:
        return self.issued

    # torch's ProcessGroup reads its name from a registered backend; this group has
    # none registered (it holds them itself), so it keeps the name, and destroy works.
    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return getattr(self, "_name", "")

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return getattr(self, "_desc", "")

    @contextlib.contextmanager
    def observe(self, observer):
        """Within the block, ``observer`` sees every op on this group (newest last)."""
        self.observers.append(observer)
        try:
            yield observer
        finally:
            self.observers.remove(observer)

    def wait_limit(self, asked, cap=None):
        """Seconds a wait may take: the caller's limit, ``cap`` or the shortest an observer asks for."""
        limits = [seconds(x) for x in (asked, cap) if x]
        limits += [getattr(o, "timeout", None) for o in self.observers]
        limits = [x for x in limits if x]
        return min(limits) if limits else None

    # -- the one path every op takes ------------------------------------------------------
    def shutdown(self) -> None:
        # destroy_process_group calls this (a Python method: the C++ group has no backends
        # of its own to shut down). Without it the NCCL communicator lives until garbage
        # collection, which warns and aborts it.
        close_open_blocks()
        if self.cuda is not None:
            self.cuda.shutdown()
        self.cpu.shutdown()

    def abort(self) -> None:
        if self.cuda is not None:
            self.cuda.abort()
        self.cpu.abort()

    def unfinished(self, grace_s: float = 1.0) -> int:
        """NCCL works issued here not finished on the GPU after ``grace_s``: on a GPU a
        blocking op returns before it runs, so equal issue counts prove no work ended."""
        import time

        close_open_blocks()
        end = time.monotonic() + grace_s
        while True:
            self.device_works = [w for w in self.device_works if not completed(w)]
            if not self.device_works or time.monotonic() >= end:
                return len(self.device_works)
            time.sleep(0.01)

    def _backend(self, tensors):
        flat = [t for t in _flat(tensors) if isinstance(t, torch.Tensor)]
        if flat and inner.on_gpu(flat[0]):
            if self.cuda is None:
                raise RuntimeError(f"a CUDA tensor was given to a {self.description} group; "
                                   "move it to the CPU, or start the Cluster with backend='nccl'")
            return self.cuda
        return self.cpu

    def _issue(self, op: str, tensors, call, peer=None, opts=None, backend=None):
        observers = list(self.observers)
        calls = [(o, o.launched(op, list(_flat(tensors)), self, peer)) for o in observers]
        backend = self._backend(tensors) if backend is None else backend
        if backend is self.cuda and getattr(opts, "asyncOp", True) is False:
            # NCCL answers a blocking op with no work (torch >= 2.8) and runs it on the
            # caller's stream. Ask for the work: c10d's blocking call then waits on it here,
            # with the limits and observers, and the wait makes the caller's current stream
            # wait for NCCL's, so what the caller's later kernels see is the same.
            opts.asyncOp = True
        work = issue_on_inner(self.p2p, op, backend, call, tensors)
        if work is None:
            raise RuntimeError(f"{op}: the {'NCCL' if backend is self.cuda else 'gloo'} group "
                               "returned no work; ddplab cannot wait on it (please report this)")
        self.issued += 1
        if backend is self.cuda:
            self.device_works.append(work)
        for observer, token in calls:
            work = observer.started(token, work) or work
        # gloo's sends and recvs keep the start-up limit (inner.py): cap their waits
        return ObservedWork(work, self, calls, self.timeout if backend is self.cpu else None)

    # -- collectives (the names torch's c10d calls on a group) ----------------------------
    def allreduce(self, tensors, opts):
        return self._issue("all_reduce", tensors, lambda b: b.allreduce(tensors, opts), opts=opts)

    def allreduce_coalesced(self, tensors, opts):
        return self._issue("all_reduce", tensors, lambda b: b.allreduce_coalesced(tensors, opts), opts=opts)

    def broadcast(self, tensors, opts):
        return self._issue("broadcast", tensors, lambda b: b.broadcast(tensors, opts), opts=opts)

    def reduce(self, tensors, opts):
        return self._issue("reduce", tensors, lambda b: b.reduce(tensors, opts), opts=opts)

    def allgather(self, outputs, inputs, opts):
        return self._issue("all_gather", inputs, lambda b: b.allgather(outputs, inputs, opts), opts=opts)

    def allgather_coalesced(self, outputs, inputs, opts):
        return self._issue("all_gather", inputs, lambda b: b.allgather_coalesced(outputs, inputs, opts), opts=opts)

    # torch 2.13 calls these "*_single"; the backends keep the older names
    def all_gather_single(self, output, input, opts):
        return self._issue("all_gather_into_tensor", [input],
                           lambda b: b._allgather_base(output, input, opts), opts=opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        return self._issue("all_gather_into_tensor", inputs, lambda b: coalesced_or_one_by_one(
            b, "allgather_into_tensor_coalesced", "_allgather_base", outputs, inputs, opts), opts=opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, outputs, inputs, opts):
        return self._issue("gather", inputs, lambda b: b.gather(outputs, inputs, opts), opts=opts)

    def scatter(self, outputs, inputs, opts):
        return self._issue("scatter", outputs, lambda b: b.scatter(outputs, inputs, opts), opts=opts)

    def reduce_scatter(self, outputs, inputs, opts):
        return self._issue("reduce_scatter", inputs, lambda b: b.reduce_scatter(outputs, inputs, opts), opts=opts)

    def reduce_scatter_single(self, output, input, opts):
        return self._issue("reduce_scatter_tensor", [input],
                           lambda b: b._reduce_scatter_base(output, input, opts), opts=opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        return self._issue("reduce_scatter_tensor", inputs, lambda b: coalesced_or_one_by_one(
            b, "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", outputs, inputs, opts), opts=opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        return self._issue("all_to_all_single", [input], lambda b: b.alltoall_base(
            output, input, output_split_sizes, input_split_sizes, opts), opts=opts)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts):
        return self._issue("all_to_all", inputs, lambda b: b.alltoall(outputs, inputs, opts), opts=opts)

    def barrier(self, opts):
        # A barrier carries no tensor of the caller's; an NCCL group's runs on its GPU. c10d
        # hands a Python group opts.device=cpu, which NCCL ignores: it takes device_ids, else
        # guesses (bound device, last used, rank % GPUs), maybe another learner's GPU.
        if self.cuda is None:
            return self._issue("barrier", [], lambda b: b.barrier(opts), opts=opts)
        if not opts.device_ids:
            opts.device_ids = [self.device.index]
        return self._issue("barrier", [], lambda b: b.barrier(opts), opts=opts, backend=self.cuda)

    def send(self, tensors, dst: int, tag: int):
        return self._issue("send", tensors, lambda b: b.send(tensors, dst, tag), peer=dst)

    def recv(self, tensors, src: int, tag: int):
        return self._issue("recv", tensors, lambda b: b.recv(tensors, src, tag), peer=src)

    def recv_anysource(self, tensors, tag: int):
        return self._issue("recv", tensors, lambda b: b.recv_anysource(tensors, tag))


def unfinished_device_work(grace_s: float = 1.0) -> dict:
    """``{UNFINISHED_GPU_WORK: (n,)}`` when this process's observing groups have n NCCL works
    not finished on the GPU, else ``{}`` (an entry of the rank's group state, which the
    Cluster's diagnosis reads)."""
    n = sum(g.unfinished(grace_s) for g in list(LIVE) if g.cuda is not None)
    return {UNFINISHED_GPU_WORK: (n,)} if n else {}


def _flat(tensors):
    for t in tensors:
        if isinstance(t, (list, tuple)):
            yield from t
        else:
            yield t


def _creator(description):
    def create(store, rank, size, timeout):
        return ObservingGroup(store, rank, size, timeout, description)
    return create


def register() -> None:
    """Make the backends ``ddplab_gloo`` and ``ddplab_nccl`` known to this process (once)."""
    for name, description in BACKENDS.items():
        if name.upper() not in dist.Backend._plugins:
            devices = ["cpu", "cuda"] if "nccl" in description else ["cpu"]
            dist.Backend.register_backend(name, _creator(description), devices=devices)


def observing_group(group=None) -> ObservingGroup | None:
    """The observing group behind ``group`` (default: the default group), or None."""
    if not dist.is_initialized():
        return None
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return pg if isinstance(pg, ObservingGroup) else None


@contextlib.contextmanager
def observe(observer, group=None):
    """``with observe(obs):`` -> ``obs`` sees every op on the (default) observing group.

    Raises when the group is not an observing one (started outside a Cluster, e.g.
    ``init_process_group("gloo")``): say how to get one."""
    pg = observing_group(group)
    if pg is None:
        raise RuntimeError("this process group is not observed: start it through ddplab "
                           "(a Cluster, ddplab.init_from_env) or with backend 'ddplab_gloo' "
                           "after ddplab.pg.group.register()")
    with pg.observe(observer):
        yield observer


def coalesced_or_one_by_one(backend, coalesced: str, single: str, outputs, inputs, opts):
    """NCCL's coalesced call where the backend has it; gloo's ProcessGroupGloo has no
    ``allgather_into_tensor_coalesced`` nor ``reduce_scatter_tensor_coalesced`` (torch 2.13),
    so there each pair goes as its own call, in order on every rank. The earlier works are
    waited for here, so the one returned ends last (gloo may run two ops at once)."""
    if hasattr(backend, coalesced):
        return getattr(backend, coalesced)(outputs, inputs, opts)
    works = [getattr(backend, single)(out, inp, opts) for out, inp in zip(outputs, inputs)]
    for work in works[:-1]:
        work.wait()
    return works[-1] if works else None
