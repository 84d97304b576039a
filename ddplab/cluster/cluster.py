"""Cluster: ranks that live across notebook cells, and fail cleanly.

Teaches: data parallelism needs N processes that each run the SAME code on
their own data and meet in collectives. ``Cluster(world_size=2)`` starts them
once; ``cluster.run(fn)`` runs ``fn`` on every rank and returns the results by
rank. The ranks meet on a FileStore in a directory only this user can open
(rendezvous.py): the kernel listens on no port at all.

How failures are handled, because in data parallelism one rank's error strands
the others inside a collective:
- a rank raises: its peers get a few seconds to finish; any rank still busy is
  stack-dumped. One RankError names the root cause first (a rank that died,
  with its signal; then the earliest error; knock-on errors last). The ranks
  are kept only if every collective found its partner (diagnosis.py);
  otherwise they are replaced, since the next job would pair with stale ones.
- a collective stalls past ``timeout``: torch raises on the stuck rank; the
  group is unusable after that, so the ranks are replaced (CollectiveTimeout).
- the job outlives ``job_timeout``, or Interrupt is pressed: stacks are shown,
  the ranks are replaced, results of that job can never come back later
  (every job carries an id). A job's output is bounded per rank (output.py),
  so neither check waits behind a flood of prints.
- a rank that died while idle (``kill -9``, the out-of-memory killer) is
  noticed before the next job, which replaces the ranks and says so.

Threads: ``run`` may be called from any thread; jobs run one at a time (a
second caller waits for the first job to end: the ranks can only be in one
collective sequence). Ranks are started and stopped by one long-lived thread
(lifecycle.py), so they live as long as the Cluster, whichever thread made
it, and an Interrupt at any moment leaves the cluster usable.

Everything a job starts lives in its rank's process group and dies with the
rank at shutdown, replacement or the kernel's death (a process that calls
``setsid`` escapes: that is what it asks for). An unreferenced Cluster that is
garbage collected has its ranks killed at once, in the background; call
``shutdown()`` (or use ``with``) for a clean exit.

Leaves out, compared with torchrun: multi-node (see ``init_from_env``),
elastic membership, restart policies.

References: torch.distributed.FileStore; torch.multiprocessing's ``spawn``
error propagation; ipyparallel's engines (the same idea at scale).
"""
from __future__ import annotations

import atexit
import itertools
import sys
import threading
import time
import weakref

from ddplab.cluster import diagnosis, lifecycle, subset
from ddplab.cluster.answers import GRACE_S, collect_answers  # noqa: F401 - GRACE_S kept importable here
from ddplab.cluster.errors import ClusterError, CollectiveTimeout, JobTimeout, RankDied, RankError
from ddplab.cluster.generations import Generations
from ddplab.cluster.process import RankProcesses
from ddplab.placement import gpus as gpu_placement
from ddplab.placement import resources

_live: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


class Cluster:
    """``world_size`` long-lived ranks; see the module docstring."""

    def __init__(self, world_size: int = 2, backend: str = "auto", timeout: float = 60.0,
                 env: dict | None = None, *, gpus=None, threads: int | None = None):
        self.world_size = resources.check_world_size(world_size)
        # Free GPUs only under "auto", locked until shutdown: learners never share one (gpus.py).
        placed = gpu_placement.place(world_size, resources.check_backend(backend), gpus, reserve=True)
        self.backend, self.gpus, self._gpu_lock = placed.backend, placed.gpus, placed.reservation
        for note in placed.notes:
            print(note, file=sys.stderr)
        self.timeout, self.env = resources.check_timeout(timeout), resources.check_env(env)
        self.threads_per_rank = resources.check_threads(threads, world_size)
        self.oversubscribed = resources.oversubscribed(world_size, self.backend)
        self._job_ids = itertools.count(1)
        self._lock = threading.Lock()  # one job (or shutdown) at a time, from any thread
        self.exit_codes: list[int] | None = None  # set by shutdown(); 0 = left cleanly
        # What a rank sends besides results: on_display(rank, payload) for display
        # objects made during a job (%%ddp sets it); the job now running, for status().
        self.on_display = None
        self.running: dict | None = None
        self._gens = Generations(self.world_size, self.backend, self.timeout,
                                 self.threads_per_rank, self.env, self.gpus)
        # Garbage collection kills the ranks at once, never a slow clean shutdown.
        self._finalizer = weakref.finalize(self, self._gens.abandon)
        self._finalizer.atexit = False
        try:
            self._lifecycle(self._gens.start, point="start:waiting")
        except BaseException:  # an Interrupt while starting leaves no rank behind
            self._gens.abandon()
            self._gpu_lock.release()
            raise
        _live.add(self)

    @property
    def start_seconds(self) -> float:
        return self._gens.start_seconds

    @property
    def generation(self) -> int:
        """How many times the ranks were started before these (0: the first ranks)."""
        return self._gens.number

    @property
    def pids(self) -> list[int]:
        ranks = self._gens.ranks
        return list(ranks.pids) if ranks else []

    # -- lifecycle -----------------------------------------------------------
    def _lifecycle(self, fn, *args, point: str | None = None):
        """Hand a start/stop to the spawner thread and wait for it (see lifecycle.Task.wait)."""
        task = self._gens.pending = lifecycle.spawner.submit(fn, *args)
        try:
            if point:
                lifecycle.interruption_point(point)
            return task.wait()
        finally:
            self._gens.out.show()

    def shutdown(self) -> None:
        """Stop the ranks (they leave without gloo's teardown abort) and delete the store."""
        gens = self._gens
        if gens.closed:
            return
        gens.closed = True  # from here on nothing starts ranks for this Cluster
        _live.discard(self)
        self._finalizer.detach()
        # A job running in another thread would take too long to wait for: kill its ranks.
        idle = self._lock.acquire(timeout=2.0)
        try:
            self.exit_codes = self._lifecycle(gens.close, idle)
        finally:
            if idle:
                self._lock.release()
            self._gpu_lock.release()  # the ranks are gone: others may take the GPUs
            gens.out.show(final=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __repr__(self):
        state = "shut down" if self._gens.closed else f"pids={self.pids}"
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}, {state})"

    def _replace(self, why: str) -> str:
        """Kill the current ranks and start fresh ones; returns a note for the learner.

        Never raises ClusterError: a failed replacement must not hide the error
        that caused it. The next call starts ranks again (and says why not)."""
        old = self.pids
        try:
            self._lifecycle(self._gens.replace, point="replace:waiting")
        except Exception as exc:  # noqa: BLE001 - reported in the note, under the real error
            return (f"{why} Replacing the ranks failed ({type(exc).__name__}: {exc}); the next call will try to "
                    "start them again.")
        return (f"{why} The ranks were replaced (old pids {old}, new pids {self.pids}); "
                "anything they held (models, variables) is gone. The cluster is ready.")

    def _ready(self) -> RankProcesses:
        """Ranks fit for a job: finish an interrupted operation, replace stale or dead ranks."""
        gens = self._gens
        if gens.pending is not None and not gens.pending.done.is_set():
            try:
                self._lifecycle(_nothing, point="ready:waiting")  # queued behind it: waits for it
            except Exception:  # a failed replacement: handled below
                pass
        if gens.ranks is None:  # a replacement failed earlier: raises ClusterError if it still fails
            self._lifecycle(gens.start)
            return gens.ranks
        dead = [(r, gens.ranks.exit_status(r)) for r in range(self.world_size)
                if not gens.ranks.alive(r)]
        if gens.stale or dead:
            why = gens.stale or "; ".join(
                f"rank {r} (pid {gens.ranks.pids[r]}) had died while idle "
                f"({diagnosis.exit_words(code)})" for r, code in dead) + "."
            note = self._replace(why)
            if gens.ranks is None:
                raise ClusterError(note)
            print(note, file=sys.stderr)
        return gens.ranks

    def ensure_ready(self, stale: str | None = None) -> list[int]:
        """Replace dead or stale ranks now rather than at the next job; returns the pids.

        For callers that prepare fresh ranks (the %%ddp magics define names on
        them) and must know before a job whether the ranks are new. ``stale``
        (a reason) replaces them anyway: a grader that left a send half-done."""
        with self._lock:
            if self._gens.closed:
                raise ClusterError("this Cluster was shut down; start a new one: ddplab.Cluster(...)")
            self._gens.stale = stale or self._gens.stale
            self._ready()
            return self.pids

    # -- running jobs --------------------------------------------------------
    def run(self, fn, *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results by rank."""
        return self.run_job(fn, args, kwargs)

    def status(self):
        """Each rank's pid, device, memory and job, with the backend, timeout and
        generation (how many times the ranks were started before these)."""
        from ddplab.cluster.status import cluster_status

        return cluster_status(self)

    def run_job(self, fn, args=(), kwargs=None, *, job_timeout: float | None = None,
                show_ranks=None, ranks=None) -> list:
        """Like ``run`` with a wall-clock limit ``job_timeout`` (seconds) for this job.

        ``show_ranks`` (an iterable of ranks) limits whose output is shown, for
        this job only: later messages (replacement, shutdown) show every rank.
        ``ranks`` runs the job on those ranks only (the list still has one slot
        per rank: None for the others); a collective called there raises at
        once, since the other ranks are not taking part (see subset.py).
        """
        import cloudpickle

        if not callable(fn):
            raise TypeError(f"run() needs a function to run on every rank, got {fn!r}")
        if job_timeout is not None and not job_timeout > 0:
            raise ValueError(f"job_timeout must be a positive number of seconds, got {job_timeout!r}")
        targets = set(range(self.world_size)) if ranks is None else subset.check(ranks, self.world_size)
        name = getattr(fn, "__name__", type(fn).__name__)
        if targets != set(range(self.world_size)):
            fn, args, kwargs = subset.guarded_call, (sorted(targets), fn, *args), kwargs
        # The job travels pickled twice: a rank that cannot unpickle the function
        # (say it refers to a module only the kernel can import) still knows the
        # job's id and answers with that error instead of crashing.
        job = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
        with self._lock:
            if self._gens.closed:
                raise ClusterError("this Cluster was shut down; start a new one: ddplab.Cluster(...)")
            ranks = self._ready()
            job_id = next(self._job_ids)
            payload = cloudpickle.dumps(("job", job_id, job))
            out = self._gens.out
            self._gens.stale = "The previous job was interrupted before every rank had finished it."
            ranks.begin_job()
            out.shown_ranks = None if show_ranks is None else set(show_ranks)
            self.running = {"id": job_id, "name": name, "pending": set(targets),
                            "ranks": set(targets), "start": time.monotonic()}
            try:
                try:
                    for rank in sorted(targets):
                        try:
                            ranks.conns[rank].send_bytes(payload)
                        except OSError:
                            pass  # that rank died just now: collect_answers sees its end
                        if rank == min(targets):
                            lifecycle.interruption_point("run:sent")
                    outcome = collect_answers(ranks, job_id, job_timeout, self._gens,
                                              self.running["pending"], self.on_display)
                    lifecycle.interruption_point("run:collected")
                    ranks.drain()  # what the job printed belongs to this call, not the next one
                finally:
                    self.running = None
                    out.show_overflow(ranks.end_job())
                    out.shown_ranks = None
            except KeyboardInterrupt:
                stacks = ranks.dump_stacks(range(self.world_size))
                for r, text in sorted(stacks.items()):
                    print(f"[rank {r}] was at:\n{text}", file=sys.stderr)
                print(self._replace("Interrupted."), file=sys.stderr)
                raise
            return self._finish(ranks, *outcome, targets=targets)

    def _finish(self, ranks, results, failures, groups, pending, why, targets) -> list:
        if not failures and not pending:
            self._gens.stale = None
            return [results.get(r) for r in range(self.world_size)]
        diagnosis.unpickle_exceptions(failures)
        status = diagnosis.rank_status(self.world_size, results, failures, targets)
        stacks = ranks.dump_stacks(pending) if pending else {}
        if why == "job_timeout":
            note = self._replace("The job ran past its job_timeout.")
            raise JobTimeout(failures, status, note, stacks,
                             head=f"job did not finish within job_timeout on rank(s) {sorted(pending)}")
        in_step = not pending and diagnosis.lined_up(groups)
        timed_out = sorted(r for r, f in failures.items()
                           if diagnosis.is_collective_timeout(f, self.timeout, self.backend, in_step))
        reason = diagnosis.replace_reason(failures, pending, groups, timed_out)
        if reason:
            note = self._replace(reason)
        else:
            self._gens.stale = None
            note = "Every rank answered and their collectives line up: the ranks and their state are kept."
        if timed_out:
            watchdog = any(failures[r].get("died") for r in timed_out)
            raise CollectiveTimeout(
                failures, status, note, stacks,
                head=(f"a collective timed out after {self.timeout:g} s on rank(s) {timed_out}"
                      + (" (NCCL's watchdog aborted the rank)" if watchdog else "")
                      + ": did every rank call the same collectives in the same order?"))
        if any(f.get("died") for f in failures.values()):
            raise RankDied(failures, status, note, stacks)
        raise RankError(failures, status, note, stacks)


def _nothing() -> None:
    pass


def launch(fn, *args, world_size: int = 2, backend: str = "auto", **kwargs) -> list:
    """Start ``world_size`` ranks, run ``fn`` once on each, shut down; results by rank."""
    with Cluster(world_size=world_size, backend=backend) as cluster:
        return cluster.run(fn, *args, **kwargs)


@atexit.register
def _shutdown_all() -> None:
    for cluster in list(_live):
        try:
            cluster.shutdown()
        except Exception:
            pass
