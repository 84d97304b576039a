"""The real gloo and NCCL groups inside the observing group, and their two time limits.

Teaches: a process group has two moments that can wait on other ranks. At
start-up it meets its peers: gloo does it inside ``ProcessGroupGloo``'s
constructor (every pair connects, through addresses left in the store),
NCCL at its first collective (rank 0's unique id travels through the store).
Afterwards each collective may wait for a peer that is late or never comes.
torch gives one ``timeout`` to both. A short collective timeout (lab 06 uses
3 s, so that a planted hang ends quickly) would then also fail ranks that are
merely slow to start: CUDA and NCCL initialisation can differ by seconds from
rank to rank. So start-up here waits ``START_UP_S`` (or the collective
timeout, if longer), and the group then takes the collective timeout:
``ProcessGroupGloo::setTimeout`` sets it on every connected context, and
``ProcessGroupNCCL``'s options carry it to the watchdog, which aborts a
collective stuck longer than that.

Leaves out: NCCL's own bootstrap timeouts (NCCL_* variables), the eager
connection that ``device_id`` asks for (``backend.init_group`` says why there
is none), and other backends.

References: torch/include/torch/csrc/distributed/c10d/ProcessGroupGloo.hpp
(``setTimeout``), ProcessGroupNCCL.hpp (``Options``, the watchdog);
torch.distributed.init_process_group (``timeout``).
"""
from __future__ import annotations

import datetime

# How long ranks may take to meet when a group starts, whatever the collective timeout.
START_UP_S = 60.0


def seconds(timeout) -> float | None:
    """A timedelta or a number of seconds as seconds (None stays None)."""
    if timeout is None:
        return None
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def startup_timeout(timeout) -> datetime.timedelta:
    """The limit for meeting the peers at start-up: the collective timeout, at least START_UP_S."""
    return datetime.timedelta(seconds=max(seconds(timeout) or 0.0, START_UP_S))


def gloo_group(store, rank: int, size: int, timeout):
    """A real gloo group that met its peers within the start-up limit and now has ``timeout``."""
    import torch.distributed as dist

    group = dist.ProcessGroupGloo(store, rank, size, startup_timeout(timeout))
    if timeout is not None:
        group._set_default_timeout(timeout)
    return group


def nccl_group(store, rank: int, size: int, timeout):
    """A real NCCL group with the collective ``timeout`` in its options.

    It connects at its first collective; the unique id it then reads from ``store``
    waits as long as the store does (a Cluster's ranks give their store the start-up
    limit, worker.py)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    if timeout is not None:
        opts._timeout = timeout if isinstance(timeout, datetime.timedelta) \
            else datetime.timedelta(seconds=timeout)
    return dist.ProcessGroupNCCL(store, rank, size, opts)
