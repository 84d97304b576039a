"""Collecting a job's answers from every rank, while the clock and the output keep moving.

Teaches: the kernel's side of one collective job. Answers arrive in any
order; each carries the job's id, so a late answer to an abandoned job is
dropped instead of being taken for this one. A rank whose socket reaches EOF
died (its exit status says how). Once one rank has failed, the others get
``GRACE_S`` seconds to answer: a rank still inside a collective then is
broken off rather than left waiting for the group's timeout. The loop shows
the ranks' output and looks at the clock every 50 ms however much they print.

Leaves out, compared with torch.multiprocessing.spawn: it joins processes
that end; these ranks live on and answer many jobs.
"""
from __future__ import annotations

import sys
import time
from multiprocessing.connection import wait

from ddplab.cluster import diagnosis, lifecycle
from ddplab.cluster.errors import ClusterError

GRACE_S = 3.0  # how long healthy ranks get to finish once one rank has failed


def collect_answers(ranks, job_id: int, job_timeout, gens, pending=None, on_display=None):
    """Wait for the answer to job ``job_id`` of every rank in ``pending`` (a set,
    emptied as answers arrive; default every rank); returns (results, failures,
    groups, pending, why) where ``why`` is None, "job_timeout" or "broken_off".
    A display object a rank sends during the job goes to ``on_display(rank, payload)``."""
    import cloudpickle

    results, failures, groups = {}, {}, {}
    pending = set(range(ranks.world_size)) if pending is None else pending
    start = time.monotonic()
    grace_end = None
    lifecycle.interruption_point("run:collecting")
    while pending:
        gens.out.show()
        now = time.monotonic()
        if job_timeout is not None and now - start > job_timeout:
            return results, failures, groups, pending, "job_timeout"
        if grace_end is not None and now > grace_end:
            return results, failures, groups, pending, "broken_off"
        try:
            ready = wait([ranks.conns[r] for r in pending], timeout=0.05)
        except (OSError, ValueError):  # closed under us by shutdown() from another thread
            ready = []
        if gens.closed:
            raise ClusterError("this Cluster was shut down while the job ran")
        for conn in ready:
            rank = ranks.conns.index(conn)
            try:
                msg = cloudpickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                code = ranks.exit_status(rank, wait_s=1.0)
                failures[rank] = diagnosis.died_info(code, time.monotonic() - start)
                pending.discard(rank)
                continue
            except Exception as exc:  # a result that cannot be unpickled here
                failures[rank] = {"type": type(exc).__name__, "frames": [], "dist_error": False,
                                  "message": f"its result could not be unpickled: {exc}"}
                pending.discard(rank)
                continue
            if msg[0] == "display":  # a display object made during the job, not its end
                if msg[1] == job_id and on_display is not None:
                    _show(ranks, gens, on_display, rank, msg[2])
                continue
            if msg[1] != job_id:
                continue  # a late answer to an earlier, abandoned job
            pending.discard(rank)
            groups[rank] = msg[3]
            if msg[0] == "ok":
                results[rank] = msg[2]
            else:
                failures[rank] = msg[2]
        if failures and grace_end is None:
            grace_end = time.monotonic() + GRACE_S
    return results, failures, groups, pending, None


def _show(ranks, gens, on_display, rank: int, payload) -> None:
    ranks.drain()  # what the rank printed before the display comes first
    gens.out.show()
    try:
        on_display(rank, payload)
    except Exception as exc:  # showing it failed; the job goes on
        print(f"[rank {rank}] (a display could not be shown: {exc!r})", file=sys.stderr)
