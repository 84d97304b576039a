"""Who never joined: a collective timeout under a launcher names the ranks it waited for.

Teaches: when one rank of a job stops calling collectives (a hang, an endless
data loader, a step it skips), every other rank waits in the next collective
until the group's timeout, and gloo then says only that the operation timed
out. Which rank, on which node, and which collective it missed is what a job's
owner needs. Every rank counts the collectives it issued (the observing
group sees all of them, torch DDP's buckets included) and a thread leaves the
count, the last collective's name, its node and host in the rendezvous store
a few times a second, when it changed. The rank whose wait ran out reads
everyone's entry: the ranks whose count is below its own never issued the
collective it was in. It raises ``NeverJoined`` naming them, and exits with
it; ``srun --kill-on-bad-exit=1`` (the exported batch file's) then ends the
whole job instead of leaving the hung rank holding its nodes.

The keys carry the job id (SLURM_JOB_ID, or torchrun's run id) and torchrun's
restart count, so a job never reads another job's or attempt's entries.

Leaves out, compared with torch: the NCCL flight recorder
(TORCH_NCCL_TRACE_BUFFER_SIZE), which keeps every collective of every rank
with its sizes; ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which checks the
collectives' shapes (and under which ddplab does not observe the group). A
rank hung in C code that holds the GIL stops publishing too: its entry is
then older than a fraction of a second, which changes nothing here since its
count stopped anyway.

References: torch.distributed.TCPStore (a second client of the store at
MASTER_ADDR:MASTER_PORT); ddplab.contracts.protocols.Observer (``launched``,
``failed``); Slurm's srun(1) ``--kill-on-bad-exit``.
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
import time

from ddplab.pg.inner import timed_out

PUBLISH_S = 0.25  # how often a changed count is left in the store
KEY = "ddplab/progress"


class NeverJoined(RuntimeError):
    """A collective timed out; the message names the ranks that never issued it."""


def job_key(environ=None) -> str:
    """The store prefix of this job and attempt: other jobs and restarts use other keys."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID") or "local"
    attempt = f"{environ.get('SLURM_RESTART_COUNT', '0')}.{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return f"{KEY}/{job}/{attempt}"


def where(environ=None) -> str:
    """This process's node (Slurm's name for it) and host, for messages and recordings."""
    environ = os.environ if environ is None else environ
    host = socket.gethostname()
    node = environ.get("SLURMD_NODENAME")
    return f"node {node}, host {host}" if node and node != host else f"host {host}"


class Progress:
    """Counts this rank's collectives and leaves the count in the store; on a timed-out
    wait, names the ranks behind. An observer of the observing group (the methods of
    ``ddplab.contracts.protocols.Observer``; not ``ObserverBase``, whose module imports torch)."""

    timeout = None  # the group's own limit applies

    def __init__(self, store, rank: int, world_size: int, prefix: str | None = None):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix = prefix or job_key()
        self.place = where()
        self.count, self.op = 0, "none yet"
        self.lock = threading.Lock()  # one store client, two threads
        self.published = -1
        self.unreadable = False
        self.stopped = threading.Event()
        self.publish()
        self.thread = threading.Thread(target=self._loop, name="ddplab-progress", daemon=True)
        self.thread.start()

    # -- what every collective passes --------------------------------------------------
    def launched(self, op, tensors, group, peer):
        self.count += 1
        self.op = op
        return (self.count, op)

    def started(self, token, work):
        return None

    def waiting(self, token):
        pass

    def future_taken(self, token):
        pass

    def failed(self, token, exc):
        if token is None or not timed_out(exc):
            return
        time.sleep(2 * PUBLISH_S)  # the others' last counts reach the store
        raise NeverJoined(self.explain(token[0], token[1], exc)) from exc

    # -- the store -----------------------------------------------------------------------
    def publish(self) -> None:
        count, op = self.count, self.op
        if count == self.published:
            return
        with self.lock:
            self.store.set(f"{self.prefix}/{self.rank}", f"{count}|{op}|{self.place}")
        self.published = count

    def _loop(self) -> None:
        while not self.stopped.wait(PUBLISH_S):
            try:
                self.publish()
            except Exception:  # the store went away (the job is ending): stop quietly
                return

    def others(self) -> dict[int, tuple[int, str, str] | None]:
        """Every rank's last (count, collective, place), None where it never published."""
        seen = {}
        with self.lock:
            for r in range(self.world_size):
                key = f"{self.prefix}/{r}"
                try:
                    if not self.store.check([key]):
                        seen[r] = None
                        continue
                    count, op, place = self.store.get(key).decode().split("|", 2)
                    seen[r] = (int(count), op, place)
                except Exception:  # the store's host (rank 0 under srun) may be gone
                    seen[r] = None
                    self.unreadable = True
        return seen

    def explain(self, number: int, op: str, exc: BaseException) -> str:
        self.unreadable = False
        text = describe(self.rank, number, op, self.others(), first_line(exc))
        if self.unreadable:
            text += ("\nThe rendezvous store could not be read for some ranks: the process that hosts it "
                     "(rank 0 under srun, the first node's torchrun) may have ended, so those ranks' "
                     "counts are unknown.")
        return text

    def stop(self) -> None:
        self.stopped.set()


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def describe(rank: int, number: int, op: str, seen: dict, why: str) -> str:
    """The message for rank ``rank`` that timed out in its ``number``-th collective ``op``."""
    behind = {r: s for r, s in seen.items() if r != rank and (s is None or s[0] < number)}
    lines = [f"rank {rank} timed out in {op} (its collective #{number}) waiting for its peers ({why})."]
    if not behind:
        lines.append("Every rank issued a collective #" + str(number) + "; a peer may have called a "
                     "different one there, or died in it: " + "; ".join(
                         f"rank {r}: #{s[0]} {s[1]} ({s[2]})" for r, s in sorted(seen.items()) if s))
        return "\n".join(lines)
    for r, s in sorted(behind.items()):
        if s is None:
            lines.append(f"rank {r} never joined it: it left no count in the store (it never "
                         "started, or died before its group was up).")
        else:
            last = f"its last was #{s[0]} {s[1]}" if s[0] else "it had issued no collective yet"
            lines.append(f"rank {r} ({s[2]}) never joined it: {last}.")
    lines.append("Look at what those ranks do between their last collective and this one (a step they "
                 "skip, a wait on data or input, a collective in another order).")
    return "\n".join(lines)


def watch(group, rank: int, world_size: int, addr: str, port: int) -> Progress | None:
    """Install a ``Progress`` on the observing ``group`` (None: not observed), with its own
    client of the store at ``addr:port``."""
    if group is None:
        return None
    import torch.distributed as dist

    store = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=60))
    progress = Progress(store, rank, world_size)
    group.observers.append(progress)  # for the whole run: no block to leave
    RUNNING.append(progress)
    return progress


RUNNING: list[Progress] = []


def stop_all() -> None:
    """Stop this process's publishing threads (before its group and store go)."""
    while RUNNING:
        progress = RUNNING.pop()
        progress.stop()
        progress.thread.join(timeout=2 * PUBLISH_S)
