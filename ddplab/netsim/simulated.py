"""Putting a simulated link under real collectives, through the choke point's future.

Teaches: how to slow communication down honestly. The real all-reduce still
runs (results stay exact); the work handed back to the strategy completes no
earlier than the modelled transfer on this rank's link queue. Because the
delay lives in the returned work and its future, a strategy that launches
early and waits late overlaps the simulated transfer with backward exactly as
it would a real slow link; a strategy that waits at once pays all of it.
Nothing ever sleeps inside an autograd hook.

Install with ``ddplab.sync.comm.set_link(SimulatedLink(model, world_size))``
on every rank (``use_link`` does it for a block), and label every result
"simulated".

Leaves out: the link's effect on the real transfer itself (the two simply
race, and the later one wins).
"""
from __future__ import annotations

import contextlib
import heapq
import itertools
import threading

import torch

from ..timeline.clock import now
from .link import LinkModel, LinkQueue


class SimulatedWork:
    """A Work-like object: ``wait()`` and ``get_future()`` finish at max(real, modelled)."""

    def __init__(self, work, sim_start: float, sim_end: float, clock: "_LinkClock"):
        self._work = work
        self.sim_start, self.sim_end = sim_start, sim_end
        self.real_end = None  # when the real transfer finished (set on completion)
        self._future = torch.futures.Future()

        def on_real(fut):
            self.real_end = now()
            try:
                value = fut.value()
            except Exception as exc:  # noqa: BLE001 - hand the failure on
                self._future.set_exception(exc)
                return
            if self.sim_end <= now():
                self._future.set_result(value)
            else:  # the link's clock thread, never the backend's own thread, holds the delay
                clock.complete_at(self.sim_end, self._future, value)

        work.get_future().then(on_real)

    def wait(self, timeout=None):
        self._work.wait()
        self._future.wait()
        return True

    def get_future(self):
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()


class _LinkClock:
    """One thread per link that completes futures at their simulated end times.

    One long-lived thread waiting on a condition wakes within a fraction of a
    millisecond; a new timer thread per transfer costs several milliseconds
    of start-up, which would make every simulated transfer look slower than
    the model.
    """

    def __init__(self):
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        threading.Thread(target=self._run, daemon=True, name="ddplab-simulated-link").start()

    def complete_at(self, t: float, future, value) -> None:
        with self._cv:
            heapq.heappush(self._heap, (t, next(self._seq), future, value))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                t, _, future, value = self._heap[0]
                delay = t - now()
                if delay > 0:
                    self._cv.wait(timeout=delay)
                    continue
                heapq.heappop(self._heap)
            future.set_result(value)


class SimulatedLink:
    """What ``ddplab.sync.comm.set_link`` expects: ``wrap(work, nbytes, group)``."""

    simulated = True

    def __init__(self, model: LinkModel, world_size: int):
        self.model = model
        self.world_size = world_size
        self.queue = LinkQueue(model, world_size)
        self._clock = _LinkClock()

    def wrap(self, work, nbytes: int, group=None) -> SimulatedWork:
        start, end = self.queue.schedule(now(), nbytes)
        return SimulatedWork(work, start, end, self._clock)

    def describe(self) -> dict:
        return self.model.describe()


@contextlib.contextmanager
def use_link(model: LinkModel | None, world_size: int):
    """Within the block, every collective through ddplab.sync.comm goes over ``model``."""
    from ..sync import comm

    previous = comm.link()
    comm.set_link(None if model is None else SimulatedLink(model, world_size))
    try:
        yield comm.link()
    finally:
        comm.set_link(previous)
