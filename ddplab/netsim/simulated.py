"""Putting a simulated link under real collectives, through the choke point's future.

Teaches: how to slow communication down honestly. The real all-reduce still
runs (results stay exact); the work handed back to the strategy completes no
earlier than the modelled transfer on this rank's link queue. Because the
delay lives in the returned work and its future, a strategy that launches
early and waits late overlaps the simulated transfer with backward exactly as
it would a real slow link; a strategy that waits at once pays all of it.
Nothing ever sleeps inside an autograd hook.

Install with ``ddplab.sync.comm.using_link(SimulatedLink(model, world_size))``
on every rank (a ``with`` block), ``close()`` the link afterwards (its clock
thread then ends), and label every result "simulated". On a rank of the
observing process group (``ddplab.pg.group``, every Cluster rank) the
link is installed on the observing groups themselves (``on_group``): every
all-reduce, broadcast, all-gather and reduce-scatter on them is delayed,
whoever makes it, torch DDP's C++ reducer, FSDP and a learner's code
included. Each is charged its own ring time for its full size
(``LinkModel.collective_seconds``, the rule ``ddplab.measure.fits`` predicts
with): an all-reduce of N bytes goes round the ring twice, a reduce-scatter
of N bytes (its input), an all-gather of N bytes (its gathered output: the
group hands the observer this rank's shard, so the link counts it p times) and
a broadcast of N bytes once, half the time. Other ops (reduce, gather,
scatter, all-to-all, sends and receives, barriers) pass undelayed. On a group
that is not observed ``ddplab.sync.comm`` wraps its own calls.

On a GPU the real transfer's end is not known on the host (NCCL's future
completes when the collective is queued), so the returned future is a CUDA
future (``Future(devices=[...])``) completed only after the link's thread
has made its stream wait for the real work (``work.wait()``, a stream
wait): whoever uses the result, torch DDP's copy back into the gradients
included, waits on the GPU for the real transfer and on the host for the
modelled one. Its "done" stamp is then the modelled end, labelled
"simulated"; the real end is the device timer's business.

Leaves out: the link's effect on the real transfer itself (the two simply
race, and the later one wins).
"""
from __future__ import annotations

import contextlib
import heapq
import itertools
import threading

import torch

from ddplab.contracts.clock import now
from ddplab.netsim.link import LinkModel, LinkQueue
from ddplab.pg.group import ObserverBase
from ddplab.pg.inner import payload_bytes


class SimulatedWork:
    """A Work-like object: ``wait()`` and ``get_future()`` finish at max(real, modelled)."""

    def __init__(self, work, sim_start: float, sim_end: float, clock: "_LinkClock", device=None):
        self._work = work
        self.sim_start, self.sim_end = sim_start, sim_end
        # when the real transfer finished (set on completion); on a GPU only when it was queued
        self.real_end = None
        self.on_device = device is not None and torch.device(device).type != "cpu"
        cuda = self.on_device and torch.device(device).type == "cuda"
        self._future = torch.futures.Future(devices=[device]) if cuda else torch.futures.Future()

        def on_real(fut):
            self.real_end = now()
            try:
                value = fut.value()
            except Exception as exc:  # noqa: BLE001 - hand the failure on
                self._future.set_exception(exc)
                return
            if self.sim_end <= now():
                self._future.set_result(value)  # a then-callback: its streams waited already
            else:  # the link's clock thread, never the backend's own thread, holds the delay
                # (on a GPU that thread's stream first waits for the real transfer)
                clock.complete_at(self.sim_end, self._future, value,
                                  before=work.wait if self.on_device else None)

        try:
            real = work.get_future()
        except RuntimeError:  # gloo's list reduce-scatter has no future (torch 2.13): only wait()
            real = _future_of_wait(work)
        real.then(on_real)

    def wait(self, timeout=None):
        self._work.wait() if timeout is None else self._work.wait(timeout)
        self._future.wait()
        return True

    def result(self):
        return self._future.value()

    def __getattr__(self, name):  # the rest of a Work (is_success, synchronize...): the real one
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._work, name)

    def get_future(self):
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def done_stamp(self) -> dict:
        """What the "done" stamp adds: when the link started the transfer, and
        whether the model ("simulated") or the slower real transfer ("cpu") ended it."""
        real_decided = (not self.on_device and self.real_end is not None
                        and self.real_end >= self.sim_end)  # a GPU's host stamp is enqueue time
        return {"start": self.sim_start, "simulated": True,
                "source": "cpu" if real_decided else "simulated"}


def _future_of_wait(work):
    """A future completed (value None: the work offered none) when ``work.wait()`` returns,
    waited for on a thread of its own: for the few works with no future of theirs."""
    fut = torch.futures.Future()

    def waiter():
        try:
            work.wait()
            fut.set_result(None)
        except Exception as exc:  # noqa: BLE001 - hand the failure on
            fut.set_exception(exc)

    threading.Thread(target=waiter, daemon=True, name="ddplab-simulated-link-wait").start()
    return fut


class _LinkClock:
    """One thread per link that completes futures at their simulated end times.

    One long-lived thread waiting on a condition wakes within a fraction of a
    millisecond; a new timer thread per transfer costs several milliseconds
    of start-up, which would make every simulated transfer look slower than
    the model. ``stop()`` ends the thread once every pending future is done.
    """

    def __init__(self):
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="ddplab-simulated-link")
        self.thread.start()

    def complete_at(self, t: float, future, value, before=None) -> None:
        """Complete ``future`` with ``value`` at ``t``, calling ``before()`` first if given."""
        with self._cv:
            if self._stopping:  # too late for the queue: complete it now rather than never
                _complete(future, value, before)
                return
            heapq.heappush(self._heap, (t, next(self._seq), future, value, before))
            self._cv.notify()

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._stopping:
                    self._cv.wait()
                if not self._heap:  # stopping, and nothing is pending
                    return
                t, _, future, value, before = self._heap[0]
                delay = t - now()
                if delay > 0:
                    self._cv.wait(timeout=delay)
                    continue
                heapq.heappop(self._heap)
            _complete(future, value, before)


def _complete(future, value, before) -> None:
    if before is not None:
        before()  # e.g. the real work's wait(): this thread's stream waits for the transfer
    future.set_result(value)


class SimulatedLink:
    """A ``ddplab.contracts.protocols.Link``: ``wrap(work, nbytes, group)``; ``close()`` when done."""

    simulated = True

    def __init__(self, model: LinkModel, world_size: int):
        self.model = model
        self.world_size = world_size
        self.queue = LinkQueue(model, world_size)
        self._clock = _LinkClock()

    def wrap(self, work, nbytes: int, group=None, device=None, op: str = "all_reduce") -> SimulatedWork:
        """``work``, completing no earlier than an ``op`` of ``nbytes`` (its full size) on the
        link's queue (``ddplab.netsim.link.RING_PASSES`` names the ops)."""
        start, end = self.queue.schedule(now(), nbytes, op)
        return SimulatedWork(work, start, end, self._clock, device)

    def describe(self) -> dict:
        return self.model.describe()

    def close(self) -> None:
        """Let the link's clock thread end (after completing what is still pending)."""
        self._clock.stop()

    def on_group(self) -> "OnGroup":
        """This link as an observer of the observing process group (``group.observe(...)``)."""
        return OnGroup(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# what carries data over the link: the collectives reducers and sharded strategies use (a
# sparse gradient on NCCL travels as all-gathers), by the observing group's names for them
# (ddplab.pg.group); barriers and point-to-point ops do not
LINKED_OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
              "reduce_scatter", "reduce_scatter_tensor")
# the group hands an observer a gather's INPUT (this rank's shard); the ring moves the output
GATHERS = ("all_gather", "all_gather_into_tensor")


class OnGroup(ObserverBase):
    """An observer (``ddplab.contracts.protocols.Observer``) that sends the group's
    collectives over ``link``: each returned work completes no earlier than the model says."""

    def __init__(self, link):
        self.link = link
        self._paused = threading.local()

    @contextlib.contextmanager
    def paused(self):
        """Within the block, on this thread, collectives pass undelayed: for a caller that
        makes several collectives of one transfer and delays their result itself."""
        self._paused.on = True
        try:
            yield
        finally:
            self._paused.on = False

    def launched(self, op, tensors, group, peer):
        if op not in LINKED_OPS or not tensors or getattr(self._paused, "on", False):
            return None
        nbytes = sum(payload_bytes(t) for t in tensors)  # a reduce-scatter's: its full input
        if op in GATHERS:  # this rank's shard(s): the gathered output is p of them (even shards)
            nbytes *= group.size()
        return op, nbytes, tensors[0].device

    def started(self, token, work):
        if token is None:
            return None
        op, nbytes, device = token
        return self.link.wrap(work, nbytes, None, device=device, op=op)
