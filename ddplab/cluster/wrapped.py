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

Leaves out: NCCL's own bootstrap timeouts (NCCL_* variables), the eager
connection that ``device_id`` asks for (``backend.init_group`` says why there
is none), and other backends.

References: torch/include/torch/csrc/distributed/c10d/ProcessGroupGloo.hpp
(``setTimeout``), ProcessGroupNCCL.hpp (``Options``, the watchdog);
torch.distributed.init_process_group (``timeout``).
"""
from __future__ import annotations

import datetime

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


def nccl_group(store, rank: int, size: int, timeout):
    """A real NCCL group with the collective ``timeout`` in its options.

    It connects at its first collective; the unique id it then reads from ``store``
    waits as long as the store does (a Cluster's ranks give their store the start-up
    limit, worker.py)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    if timeout is not None:
        opts._timeout = timeout if isinstance(timeout, datetime.timedelta) \
            else datetime.timedelta(seconds=timeout)
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def route(p2p, op: str, backend, call, tensors):
    """Issue one op (``call(backend)``) on the real group ``backend``.

    NCCL sends and recvs join the open coalescing block ``p2p`` (a ``CoalescedP2P``, or
    None for a gloo-only group); any other op first closes that block, since ops must
    reach NCCL in the order they were called."""
    if p2p is not None and op in ("send", "recv") and backend is p2p.backend:
        return p2p.issue(call, _device(tensors))
    if p2p is not None:
        p2p.close()
    return call(backend)


def _device(tensors):
    for t in tensors:
        if isinstance(t, (list, tuple)):
            return _device(t)
        return t.device
    raise ValueError("a send or recv without a tensor")


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
    ``batch_isend_irecv``'s docstring asks of its own first call. Written for NCCL and
    tested against a fake NCCL on CPU (tests/test_p2p_groups.py): never run on GPUs.
    """

    def __init__(self, backend):
        self.backend = backend
        self.device = None  # the open block's device, None when no block is open
        self.works: list = []

    def issue(self, call, device):
        """Add one op (``call(backend)``) to the open block, opening one if needed."""
        if self.device is not None and self.device != device:
            self.close()
        if self.device is None:
            self.backend._start_coalescing()  # Backend's binding: no device argument
            self.device = device
        call(self.backend)  # inside a block the op's own work (if any) is not the one to wait
        work = BlockWork(self)
        self.works.append(work)
        return work

    def close(self) -> None:
        """End the open block: NCCL launches it; every op in it shares the block's work."""
        if self.device is None:
            return
        works = self.works
        self.device, self.works = None, []
        real = self.backend._end_coalescing()
        for work in works:
            work.real = real


class BlockWork:
    """The work of one op in a coalescing block; asking anything of it closes the block."""

    def __init__(self, block: CoalescedP2P):
        self.block, self.real = block, None

    def _work(self):
        if self.real is None:
            self.block.close()
        return self.real

    def wait(self, timeout=None):
        work = self._work()
        return work.wait() if timeout is None else work.wait(timeout)

    def get_future(self):
        return self._work().get_future()

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
        return self._work().result()


def payload_bytes(tensor) -> int:
    """What a rank hands a collective: numel x element size; for a sparse tensor, the
    indices and values it holds (its numel is the dense shape's)."""
    if tensor.is_sparse:
        return (tensor._indices().numel() * tensor._indices().element_size()
                + tensor._values().numel() * tensor.element_size())
    return tensor.numel() * tensor.element_size()
