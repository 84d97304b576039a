"""NCCL's sends and receives, grouped as ``batch_isend_irecv`` groups them for torch's own groups.

Teaches: NCCL runs point-to-point ops that must progress together only when they
are issued as one NCCL group (``ncclGroupStart``/``ncclGroupEnd``), and that group
depth is one per thread, spanning every communicator. The observing group is a
Python group, which ``batch_isend_irecv`` hands its ops one by one, so it opens a
coalescing block itself (``CoalescedP2P``) and closes it when anyone waits or any
other op comes (``issue_on_inner``).

Leaves out: gloo, whose sends and receives need no grouping (``issue_on_inner``
passes them straight through).

References: torch.distributed.batch_isend_irecv (its first-call rule, and the grouping
it does only when ``type(group) is ProcessGroup``); ProcessGroupNCCL's
``startCoalescing``/``endCoalescing``; NCCL's group calls (ncclGroupStart/End).
"""
from __future__ import annotations

import threading


def issue_on_inner(p2p, op: str, backend, call, tensors):
    """Issue one op (``call(backend)``) on the real group ``backend``.

    NCCL sends and recvs join the open coalescing block ``p2p`` (a ``CoalescedP2P``, or
    None for a gloo-only group); any other op first closes every block open on this
    thread, on any group: NCCL's group (ncclGroupStart) is one per thread and spans every
    communicator, so an op issued while one is open would be swallowed into it."""
    if p2p is not None and op in ("send", "recv") and backend is p2p.backend:
        return p2p.issue(call, _device(tensors), tensors)
    if p2p is not None or open_blocks():
        close_open_blocks()
    return call(backend)


def _device(tensors):
    for t in tensors:
        if isinstance(t, (list, tuple)):
            return _device(t)
        return t.device
    raise ValueError("a send or recv without a tensor")


_THREAD = threading.local()  # NCCL's group depth is per thread: so are the open blocks


def open_blocks() -> list:
    if not hasattr(_THREAD, "blocks"):
        _THREAD.blocks = []
    return _THREAD.blocks


def close_open_blocks() -> None:
    """Close every coalescing block this thread has open (on any group): before another
    op, before a communicator is made, after a stall, and when a job ends."""
    for block in list(open_blocks()):
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
            open_blocks().append(self)
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
        if self in open_blocks():
            open_blocks().remove(self)
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
