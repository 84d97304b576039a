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
write it); ``watch_p2p`` counts what a rank sends and receives, and a
blocking ``send`` that waits for its receiver stops after ``timeout``
seconds with a message instead of hanging. ``send_waits_on_rank`` measures
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
NCCL's docs on collective algorithms; torch.distributed send/recv/isend/irecv.
"""
from __future__ import annotations

import contextlib
import datetime

_CALLS = 0
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "broadcast", "all_to_all", "all_to_all_single",
               "gather", "scatter")


def ring_all_reduce(tensor, group=None):
    """SUM ``tensor`` over every rank, in place, with point-to-point messages only.

    Works for any length (chunks from ``torch.tensor_split`` differ by at most one
    element). Each step posts the send with ``isend`` and the receive with ``recv``,
    then waits for the send: no rank waits for its receiver before receiving itself.
    Device tensors (NCCL) go as one ``batch_isend_irecv`` per step instead, as NCCL
    asks of a send and a receive that must progress together.
    """
    import torch
    import torch.distributed as dist

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    if p == 1:
        return tensor
    flat = tensor.view(-1)  # a view: chunks below write into ``tensor`` itself
    chunks = torch.tensor_split(flat, p)
    right, left = _peer((rank + 1) % p, group), _peer((rank - 1) % p, group)
    # NCCL: a send and a receive that run at once must be one group of operations
    # (batch_isend_irecv), or the ring can deadlock; gloo pairs them as they come.
    grouped = tensor.device.type != "cpu"
    for step in range(p - 1):  # reduce-scatter: chunk (rank - step) goes right
        send, recv = chunks[(rank - step) % p], chunks[(rank - step - 1) % p]
        recv.add_(_exchange(send, recv, right, left, group, grouped))
    for step in range(p - 1):  # all-gather: the finished chunk (rank + 1 - step) goes right
        send, recv = chunks[(rank + 1 - step) % p], chunks[(rank - step) % p]
        recv.copy_(_exchange(send, recv, right, left, group, grouped))
    return tensor


def send_waits_on_rank(delay_s: float = 0.5, numel: int = 1) -> dict:
    """Rank 0 ``dist.send``s ``numel`` floats to rank 1, which posts its ``recv`` only after
    ``delay_s``: how long did the blocking send take on rank 0? (Other ranks idle.)"""
    import time

    import torch
    import torch.distributed as dist

    from ddplab.cluster.backend import backend_name, device

    t = torch.ones(numel, device=device())
    rank = dist.get_rank()
    took = None
    if rank == 0:
        t0 = time.perf_counter()
        dist.send(t, 1)
        took = time.perf_counter() - t0
    elif rank == 1:
        time.sleep(delay_s)
        dist.recv(t, 0)
    dist.barrier()
    return {"backend": backend_name(), "send_s": took, "delay_s": delay_s, "numel": numel}


def _exchange(send, like, right, left, group, grouped):
    """Send ``send`` right while receiving a tensor shaped like ``like`` from the left."""
    import torch
    import torch.distributed as dist

    incoming = torch.empty_like(like)
    if grouped:
        ops = [dist.P2POp(dist.isend, send.contiguous(), right, group),
               dist.P2POp(dist.irecv, incoming, left, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return incoming
    work = dist.isend(send.contiguous(), right, group=group)
    dist.recv(incoming, left, group=group)
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


class _Late:
    """The work ``isend``/``irecv`` return inside ``watch_p2p``: it meets its partner at ``wait()``."""

    def __init__(self, finish, log):
        self._finish, self._done, self._log = finish, False, log
        log.unfinished += 1

    def wait(self, timeout=None):
        if not self._done:
            self._finish()
            self._done = True
            self._log.unfinished -= 1
        return True

    def is_completed(self):
        return self._done


class P2PLog:
    """What one rank did inside ``watch_p2p``: messages, bytes, collectives called."""

    def __init__(self):
        self.sent, self.received, self.collectives = [], [], []
        # isend/irecv works, kept alive: dropping an unfinished gloo send (the learner's code
        # raised before waiting) would cancel it and leave its receiver blocked
        self.works = []
        self.unfinished = 0  # isend/irecv not (successfully) waited for: may still be in gloo

    @property
    def bytes_sent(self) -> int:
        return sum(b for _, _, b in self.sent)

    @property
    def bytes_received(self) -> int:
        return sum(b for _, _, b in self.received)

    def as_dict(self) -> dict:
        return {"sent": list(self.sent), "received": list(self.received),
                "collectives": list(self.collectives), "bytes_sent": self.bytes_sent,
                "unfinished": self.unfinished,
                "bytes_received": self.bytes_received}


@contextlib.contextmanager
def watch_p2p(timeout: float = 10.0, tag: str | None = None):
    """Count this rank's point-to-point traffic; blocking send waits for its receiver.

    Inside, ``dist.send/recv/isend/irecv`` (looked up at call time, as learners'
    code does) are replaced by versions that log ``(peer, numel, bytes)`` and
    meet their partner through the group's store first: ``send`` and ``recv``
    wait up to ``timeout`` seconds for the other side and raise ``P2PStalled``
    instead of hanging; a recv whose buffer size differs from what was sent
    raises ``SizeMismatch``. Collectives are logged (the exercise forbids them).
    Every rank must enter it with the same ``tag`` (default: how many times this rank
    entered it, the same on every rank when all call it alike).
    """
    import torch.distributed as dist

    global _CALLS
    _CALLS += 1  # every rank enters in the same order, so the default tags agree
    store = dist.distributed_c10d._get_default_store()
    prefix = f"ddplab-p2p/{tag or _CALLS}"
    me = dist.get_rank()
    log = P2PLog()
    seq_to, seq_from = {}, {}
    wait = datetime.timedelta(seconds=timeout)
    real = {name: getattr(dist, name) for name in ("send", "recv", "isend", "irecv") + COLLECTIVES
            if hasattr(dist, name)}

    def key(src, dst, n, what):
        return f"{prefix}/{src}->{dst}/{n}/{what}"

    def offer(tensor, dst):
        n = seq_to[dst] = seq_to.get(dst, -1) + 1
        store.set(key(me, dst, n, "offered"), str(tensor.numel()))
        log.sent.append((dst, tensor.numel(), tensor.numel() * tensor.element_size()))
        return n

    def meet(tensor, src):
        n = seq_from[src] = seq_from.get(src, -1) + 1
        store.set(key(src, me, n, "ready"), "1")
        return n

    def await_key(k, op, peer):
        try:
            store.wait([k], wait)
        except Exception:  # the store's timeout error type differs between torch versions
            raise P2PStalled(op, peer, timeout) from None

    def check_size(tensor, src, n, drain=False):
        sent = int(store.get(key(src, me, n, "offered")))
        if sent != tensor.numel():
            if drain:  # take the message off the wire, so nothing is left pending in gloo
                real["recv"](tensor.new_empty(sent), src)
            raise SizeMismatch(f"rank {me} posted a recv of {tensor.numel()} elements from rank "
                               f"{src}, which sent {sent}")
        log.received.append((src, sent, sent * tensor.element_size()))

    def peer_of(kwargs, args, name):
        value = args[0] if args else kwargs.get(name)
        if value is None:
            raise ValueError(f"pass {name}= (the peer's rank): the ring knows its neighbours")
        return int(value)

    def send(tensor, *args, **kwargs):
        dst = peer_of(kwargs, args, "dst")
        n = offer(tensor, dst)
        await_key(key(me, dst, n, "ready"), "send", dst)  # NCCL semantics: wait for the recv
        return real["send"](tensor, *args, **kwargs)

    def isend(tensor, *args, **kwargs):
        dst = peer_of(kwargs, args, "dst")
        n = offer(tensor, dst)  # no wait here: that is what isend is for
        work = real["isend"](tensor, *args, **kwargs)
        log.works.append((work, tensor))

        def finish():  # ...but its wait() stops, rather than hangs, if no recv ever comes
            await_key(key(me, dst, n, "ready"), "send", dst)
            work.wait()
        return _Late(finish, log)

    def recv(tensor, *args, **kwargs):
        src = peer_of(kwargs, args, "src")
        n = meet(tensor, src)
        await_key(key(src, me, n, "offered"), "recv", src)
        check_size(tensor, src, n, drain=True)
        return real["recv"](tensor, *args, **kwargs)

    def irecv(tensor, *args, **kwargs):
        src = peer_of(kwargs, args, "src")
        n = meet(tensor, src)
        work = real["irecv"](tensor, *args, **kwargs)  # posted now: its sender may be blocked in send
        log.works.append((work, tensor))

        def finish():  # meet the sender at wait(): stop, rather than hang, if none comes
            await_key(key(src, me, n, "offered"), "recv", src)
            check_size(tensor, src, n)
            work.wait()
        return _Late(finish, log)

    def collective(name):
        def called(*args, **kwargs):
            log.collectives.append(name)
            return real[name](*args, **kwargs)
        return called

    patched = {"send": send, "recv": recv, "isend": isend, "irecv": irecv}
    patched.update({name: collective(name) for name in COLLECTIVES if name in real})
    for name, fn in patched.items():
        setattr(dist, name, fn)
    try:
        yield log
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
