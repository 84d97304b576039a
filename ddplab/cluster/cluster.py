"""Cluster: ranks that live across notebook cells, and fail cleanly.

Teaches: data parallelism needs N processes that each run the SAME code on
their own data and meet in collectives. ``Cluster(world_size=2)`` starts them
once; ``cluster.run(fn)`` runs ``fn`` on every rank and returns the results by
rank. The group's rendezvous is a TCPStore hosted by this (kernel) process on
127.0.0.1 with a port the OS picks, so two clusters, or two classrooms on one
server, never collide.

How failures are handled, because in data parallelism one rank's error strands
the others inside a collective:
- a rank raises: its peers get a few seconds to finish; any rank still busy is
  stack-dumped and the ranks are replaced. One RankError names the rank(s).
- a collective stalls past ``timeout``: torch raises on the stuck rank; the
  group is unusable after that, so the ranks are replaced (CollectiveTimeout).
- the job outlives ``job_timeout``, or Interrupt is pressed: stacks are shown,
  the ranks are replaced, results of that job can never come back later
  (every job carries an id).

Leaves out, compared with torchrun: multi-node (see ``init_from_env``),
elastic membership, restart policies.

References: torch.distributed.TCPStore/PrefixStore; torch.multiprocessing's
``spawn`` error propagation; ipyparallel's engines (the same idea at scale).
"""
from __future__ import annotations

import atexit
import itertools
import queue
import sys
import time
import weakref
from multiprocessing.connection import wait

from . import resources, subset
from .errors import ClusterError, CollectiveTimeout, JobTimeout, RankDied, RankError
from .output import RankOutput
from .process import RankProcesses

GRACE_S = 3.0  # how long healthy ranks get to finish once one rank has failed
_live: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


class Cluster:
    """``world_size`` long-lived ranks; see the module docstring."""

    def __init__(self, world_size: int = 2, backend: str = "auto", timeout: float = 60.0,
                 env: dict | None = None):
        import torch.distributed as dist

        self.world_size = resources.check_world_size(world_size)
        self.backend = resources.choose_backend(backend, world_size)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if env is not None and not (isinstance(env, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise ValueError("env must be a dict of str -> str, e.g. {'TORCH_DISTRIBUTED_DEBUG': 'DETAIL'}")
        self.timeout = float(timeout)
        self.env = dict(env or {})
        self.threads_per_rank = resources.threads_per_rank(world_size)
        self.oversubscribed = world_size > resources.usable_cpus()
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.port = self._store.port
        self._generation = itertools.count()
        self._job_ids = itertools.count(1)
        self._out = RankOutput()
        self._ranks: RankProcesses | None = None
        self._closed = False
        self.exit_codes: list[int] | None = None  # set by shutdown(); 0 = left cleanly
        # What a rank sends besides results: on_display(rank, payload) for display
        # objects made during a job (%%ddp sets it); the job now running, for status().
        self.on_display = None
        self.running: dict | None = None
        self.start_seconds = self._start()
        _live.add(self)

    # -- lifecycle -----------------------------------------------------------
    def _start(self) -> float:
        t0 = time.monotonic()
        self.generation = next(self._generation)
        prefix = f"gen{self.generation}"
        ranks = RankProcesses(self.world_size, self.backend, "127.0.0.1", self.port, prefix,
                              self.timeout, self.threads_per_rank, self.env, self._out.queue)
        first = ranks.wait_ready(deadline=t0 + max(60.0, self.timeout) + 30.0)
        if all(m[0] == "ready" for m in first):
            self._ranks = ranks
            return time.monotonic() - t0
        ranks.stop(graceful=False)
        self._out.show()
        why = []
        for r, m in enumerate(first):
            if m[0] == "init_failed":
                why.append(f"rank {r}: {m[1]['type']}: {m[1]['message']}")
            elif m[0] != "ready":
                why.append(f"rank {r}: {m[0]} {m[1:] if len(m) > 1 else ''}".rstrip())
        raise ClusterError("ranks failed to start (their output is above):\n" + "\n".join(why))

    @property
    def pids(self) -> list[int]:
        return list(self._ranks.pids) if self._ranks else []

    def shutdown(self) -> None:
        """Stop the ranks (they leave without gloo's teardown abort) and the store."""
        if self._closed:
            return
        self._closed = True
        if self._ranks is not None:
            self.exit_codes = self._ranks.stop(graceful=True)
            self._ranks = None
        self._out.show(final=True)
        self._store = None
        _live.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass

    def __repr__(self):
        state = "shut down" if self._closed else f"pids={self.pids}"
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}, {state})"

    def _replace(self, why: str) -> str:
        """Kill the current ranks and start fresh ones; returns a note for the learner."""
        old = self.pids
        if self._ranks is not None:
            self._ranks.stop(graceful=False)
            self._ranks = None
        self._out.show()
        self._start()
        return (f"{why} The ranks were replaced (old pids {old}, new pids {self.pids}); "
                "anything they held (models, variables) is gone. The cluster is ready.")

    # -- running jobs --------------------------------------------------------
    def run(self, fn, *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results by rank."""
        return self.run_job(fn, args, kwargs)

    def status(self):
        """Each rank's pid, device, memory and job, with the backend, timeout and
        generation (how many times the ranks were started before these)."""
        from .status import cluster_status

        return cluster_status(self)

    def run_job(self, fn, args=(), kwargs=None, *, job_timeout: float | None = None,
                show_ranks=None, ranks=None) -> list:
        """Like ``run`` with a wall-clock limit ``job_timeout`` (seconds) for this job.

        ``show_ranks`` (an iterable of ranks) limits whose output is shown.
        ``ranks`` runs the job on those ranks only (the list still has one slot
        per rank: None for the others); a collective called there raises at
        once, since the other ranks are not taking part (see subset.py).
        """
        import cloudpickle

        if self._closed:
            raise ClusterError("this Cluster was shut down; start a new one: ddplab.Cluster(...)")
        if not callable(fn):
            raise TypeError(f"run() needs a function to run on every rank, got {fn!r}")
        if job_timeout is not None and not job_timeout > 0:
            raise ValueError(f"job_timeout must be a positive number of seconds, got {job_timeout!r}")
        if self._ranks is None:
            self._start()
        targets = set(range(self.world_size)) if ranks is None else subset.check(ranks, self.world_size)
        name = getattr(fn, "__name__", type(fn).__name__)
        if targets != set(range(self.world_size)):
            fn, args, kwargs = subset.guarded_call, (sorted(targets), fn, *args), kwargs
        self._out.shown_ranks = None if show_ranks is None else set(show_ranks)
        job_id = next(self._job_ids)
        # The job travels pickled twice: a rank that cannot unpickle the function
        # (say it refers to a module only the kernel can import) still knows the
        # job's id and answers with that error instead of crashing.
        job = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
        payload = cloudpickle.dumps(("job", job_id, job))
        ranks = self._ranks
        self.running = {"id": job_id, "name": name, "pending": set(targets),
                        "ranks": set(targets), "start": time.monotonic()}
        try:
            for r in sorted(targets):
                ranks.conns[r].send_bytes(payload)
            outcome = self._collect(ranks, job_id, job_timeout, self.running["pending"])
            ranks.drain()  # what the job printed belongs to this call, not the next one
        except KeyboardInterrupt:
            stacks = self._stacks(ranks, range(self.world_size))
            note = self._replace("Interrupted.")
            for r, text in stacks.items():
                print(f"[rank {r}] was at:\n{text}", file=sys.stderr)
            print(note, file=sys.stderr)
            raise
        finally:
            self.running = None
            self._out.show(final=True)
        return self._finish(ranks, *outcome, targets=targets)

    def _collect(self, ranks: RankProcesses, job_id: int, job_timeout, pending: set):
        import cloudpickle

        results, failures = {}, {}
        start = time.monotonic()
        grace_end = None
        while pending:
            self._out.show()
            now = time.monotonic()
            if job_timeout is not None and now - start > job_timeout:
                return results, failures, pending, "job_timeout"
            if grace_end is not None and now > grace_end:
                return results, failures, pending, "broken_off"
            for conn in wait([ranks.conns[r] for r in pending], timeout=0.05):
                rank = ranks.conns.index(conn)
                try:
                    msg = cloudpickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    code = ranks.procs[rank].wait()
                    failures[rank] = _died_info(code)
                    pending.discard(rank)
                    continue
                except Exception as exc:  # a result that cannot be unpickled here
                    failures[rank] = {"type": type(exc).__name__, "frames": [], "dist_error": False,
                                      "message": f"its result could not be unpickled: {exc}"}
                    pending.discard(rank)
                    continue
                if msg[0] == "display":  # a display object made during the job, not its end
                    if msg[1] == job_id and self.on_display is not None:
                        ranks.drain()  # what the rank printed before it comes first
                        self._out.show()
                        try:
                            self.on_display(rank, msg[2])
                        except Exception as exc:  # showing it failed; the job goes on
                            print(f"[rank {rank}] (a display could not be shown: {exc!r})", file=sys.stderr)
                    continue
                if msg[1] != job_id:
                    continue  # a late answer to an earlier, abandoned job
                pending.discard(rank)
                if msg[0] == "ok":
                    results[rank] = msg[2]
                else:
                    failures[rank] = msg[2]
            if failures and grace_end is None:
                grace_end = time.monotonic() + GRACE_S
        return results, failures, pending, None

    def _finish(self, ranks, results, failures, pending, why, targets) -> list:
        if not failures and not pending:
            return [results.get(r) for r in range(self.world_size)]
        for info in failures.values():
            if info.get("exception"):
                try:
                    import cloudpickle

                    info["exception_obj"] = cloudpickle.loads(info["exception"])
                except Exception:
                    pass
        status = {}
        for r in range(self.world_size):
            if r in results:
                status[r] = "returned normally"
            elif r in failures:
                status[r] = f"raised {failures[r]['type']}"
            elif r not in targets:
                status[r] = "not taking part (the job ran on other ranks only)"
            else:
                status[r] = "still running: broken off (its stack is below)"
        stacks = self._stacks(ranks, pending) if pending else {}
        died = any(f.get("died") for f in failures.values())
        dist_broken = any(f.get("dist_error") for f in failures.values())
        timed_out = any(f.get("timeout") for f in failures.values())
        if why == "job_timeout":
            note = self._replace("The job ran past its job_timeout.")
            raise JobTimeout(failures, status, note, stacks,
                             head=f"job did not finish within job_timeout on rank(s) {sorted(pending)}")
        if pending or died or dist_broken:
            reason = ("A collective timed out, which leaves the process group unusable." if timed_out
                      else "A rank failed while others were still running or inside a collective.")
            note = self._replace(reason)
        else:
            note = "Every rank answered; the ranks and their state are kept."
        if timed_out:
            raise CollectiveTimeout(
                failures, status, note, stacks,
                head=(f"a collective timed out after {self.timeout:g} s on rank(s) "
                      f"{sorted(r for r, f in failures.items() if f.get('timeout'))}: did every "
                      "rank call the same collectives in the same order?"))
        if died:
            raise RankDied(failures, status, note, stacks)
        raise RankError(failures, status, note, stacks)

    def _stacks(self, ranks: RankProcesses, which) -> dict:
        """Python stacks of the given live ranks, captured from their stderr."""
        which = [r for r in which if ranks.alive(r)]
        if not which:
            return {}
        self._out.show()
        ranks.dump_stacks(which)
        texts = {r: [] for r in which}
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                rank, stream, data = self._out.queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if rank in texts and stream == "stderr":
                texts[rank].append(data.decode(errors="replace"))
            else:
                self._out.add(rank, stream, data)
        return {r: "".join(t) for r, t in texts.items() if t}


def _died_info(code: int) -> dict:
    import signal

    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    return {"type": "RankDied", "message": f"the rank process ended with {how}", "frames": [],
            "died": True, "dist_error": True}


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
