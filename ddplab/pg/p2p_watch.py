"""Point-to-point traffic seen at the observing group: counted, paired, stopped before it hangs.

Teaches: where a send and a recv can be seen whatever way a learner wrote them.
Every ``dist.send``, ``dist.recv``, ``isend``, ``irecv`` and ``P2POp`` in
``batch_isend_irecv`` reaches the observing process group (``ddplab.pg.group``),
imported names included, with nothing patched: an observer installed there
(``observe``) sees each one launched and waited for. Two observers live here,
one per use:

- ``watch_p2p`` (lab 00's ring all-reduce and its graders): logs every message
  as ``(peer, numel, bytes)`` and every collective called; meets each send with
  its recv through notes in the group's store, so a wait with no partner raises
  ``P2PStalled`` after ``timeout`` seconds instead of hanging (a blocking send
  waits for its receiver, as it does on gloo, whatever the backend) and a recv
  sized differently from its send raises ``SizeMismatch`` before anything is
  posted; notes a wait made before the other half of its exchange was posted,
  and a send or recv issued outside ``batch_isend_irecv`` (``issued_from``):
  what NCCL would refuse to progress together (lessons/ring.py says why).
- ``p2p_counting`` (lab 08's pipeline and its grader): counts bytes and calls
  and keeps each message's shape and dtype; with a ``tag`` a blocking ``recv``
  is compared with what its sender announced and refused (``ValueError``) when
  they differ; a wait longer than ``recv_timeout_s`` raises ``TimeoutError``
  naming the peer.

Both learn how an op was called from the stack (``issued_from``): the observing
group is not torch's own ``ProcessGroup``, so torch hands it a batch's ops one
by one, and ``dist.recv`` reaches it as an ``irecv`` followed by a wait.

Leaves out, next to torch: sends and recvs on groups other than the default
one, the ``tag`` argument (the watch pairs the n-th send from one rank to
another with the n-th recv posted for it, whatever its tag), and NCCL's own
grouping (``ddplab.pg.p2p_blocks``), which this only judges.

References: torch/distributed/distributed_c10d.py (send, recv, isend, irecv,
P2POp, batch_isend_irecv); NCCL's user guide, "Point-to-point communication"
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/p2p.html).
"""
from __future__ import annotations

import contextlib
import datetime
import sys

from ddplab.pg.works import ObserverBase

# The torch.distributed functions a learner calls to send or receive, as their frames show them.
_P2P_CALLS = ("send", "recv", "isend", "irecv")
_CALLS = 0  # how many times this rank entered watch_p2p: its default tag


def issued_from() -> str | None:
    """Which torch.distributed function the send or recv being issued came from: the
    outermost of ``batch_isend_irecv``, ``send``, ``recv``, ``isend``, ``irecv`` on the
    stack (None if none). A group that is not torch's own ``ProcessGroup`` (the observing
    one) is handed a batch's ops one by one, so only the stack tells a batch from
    separately called ``isend``/``irecv``, and a blocking ``recv`` (which calls ``irecv``
    and waits, torch 2.13) from an ``irecv``."""
    import torch.distributed.distributed_c10d as c10d

    home, found = c10d.__file__, None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == home and code.co_name in _P2P_CALLS + ("batch_isend_irecv",):
            found = code.co_name  # keep climbing: send calls isend, a batch calls isend/irecv
        frame = frame.f_back
    return found


def _this_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


class PairCounter:
    """How many messages each (src, dst) pair has carried: both sides of a pair count alike,
    so the n-th send from src to dst and the n-th recv posted for it get the same number,
    the name of their notes in the store."""

    def __init__(self):
        self.count: dict = {}

    def next(self, src, dst) -> int:
        n = self.count[src, dst] = self.count.get((src, dst), -1) + 1
        return n


# -- watch_p2p: every message met with its partner -----------------------------------------------
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
        # that exchange was not posted as one group (what NCCL needs, see lessons/ring.py)
        self.ungrouped = None
        # the first send or recv not issued from batch_isend_irecv (see issued_from): plain
        # torch on NCCL runs such an op alone (see lessons/ring.py), not grouped with its partner
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
    """An observer of the observing group that pairs sends and recvs.

    Each side leaves a note in the group's store when it posts: the sender ``offered``
    (its element count), the receiver ``ready`` (its buffer's). A side that finds the
    other's note with another count raises ``SizeMismatch`` before posting anything. A
    wait meets the partner's note first and raises ``P2PStalled`` if none comes within
    ``timeout``: a blocking send waits for its receiver, as it does on gloo, whatever
    the backend."""

    def __init__(self, log: P2PLog, store, prefix: str, rank: int, timeout: float):
        self.log, self.store, self.prefix, self.rank = log, store, prefix, rank
        self.timeout = timeout  # also caps the real wait (ObservingGroup.wait_limit)
        self.pairs = PairCounter()

    def key(self, src, dst, n, what):
        return f"{self.prefix}/{src}->{dst}/{n}/{what}"

    def launched(self, op, tensors, group, peer):
        if op not in ("send", "recv"):
            self.log.collectives.append(op)
            return None
        tensor = tensors[0]
        src, dst = (self.rank, peer) if op == "send" else (peer, self.rank)
        n = self.pairs.next(src, dst)
        mine, theirs = ("offered", "ready") if op == "send" else ("ready", "offered")
        token = {"op": op, "peer": peer, "theirs": self.key(src, dst, n, theirs), "tensor": tensor,
                 "src": src, "dst": dst}
        # first my note, then a look for theirs: of two sides posting at once, one always sees the other
        self.store.set(self.key(src, dst, n, mine), str(tensor.numel()))
        if self.store.check([token["theirs"]]):
            self.same_size(token)  # before posting: nothing is left half-sent
        record = (peer, tensor.numel(), tensor.numel() * tensor.element_size())
        if op == "send":
            self.log.sent.append(record)
        else:
            self.log.received.append(record)
        called = issued_from()
        if self.log.unbatched is None and called != "batch_isend_irecv":
            direction = "to" if op == "send" else "from"
            self.log.unbatched = f"called dist.{called or op} {direction} rank {peer} outside dist.batch_isend_irecv"
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
            direction = "to" if other == "recv" else "from"
            self.log.ungrouped = (f"waited for its {token['op']} {direction} rank {token['peer']} "
                                  f"before posting its {other}")
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


@contextlib.contextmanager
def watch_p2p(timeout: float = 10.0, tag: str | None = None):
    """Count this rank's point-to-point traffic; a blocking send waits for its receiver.

    Inside, every send and recv on the default group is logged as ``(peer, numel,
    bytes)`` however it is spelled, and met with its partner (``P2PWatch``): a wait
    with no partner raises ``P2PStalled`` after ``timeout`` seconds instead of hanging,
    and a recv whose buffer size differs from what was sent raises ``SizeMismatch``.
    Collectives are logged (the ring exercise forbids them). Every rank must enter it
    with the same ``tag`` (default: how many times this rank entered it, the same on
    every rank when all call it alike). Needs the observing group (a Cluster's ranks,
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


# -- p2p_counting: bytes and calls, a blocking recv checked against its send ----------------------
class P2PCounter:
    """Bytes and calls of point-to-point traffic on this rank."""

    def __init__(self):
        self.sent = self.received = self.sends = self.recvs = 0
        self.messages = []  # (op, peer, shape, dtype) in call order: a grader pairs them up
        self.unwaited = 0  # isend/irecv works not (yet) waited for

    def note(self, op, tensor, peer):
        self.messages.append((op, peer, tuple(tensor.shape), str(tensor.dtype).replace("torch.", "")))

    def as_dict(self) -> dict:
        return {"sent": self.sent, "received": self.received, "sends": self.sends, "recvs": self.recvs,
                "messages": list(self.messages), "unwaited": self.unwaited}


def _described(tensor) -> str:
    return f"{tuple(tensor.shape)} {tensor.dtype}"


class P2PCountingWatch(ObserverBase):
    """The observer behind ``p2p_counting``: counts, notes and checks sends and recvs."""

    def __init__(self, counter: P2PCounter, recv_timeout_s, tag, store):
        self.counter, self.timeout, self.tag, self.store = counter, recv_timeout_s, tag, store
        self.pairs = PairCounter()

    def key(self, src, dst) -> str:
        """The store key of the next message from ``src`` to ``dst``."""
        return f"ddplab-pipe/{self.tag}/{src}->{dst}/{self.pairs.next(src, dst)}"

    def launched(self, op, tensors, group, peer):
        if op not in ("send", "recv") or not tensors:
            return None
        tensor, counter = tensors[0], self.counter
        counter.note(op, tensor, peer)
        nbytes = tensor.numel() * tensor.element_size()
        announced = self.store is not None and peer is not None
        if op == "send":
            if announced:
                self.store.set(self.key(group.rank(), int(peer)), _described(tensor))
            counter.sent, counter.sends = counter.sent + nbytes, counter.sends + 1
        else:
            if announced and issued_from() == "recv":  # a blocking dist.recv
                self.compare(tensor, int(peer), group)
            counter.received, counter.recvs = counter.received + nbytes, counter.recvs + 1
        counter.unwaited += 1
        return {"op": op, "peer": peer, "what": _described(tensor), "waited": False}

    def compare(self, tensor, src, group):
        """Raise ValueError when ``tensor`` is not what ``src`` announced it sends."""
        import ast

        import torch

        key = self.key(src, group.rank())
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout or 30))
        except Exception:  # the store's timeout error type differs between torch versions
            return  # nothing announced: the timed wait reports the hang
        sent = self.store.get(key).decode()
        if sent != _described(tensor):
            # take the message off the wire first (its sender may be blocked until it is
            # received), straight from the group's own gloo member: no observer sees it
            shape, dtype = sent.rsplit(" ", 1)
            drain = torch.empty(ast.literal_eval(shape), dtype=getattr(torch, dtype[6:]))
            group.cpu.recv([drain], src, 0).wait()
            raise ValueError(f"rank {group.rank()} posted a recv into {_described(tensor)} from "
                             f"rank {src}, which sent {sent}")

    def waiting(self, token):
        if token is not None and not token["waited"]:
            token["waited"] = True
            self.counter.unwaited -= 1

    def failed(self, token, exc):
        if token is None or self.timeout is None:
            return
        if token["op"] == "recv":
            where, never = "recv(src", "never sent it"
        else:
            where, never = "send(dst", "never received it"
        raise TimeoutError(f"rank {_this_rank()} waited {self.timeout:g} s in {where}="
                           f"{token['peer']}) for {token['what']} and nothing came: rank "
                           f"{token['peer']} {never} ({str(exc).splitlines()[0][:120]})") from None


@contextlib.contextmanager
def p2p_counting(recv_timeout_s: float | None = None, tag: str | None = None):
    """Within the block, every send and recv on this rank's process group is counted.

    Counted at the observing process group, so ``dist.send``, an ``isend`` imported
    before the block and ``batch_isend_irecv`` are all seen, with nothing patched; a
    work still unwaited at the end is counted in ``unwaited``.

    ``recv_timeout_s``: a wait longer than this raises ``TimeoutError`` naming the
    peer (instead of waiting out the whole group's timeout).

    ``tag`` (the same on both ranks, new for every call): each send first notes
    its shape and dtype in the store, and a blocking ``recv`` compares its buffer
    with them before it is posted, raising ``ValueError`` on a difference. gloo
    copies bytes: a smaller buffer aborts the receiving process, another dtype or
    shape of the same size fills it with garbage.
    """
    import torch.distributed as dist

    from ddplab.pg.group import observe

    store = dist.distributed_c10d._get_default_store() if tag else None
    with observe(P2PCountingWatch(P2PCounter(), recv_timeout_s, tag, store)) as watch:
        yield watch.counter
