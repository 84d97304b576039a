"""The ranks a Cluster has now, and the only code that starts, replaces or stops them.

Teaches: a notebook's ranks are replaced many times in a session (a rank
raised mid-collective, a timeout, an Interrupt), and each replacement is a
new *generation*: new processes, a new store file, a new process group.
Everything here runs on the spawner thread (lifecycle.py), one operation at
a time, so whatever thread asked and however often it was interrupted, a
generation is either fully started and recorded in ``ranks``, or stopped
with its process groups killed and its files deleted; never half of each.

``stale`` is the invariant that makes Interrupts harmless: it is set before a
job is sent and cleared only once the job's outcome proves the ranks are in
step, so a call interrupted at any line leaves a note that the next call
reads, and the next call replaces the ranks first.

Leaves out, compared with torch.distributed.elastic: rendezvous rounds over
a network store, membership changes, restart limits.
"""
from __future__ import annotations

import itertools
import sys
import time

from ddplab.cluster import lifecycle
from ddplab.cluster.errors import ClusterError
from ddplab.cluster.output import RankOutput
from ddplab.cluster.process import RankProcesses
from ddplab.cluster.rendezvous import PrivateRendezvous


class StartProgress:
    """What a slow start says while the kernel waits, so that no cell is silent for long:
    nothing if the ranks are up within ``first_s``, then a line every ``every_s``, and a last
    line with the time it took. (Each rank is a new Python process that imports torch and
    joins the process group; on a loaded 2-core machine that can take half a minute.)"""

    def __init__(self, world_size: int, backend: str, t0: float, first_s: float = 5.0,
                 every_s: float = 10.0):
        self.world_size, self.backend, self.t0 = world_size, backend, t0
        self.next_s, self.every_s, self.spoke = first_s, every_s, False

    def __call__(self, n_ready: int) -> None:
        waited = time.monotonic() - self.t0
        if waited >= self.next_s:
            print(f"ddplab: starting {self.world_size} {self.backend} rank(s): {n_ready} of "
                  f"{self.world_size} ready after {waited:.0f} s (each imports torch and joins "
                  "the process group)...", file=sys.stderr, flush=True)
            self.next_s, self.spoke = waited + self.every_s, True

    def done(self, seconds: float) -> None:
        if self.spoke:
            print(f"ddplab: {self.world_size} rank(s) ready in {seconds:.1f} s.", file=sys.stderr,
                  flush=True)


class Generations:
    def __init__(self, world_size: int, backend: str, timeout: float, threads: int, env: dict,
                 gpus: tuple = ()):
        self.world_size, self.backend, self.timeout, self.gpus = world_size, backend, timeout, gpus
        self.threads, self.env = threads, env
        self.rendezvous = PrivateRendezvous()
        self.out = RankOutput()
        self._numbers = itertools.count()
        self.number = 0  # of the ranks now running: 0 for the first, 1 after one replacement...
        self.ranks: RankProcesses | None = None
        self.closed = False
        self.stale: str | None = None  # why the ranks must be replaced before the next job
        self.pending: lifecycle.Task | None = None  # the last operation handed to the spawner
        self.start_seconds = 0.0

    # -- run on the spawner thread only ---------------------------------------
    def start(self) -> float:
        if self.closed:
            raise ClusterError("this Cluster was shut down; start a new one: ddplab.Cluster(...)")
        t0 = time.monotonic()
        number = next(self._numbers)
        ranks = RankProcesses(self.world_size, self.backend, number, self.rendezvous, self.timeout,
                              self.threads, self.env, self.out.queue, lifecycle.lifeline_fd(),
                              self.gpus)
        try:
            lifecycle.interruption_point("start:spawned")
            said = StartProgress(self.world_size, self.backend, t0)
            first = ranks.wait_ready(deadline=t0 + max(60.0, self.timeout) + 30.0, progress=said)
        except BaseException:
            self._discard(ranks)
            raise
        if all(m[0] == "ready" for m in first) and not self.closed:
            self.ranks, self.stale, self.number = ranks, None, number
            self.start_seconds = time.monotonic() - t0
            said.done(self.start_seconds)
            return self.start_seconds
        self._discard(ranks)
        if self.closed:  # shut down, or abandoned by an interrupted Cluster(), while starting
            raise ClusterError("this Cluster was shut down while its ranks were starting")
        why = []
        for r, m in enumerate(first):
            if m[0] == "init_failed":
                why.append(f"rank {r}: {m[1]['type']}: {m[1]['message']}")
            elif m[0] != "ready":
                why.append(f"rank {r}: {m[0]} {m[1:] if len(m) > 1 else ''}".rstrip())
        raise ClusterError("ranks failed to start (their output is above):\n" + "\n".join(why))

    def stop(self, graceful: bool) -> list[int] | None:
        ranks, self.ranks = self.ranks, None
        return self._discard(ranks, graceful) if ranks is not None else None

    def replace(self) -> float:
        self.stop(graceful=False)
        lifecycle.interruption_point("replace:stopped")
        return self.start()

    def close(self, graceful: bool) -> list[int] | None:
        self.closed = True
        try:
            return self.stop(graceful)
        finally:
            self.rendezvous.remove()

    def _discard(self, ranks: RankProcesses, graceful: bool = False) -> list[int]:
        try:
            return ranks.stop(graceful=graceful)
        finally:
            self.rendezvous.forget(ranks.generation, self.world_size)

    # -- any thread --------------------------------------------------------------
    def abandon(self) -> None:
        """The Cluster object is gone (garbage collected, or its __init__ was
        interrupted): kill its ranks on the spawner thread, without waiting
        and without printing, since nobody is there to read it."""
        if not self.closed:
            self.closed = True
            lifecycle.spawner.submit(self.close, False)
