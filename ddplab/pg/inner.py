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
collective stuck longer than that. gloo's sends and receives keep the
start-up limit (their transport reads it when the pairs connect), so the
observing group passes the collective timeout to each of their waits.

NCCL's half connects eagerly on the rank's GPU when the group is made (what
``init_process_group(device_id=...)`` does for torch's own groups; a Python
group has no CUDA backend for torch to ask), and the ranks' ``TORCH_NCCL_*``
error handling is pinned so that the watchdog respects the timeout without
killing the rank (``pin_nccl_environment``, docs/gpu.md).

Leaves out: NCCL's own bootstrap timeouts (NCCL_* variables) and other backends.

References: torch/include/torch/csrc/distributed/c10d/ProcessGroupGloo.hpp
(``setTimeout``), ProcessGroupNCCL.hpp (``Options``, the watchdog,
TORCH_NCCL_ASYNC_ERROR_HANDLING's modes, TORCH_NCCL_BLOCKING_WAIT); ProcessGroupNCCL.cpp
(``WorkNCCL::checkTimeout``'s text, ``eagerConnectSingleDevice``);
torch.distributed.init_process_group (``timeout``).
"""
from __future__ import annotations

import datetime

from ddplab.pg.p2p_blocks import close_open_blocks

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


# The ranks' NCCL settings, pinned whatever the user's environment says (docs/gpu.md):
# - ASYNC_ERROR_HANDLING=2 (CleanUpOnly): on a timeout the watchdog aborts the communicators
#   and leaves the process alive; torch's default, 3, kills the process, possibly during a
#   later cell, and 1 does both.
# - BLOCKING_WAIT=0: with 1 every wait blocks the host and the watchdog no longer acts.
# Their older NCCL_* spellings are removed so that they cannot disagree.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "0"}
NCCL_ENV_ALIASES = ("NCCL_ASYNC_ERROR_HANDLING", "NCCL_BLOCKING_WAIT")


def pin_nccl_environment(environ=None) -> dict:
    """Set ``NCCL_ENV`` in ``environ`` (default: this process's); returns what was overridden.

    ProcessGroupNCCL reads these when it is constructed, so this runs before each one."""
    import os
    import warnings

    environ = os.environ if environ is None else environ
    overridden = {}
    for name in NCCL_ENV_ALIASES:
        if name in environ:
            overridden[name] = environ.pop(name)
    for name, value in NCCL_ENV.items():
        if environ.get(name, value) != value:
            overridden[name] = environ[name]
        environ[name] = value
    if overridden:
        warnings.warn(f"ddplab pins NCCL's error handling for its ranks: {overridden} replaced by "
                      f"{NCCL_ENV} (a timed-out collective then fails the job instead of killing "
                      "the rank later; see docs/gpu.md)", stacklevel=2)
    return overridden


def current_gpu():
    """This rank's GPU (``torch.cuda.set_device`` ran before its group was made)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def on_gpu(tensor) -> bool:
    """Whether ``tensor`` goes to the NCCL half of a group (the CPU tests' fake NCCL widens it)."""
    return tensor.is_cuda


def nccl_group(store, rank: int, size: int, timeout, device=None):
    """A real NCCL group with the collective ``timeout`` in its options, connected now.

    ``device``: this rank's GPU. The group connects eagerly on it, inside the start-up
    limit (the unique id it reads from ``store`` waits as long as the store does: a
    Cluster's ranks give their store the start-up limit, worker.py): every rank makes a
    group together, whereas lazily a group connects at its first op, and a first send
    from rank 0 to 1 while rank 2 is busy elsewhere would block in setup, where no
    watchdog looks. The NCCL environment is pinned first (``pin_nccl_environment``)."""
    import torch.distributed as dist

    pin_nccl_environment()
    opts = dist.ProcessGroupNCCL.Options()
    if timeout is not None:
        opts._timeout = timeout if isinstance(timeout, datetime.timedelta) \
            else datetime.timedelta(seconds=timeout)
    close_open_blocks()  # a communicator made inside an open NCCL group would join it
    group = dist.ProcessGroupNCCL(store, rank, size, opts)
    group.eager_connect_single_device(device if device is not None else current_gpu())
    return group


def timed_out(exc: BaseException) -> bool:
    """Whether a failed wait ran out of time. gloo says "Timed out ..."; NCCL's capped wait
    says "... ran for N milliseconds before timing out" (ProcessGroupNCCL.cpp, checkTimeout)."""
    text = str(exc)
    return "imed out" in text or "before timing out" in text


def payload_bytes(tensor) -> int:
    """What a rank hands a collective: numel x element size; for a sparse tensor, the
    indices and values it holds (its numel is the dense shape's)."""
    if tensor.is_sparse:
        return (tensor._indices().numel() * tensor._indices().element_size()
                + tensor._values().numel() * tensor.element_size())
    return tensor.numel() * tensor.element_size()
