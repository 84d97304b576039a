"""The real gloo and NCCL groups inside the observing group, and their two time limits.

Teaches: a process group has two moments that can wait on other ranks. At
start-up it meets its peers: gloo does it inside ``ProcessGroupGloo``'s
constructor (every pair connects, through addresses left in the store),
NCCL at its first collective (rank 0's unique id travels through the store).
Afterwards each collective may wait for a peer that is late or never comes.
torch gives one ``timeout`` to both. A short collective timeout (lab 06 uses
3 s, so that a planted hang ends quickly) would then also fail ranks that are
merely slow to start: CUDA and NCCL initialisation can differ by seconds from
rank to rank. So start-up here waits ``START_UP_S`` (or the collective
timeout, if longer), and the group then takes the collective timeout:
``ProcessGroupGloo::setTimeout`` sets it on every connected context, and
``ProcessGroupNCCL``'s options carry it to the watchdog, which aborts a
collective stuck longer than that. gloo's sends and receives keep the
start-up limit (their transport reads it when the pairs connect), so the
observing group passes the collective timeout to each of their waits.

NCCL's half connects eagerly on the rank's GPU when the group is made (what
``init_process_group(device_id=...)`` does for torch's own groups; a Python
group has no CUDA backend for torch to ask), and the ranks' ``TORCH_NCCL_*``
error handling is pinned so that the watchdog respects the timeout without
killing the rank (``pin_nccl_environment``, docs/gpu.md).

Leaves out: NCCL's own bootstrap timeouts (NCCL_* variables) and other backends.

References: torch/include/torch/csrc/distributed/c10d/ProcessGroupGloo.hpp
(``setTimeout``), ProcessGroupNCCL.hpp (``Options``, the watchdog,
TORCH_NCCL_ASYNC_ERROR_HANDLING's modes, TORCH_NCCL_BLOCKING_WAIT); ProcessGroupNCCL.cpp
(``WorkNCCL::checkTimeout``'s text, ``eagerConnectSingleDevice``);
torch.distributed.init_process_group (``timeout``).
"""
from __future__ import annotations

import datetime
import threading

# How long ranks may take to meet when a group starts, whatever the collective timeout.
START_UP_S = 60.0


def seconds(timeout) -> float | None:
    """A timedelta or a number of seconds as seconds (None stays None)."""
    if timeout is None:
        return None
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def startup_timeout(timeout) -> datetime.timedelta:
    """The limit for meeting the peers at start-up: the collective timeout, at least START_UP_S."""
    return datetime.timedelta(seconds=max(seconds(timeout) or 0.0, START_UP_S))


def gloo_group(store, rank: int, size: int, timeout):
    """A real gloo group that met its peers within the start-up limit and now has ``timeout``."""
    import torch.distributed as dist

    group = dist.ProcessGroupGloo(store, rank, size, startup_timeout(timeout))
    if timeout is not None:
        group._set_default_timeout(timeout)
    return group


# The ranks' NCCL settings, pinned whatever the user's environment says (docs/gpu.md):
# - ASYNC_ERROR_HANDLING=2 (CleanUpOnly): on a timeout the watchdog aborts the communicators
#   and leaves the process alive; torch's default, 3, kills the process, possibly during a
#   later cell, and 1 does both.
# - BLOCKING_WAIT=0: with 1 every wait blocks the host and the watchdog no longer acts.
# Their older NCCL_* spellings are removed so that they cannot disagree.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "0"}
NCCL_ENV_ALIASES = ("NCCL_ASYNC_ERROR_HANDLING", "NCCL_BLOCKING_WAIT")


def pin_nccl_environment(environ=None) -> dict:
    """Set ``NCCL_ENV`` in ``environ`` (default: this process's); returns what was overridden.

    ProcessGroupNCCL reads these when it is constructed, so this runs before each one."""
    import os
    import warnings

    environ = os.environ if environ is None else environ
    overridden = {}
    for name in NCCL_ENV_ALIASES:
        if name in environ:
            overridden[name] = environ.pop(name)
    for name, value in NCCL_ENV.items():
        if environ.get(name, value) != value:
            overridden[name] = environ[name]
        environ[name] = value
    if overridden:
        warnings.warn(f"ddplab pins NCCL's error handling for its ranks: {overridden} replaced by "
                      f"{NCCL_ENV} (a timed-out collective then fails the job instead of killing "
                      "the rank later; see docs/gpu.md)", stacklevel=2)
    return overridden


def current_gpu():
    """This rank's GPU (``torch.cuda.set_device`` ran before its group was made)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def on_gpu(tensor) -> bool:
    """Whether ``tensor`` goes to the NCCL half of a group (the CPU tests' fake NCCL widens it)."""
    return tensor.is_cuda


def nccl_group(store, rank: int, size: int, timeout, device=None):
    """A real NCCL group with the collective ``timeout`` in its options, connected now.

    ``device``: this rank's GPU. The group connects eagerly on it, inside the start-up
    limit (the unique id it reads from ``store`` waits as long as the store does: a
    Cluster's ranks give their store the start-up limit, worker.py): every rank makes a
    group together, whereas lazily a group connects at its first op, and a first send
    from rank 0 to 1 while rank 2 is busy elsewhere would block in setup, where no
    watchdog looks. The NCCL environment is pinned first (``pin_nccl_environment``)."""
    import torch.distributed as dist

    pin_nccl_environment()
    opts = dist.ProcessGroupNCCL.Options()
    if timeout is not None:
        opts._timeout = timeout if isinstance(timeout, datetime.timedelta) \
            else datetime.timedelta(seconds=timeout)
    close_open_blocks()  # a communicator made inside an open NCCL group would join it
    group = dist.ProcessGroupNCCL(store, rank, size, opts)
    group.eager_connect_single_device(device if device is not None else current_gpu())
    return group


def timed_out(exc: BaseException) -> bool:
    """Whether a failed wait ran out of time. gloo says "Timed out ..."; NCCL's capped wait
    says "... ran for N milliseconds before timing out" (ProcessGroupNCCL.cpp, checkTimeout)."""
    text = str(exc)
    return "imed out" in text or "before timing out" in text


def route(p2p, op: str, backend, call, tensors):
    """Issue one op (``call(backend)``) on the real group ``backend``.

    NCCL sends and recvs join the open coalescing block ``p2p`` (a ``CoalescedP2P``, or
    None for a gloo-only group); any other op first closes every block open on this
    thread, on any group: NCCL's group (ncclGroupStart) is one per thread and spans every
    communicator, so an op issued while one is open would be swallowed into it."""
    if p2p is not None and op in ("send", "recv") and backend is p2p.backend:
        return p2p.issue(call, _device(tensors), tensors)
    if p2p is not None or _open_blocks():
        close_open_blocks()
    return call(backend)


def _device(tensors):
    for t in tensors:
        if isinstance(t, (list, tuple)):
            return _device(t)
        return t.device
    raise ValueError("a send or recv without a tensor")


_THREAD = threading.local()  # NCCL's group depth is per thread: so are the open blocks


def _open_blocks() -> list:
    if not hasattr(_THREAD, "blocks"):
        _THREAD.blocks = []
    return _THREAD.blocks


def close_open_blocks() -> None:
    """Close every coalescing block this thread has open (on any group): before another
    op, before a communicator is made, after a stall, and when a job ends."""
    for block in list(_open_blocks()):
        block.close()


class CoalescedP2P:
    """NCCL point-to-point ops issued as one NCCL group until someone waits for one of them.

    NCCL runs sends and receives that must progress together only when they are one
    group (``ncclGroupStart``/``ncclGroupEnd``); ``batch_isend_irecv`` opens such a
    group for torch's own groups, but hands a Python group (the observing one) its ops
    one by one (it groups only when ``type(group) is ProcessGroup``). So the observing
    group opens a coalescing block on the real NCCL group at the first send or recv,
    adds each following one, and closes the block (one NCCL group, one work for all)
    when a wait, a future or any other op asks for it. ``isend``+``irecv`` then
    ``wait`` and ``batch_isend_irecv`` become one group; a blocking ``send`` is a group
    of its own. The first such group must be reached by every rank of the group, as
    ``batch_isend_irecv``'s docstring asks of its own first call (the group connects
    eagerly, ``nccl_group``, so this holds). A block belongs to the thread that opened
    it (NCCL's group depth is per thread; autograd runs a GPU's hooks on a thread of
    its own): a wait from another thread is refused in words. Written for NCCL and
    tested against a fake NCCL on CPU (tests/_fake_nccl.py): never run on GPUs.
    """

    def __init__(self, backend):
        self.backend = backend
        self.device = None  # the open block's device, None when no block is open
        self.thread = None  # the thread that opened it
        self.works: list = []

    def issue(self, call, device, tensors=()):
        """Add one op (``call(backend)``) to the open block, opening one if needed."""
        if self.device is not None and (self.device != device
                                        or self.thread is not threading.current_thread()):
            self.close()
        if self.device is None:
            close_open_blocks()  # another group's block: NCCL would merge the two
            self.backend._start_coalescing()  # Backend's binding: no device argument
            self.device, self.thread = device, threading.current_thread()
            _open_blocks().append(self)
        call(self.backend)  # inside a block the op's own work (if any) is not the one to wait
        work = BlockWork(self, [t for t in _flat(tensors)])
        self.works.append(work)
        return work

    def close(self) -> None:
        """End the open block: NCCL launches it; every op in it shares the block's work."""
        if self.device is None:
            return
        if self.thread is not threading.current_thread():
            raise RuntimeError(
                "a send or recv posted on thread {!r} was waited on thread {!r}: NCCL groups its "
                "sends and receives per thread, so wait in the thread that posted them (or use "
                "batch_isend_irecv and wait there)".format(self.thread.name,
                                                            threading.current_thread().name))
        works = self.works
        self.device, self.thread, self.works = None, None, []
        if self in _open_blocks():
            _open_blocks().remove(self)
        real = self.backend._end_coalescing()
        for work in works:
            work.real = real


def _flat(tensors):
    for t in tensors:
        if isinstance(t, (list, tuple)):
            yield from _flat(t)
        else:
            yield t


class BlockWork:
    """The work of one op in a coalescing block; asking anything of it closes the block.

    A coalesced NCCL work's future holds ``[]`` and its ``result()`` is empty; a lone NCCL
    send's holds its tensor. The block is this group's doing, not the caller's, so its
    future and ``result()`` give the op's own tensors, as the op alone would."""

    def __init__(self, block: CoalescedP2P, tensors=()):
        self.block, self.real, self.tensors = block, None, list(tensors)

    def _work(self):
        if self.real is None:
            self.block.close()
        return self.real

    def wait(self, timeout=None):
        work = self._work()
        return work.wait() if timeout is None else work.wait(timeout)

    def get_future(self):
        tensors = self.tensors
        return self._work().get_future().then(lambda fut: (fut.value(), tensors)[1])  # errors pass

    def is_completed(self):
        return self._work().is_completed()

    def is_success(self):
        return self._work().is_success()

    def exception(self):
        return self._work().exception()

    def synchronize(self):
        return self._work().synchronize()

    def source_rank(self):
        return self._work().source_rank()

    def result(self):
        self._work()
        return list(self.tensors)


def payload_bytes(tensor) -> int:
    """What a rank hands a collective: numel x element size; for a sparse tensor, the
    indices and values it holds (its numel is the dense shape's)."""
    if tensor.is_sparse:
        return (tensor._indices().numel() * tensor._indices().element_size()
                + tensor._values().numel() * tensor.element_size())
    return tensor.numel() * tensor.element_size()


def coalesced(backend, coalesced: str, single: str, outputs, inputs, opts):
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
