"""A ring all-reduce from send and recv, and what it costs: the algorithm behind all_reduce.

Teaches: the ring, the classic bandwidth-optimal way to all-reduce large
tensors (libraries choose among several algorithms per call; the ring is the
one whose cost is easiest to count). The tensor is cut into p chunks; in p-1 steps of
REDUCE-SCATTER every rank sends one chunk to its right neighbour and adds the
chunk arriving from its left, so that afterwards rank r holds the full sum of
one chunk; in p-1 steps of ALL-GATHER the finished chunks travel round the
ring once more. Each rank sends 2(p-1) chunks of n/p elements: 2(p-1)/p of
the data on its one outgoing link, almost twice the data however many ranks
there are. That is why DDP's traffic per step is about twice the gradients'
size, and why the time of an all-reduce hardly grows with p.

``ring_all_reduce(tensor)`` is ddplab's version (the lab's exercise is to
write it). Each step posts its send and its receive together
(``batch_isend_irecv``), then waits: NCCL asks that point-to-point calls which
must progress at the same time be one group (its user guide, "Point-to-point
communication"); a ring of blocking ``send`` then ``recv`` is not, and can
deadlock at 3 or more NCCL ranks. In plain torch only ``batch_isend_irecv``
makes that group (it coalesces a batch for torch's own NCCL groups); an
``isend`` or ``irecv`` called alone is an NCCL op of its own, which
ProcessGroupNCCL started with ``device_id`` (eager init) serializes with every
other op on the group, warning that it does. ``watch_p2p`` observes every send and recv
through the observing group (``ddplab.pg.group``), however they are
spelled, counts them, notes a wait made before the other half of the exchange
was posted and a send or recv issued outside ``batch_isend_irecv``, and stops a wait that finds no partner after ``timeout`` seconds
with a message instead of hanging. ``send_waits_on_rank`` measures
how long a blocking ``dist.send`` takes when the receiver is late: on gloo
(CPU tensors) ``send`` returns only once the receiver has posted its
``recv``, whatever the size; on NCCL ``send`` returns to the host once it is
queued on the GPU (``WorkNCCL::wait`` makes the current stream wait, see
torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp), so a ring in
which every rank sends first may or may not deadlock there: never rely on it.

Leaves out, compared with NCCL and gloo: trees and other algorithms chosen
for small messages or many nodes, pipelining a chunk in slices, several rings
over several links (NVLink), in-place buffers without copies, and reduce ops
other than SUM.

References: Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for
clusters of workstations" (2009); Baidu's ring all-reduce write-up (2017);
NCCL's docs on collective algorithms and on point-to-point communication
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/p2p.html);
torch.distributed send/recv/isend/irecv, P2POp, batch_isend_irecv.
"""
from __future__ import annotations

import contextlib
import datetime
import sys

_CALLS = 0
# The torch.distributed functions a learner calls to send or receive, as their frames show them.
_P2P_CALLS = ("send", "recv", "isend", "irecv")


def ring_all_reduce(tensor, group=None):
    """SUM ``tensor`` over every rank, in place, with point-to-point messages only.

    Works for any length (chunks from ``torch.tensor_split`` differ by at most one
    element). Each step posts its send and its receive together, one
    ``batch_isend_irecv`` of two ``P2POp``, then waits for both: no rank waits for its
    receiver before receiving itself, and NCCL gets the send and the receive that must
    progress together as one group, which it needs (gloo would also take ``isend``,
    ``recv``, then the send's ``wait``).
    """
    import torch
    import torch.distributed as dist

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    if p == 1:
        return tensor
    flat = tensor.view(-1)  # a view: chunks below write into ``tensor`` itself
    chunks = torch.tensor_split(flat, p)
    right, left = _peer((rank + 1) % p, group), _peer((rank - 1) % p, group)
    for step in range(p - 1):  # reduce-scatter: chunk (rank - step) goes right
        send, recv = chunks[(rank - step) % p], chunks[(rank - step - 1) % p]
        recv.add_(_exchange(send, recv, right, left, group))
    for step in range(p - 1):  # all-gather: the finished chunk (rank + 1 - step) goes right
        send, recv = chunks[(rank + 1 - step) % p], chunks[(rank - step) % p]
        recv.copy_(_exchange(send, recv, right, left, group))
    return tensor


def send_waits_on_rank(delay_s: float = 0.5, numel: int = 1) -> dict:
    """Rank 0 ``dist.send``s ``numel`` floats to rank 1, which posts its ``recv`` only after
    ``delay_s``: how long did the blocking send take on rank 0? (Other ranks idle.)"""
    import time

    import torch
    import torch.distributed as dist

    from ddplab.pg.backend import backend_name, device

    t = torch.ones(numel, device=device())
    rank = dist.get_rank()
    took = None
    # line the ranks up first: rank 1's delay then counts from the moment rank 0 starts its send
    dist.barrier()
    if rank == 0:
        t0 = time.perf_counter()
        dist.send(t, 1)
        took = time.perf_counter() - t0
    elif rank == 1:
        time.sleep(delay_s)
        dist.recv(t, 0)
    dist.barrier()
    return {"backend": backend_name(), "send_s": took, "delay_s": delay_s, "numel": numel}


def _exchange(send, like, right, left, group):
    """Send ``send`` right while receiving a tensor shaped like ``like`` from the left:
    both posted as one group, then both waited for."""
    import torch
    import torch.distributed as dist

    incoming = torch.empty_like(like)
    ops = [dist.P2POp(dist.isend, send.contiguous(), right, group),
           dist.P2POp(dist.irecv, incoming, left, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return incoming


def _peer(group_rank, group):
    import torch.distributed as dist

    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def ring_bytes_model(numel: int, element_size: int, world_size: int) -> float:
    """Bytes one rank sends (= bytes on its outgoing link) in a ring all-reduce: 2(p-1)/p * n."""
    return 2 * (world_size - 1) / world_size * numel * element_size


def ring_bytes_exact(numel: int, element_size: int, world_size: int) -> list:
    """Bytes each rank sends in ``ring_all_reduce`` (chunks of unequal size make it differ a little)."""
    sizes = [numel // world_size + (1 if i < numel % world_size else 0) for i in range(world_size)]
    p = world_size
    return [element_size * sum(sizes[(r - s) % p] + sizes[(r + 1 - s) % p] for s in range(p - 1))
            for r in range(p)]


class P2PStalled(RuntimeError):
    """A blocking send or recv found no partner within the timeout (the ring would hang)."""

    def __init__(self, op: str, peer: int, waited_s: float):
        self.op, self.peer, self.waited_s = op, peer, waited_s
        what = "send to" if op == "send" else "recv from"
        other = "recv" if op == "send" else "send"
        super().__init__(f"blocked in {what} rank {peer}: no matching {other} there "
                         f"after {waited_s:g} s")

    def __reduce__(self):
        return (P2PStalled, (self.op, self.peer, self.waited_s))


class SizeMismatch(RuntimeError):
    """A recv posted for another number of elements than its sender sent."""


class P2PLog:
    """What one rank did inside ``watch_p2p``: messages, bytes, collectives called."""

    def __init__(self):
        self.sent, self.received, self.collectives = [], [], []
        # the real works, kept alive: dropping an unfinished gloo send (the learner's code
        # raised before waiting) would cancel it and leave its receiver blocked
        self.works = []
        self.unfinished = 0  # sends/recvs posted and not (successfully) waited: may still be in gloo
        self.posted = {"send": 0, "recv": 0}
        # the first wait for a send (recv) made while this rank had posted fewer recvs (sends):
        # that exchange was not posted as one group (what NCCL needs, see ring_all_reduce)
        self.ungrouped = None
        # the first send or recv not issued from batch_isend_irecv (see issued_from): plain
        # torch on NCCL runs such an op alone (see ring_all_reduce), not grouped with its partner
        self.unbatched = None

    @property
    def bytes_sent(self) -> int:
        return sum(b for _, _, b in self.sent)

    @property
    def bytes_received(self) -> int:
        return sum(b for _, _, b in self.received)

    def as_dict(self) -> dict:
        return {"sent": list(self.sent), "received": list(self.received),
                "collectives": list(self.collectives), "bytes_sent": self.bytes_sent,
                "unfinished": self.unfinished, "ungrouped": self.ungrouped,
                "unbatched": self.unbatched,
                "bytes_received": self.bytes_received}


class P2PWatch:
    """An observer of the observing group (``ddplab.pg.group``) that pairs sends and recvs.

    Every send and recv reaches the group, however it was called (``dist.send``, an
    imported ``isend``, ``P2POp`` in ``batch_isend_irecv``). Each side leaves a note in the
    group's store when it posts: the sender ``offered`` (its element count), the receiver
    ``ready`` (its buffer's). A side that finds the other's note with another count raises
    ``SizeMismatch`` before posting anything. A wait meets the partner's note first and
    raises ``P2PStalled`` if none comes within ``timeout``: a blocking send waits for its
    receiver, as it does on gloo, whatever the backend."""

    def __init__(self, log: P2PLog, store, prefix: str, rank: int, timeout: float):
        self.log, self.store, self.prefix, self.rank = log, store, prefix, rank
        self.timeout = timeout  # also caps the real wait (ObservingGroup.wait_limit)
        self.count: dict = {}  # (src, dst) -> messages posted so far on that pair

    def key(self, src, dst, n, what):
        return f"{self.prefix}/{src}->{dst}/{n}/{what}"

    def launched(self, op, tensors, group, peer):
        if op not in ("send", "recv"):
            self.log.collectives.append(op)
            return None
        tensor = tensors[0]
        src, dst = (self.rank, peer) if op == "send" else (peer, self.rank)
        n = self.count[src, dst] = self.count.get((src, dst), -1) + 1
        mine, theirs = ("offered", "ready") if op == "send" else ("ready", "offered")
        token = {"op": op, "peer": peer, "theirs": self.key(src, dst, n, theirs), "tensor": tensor,
                 "src": src, "dst": dst}
        self.store.set(self.key(src, dst, n, mine), str(tensor.numel()))  # first mine, then theirs:
        if self.store.check([token["theirs"]]):  # one side always sees the other
            self.same_size(token)  # before posting: nothing is left half-sent
        record = (peer, tensor.numel(), tensor.numel() * tensor.element_size())
        (self.log.sent if op == "send" else self.log.received).append(record)
        called = issued_from()
        if self.log.unbatched is None and called != "batch_isend_irecv":
            self.log.unbatched = (f"called dist.{called or op} {'to' if op == 'send' else 'from'} "
                                  f"rank {peer} outside dist.batch_isend_irecv")
        self.log.posted[op] += 1
        self.log.unfinished += 1
        return token

    def same_size(self, token) -> None:
        """Raise SizeMismatch when the partner's note gives another element count than ours."""
        other, mine = int(self.store.get(token["theirs"])), token["tensor"].numel()
        if other != mine:
            sent, got = (mine, other) if token["op"] == "send" else (other, mine)
            raise SizeMismatch(f"rank {token['dst']} posted a recv of {got} elements from rank "
                               f"{token['src']}, which sent {sent}")

    def started(self, token, work):
        if token is not None:
            self.log.works.append((work, token["tensor"]))
        return None

    def waiting(self, token):
        if token is None or token.get("waited"):
            return
        posted, other = self.log.posted, "recv" if token["op"] == "send" else "send"
        if self.log.ungrouped is None and posted[other] < posted[token["op"]]:
            self.log.ungrouped = (f"waited for its {token['op']} {'to' if other == 'recv' else 'from'} "
                                  f"rank {token['peer']} before posting its {other}")
        try:
            self.store.wait([token["theirs"]], datetime.timedelta(seconds=self.timeout))
        except Exception:  # the store's timeout error type differs between torch versions
            raise P2PStalled(token["op"], token["peer"], self.timeout) from None
        self.same_size(token)  # the partner may have posted after we did, and refused
        token["waited"] = True
        self.log.unfinished -= 1

    def future_taken(self, token):
        self.waiting(token)  # a future is waited on through itself: meet the partner now

    def failed(self, token, exc):
        if token is None:
            return
        if token.pop("waited", False):
            self.log.unfinished += 1  # the real wait failed: still posted
        from ddplab.pg.inner import timed_out

        if timed_out(exc):  # gloo's words or NCCL's
            raise P2PStalled(token["op"], token["peer"], self.timeout) from None


def issued_from() -> str | None:
    """Which torch.distributed function the send or recv being issued came from: the
    outermost of ``batch_isend_irecv``, ``send``, ``recv``, ``isend``, ``irecv`` on the
    stack (None if none). A group that is not torch's own ``ProcessGroup`` (the observing
    one) is handed a batch's ops one by one, so only the stack tells a batch from
    separately called ``isend``/``irecv``."""
    import torch.distributed.distributed_c10d as c10d

    home, found = c10d.__file__, None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == home and code.co_name in _P2P_CALLS + ("batch_isend_irecv",):
            found = code.co_name  # keep climbing: send calls isend, a batch calls isend/irecv
        frame = frame.f_back
    return found


@contextlib.contextmanager
def watch_p2p(timeout: float = 10.0, tag: str | None = None):
    """Count this rank's point-to-point traffic; a blocking send waits for its receiver.

    Inside, every send and recv on the default group is logged as ``(peer, numel,
    bytes)`` however it is spelled, and met with its partner (``P2PWatch``): a wait
    with no partner raises ``P2PStalled`` after ``timeout`` seconds instead of hanging,
    and a recv whose buffer size differs from what was sent raises ``SizeMismatch``.
    Collectives are logged (the exercise forbids them). Every rank must enter it with
    the same ``tag`` (default: how many times this rank entered it, the same on every
    rank when all call it alike). Needs the observing group (a Cluster's ranks,
    ``ddplab.init_from_env``).
    """
    import torch.distributed as dist

    from ddplab.pg.group import observe

    global _CALLS
    _CALLS += 1  # every rank enters in the same order, so the default tags agree
    store = dist.distributed_c10d._get_default_store()
    log = P2PLog()
    watch = P2PWatch(log, store, f"ddplab-p2p/{tag or _CALLS}", dist.get_rank(), timeout)
    with observe(watch):
        yield log
