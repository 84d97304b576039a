"""What a lab notebook needs to run unchanged on a laptop, one GPU or a GPU server.

Teaches nothing about DDP itself: it keeps the notebooks honest about where
they run. A lab starts its ranks with ``ddplab.Cluster(lab_world_size())``:
2 ranks by default (gloo on CPU, or nccl when two GPUs are free), or what
``DDPLAB_WORLD_SIZE`` says. ``make test-gpu`` sets it to 1 on a one-GPU
machine, since NCCL allows one rank per GPU. A cell whose point needs more
ranks (a straggler needs a fast rank to wait) or a GPU asks ``runs_here``
first, which prints why it skips, so nbval and a learner both see a message
instead of a failure or a misleading number.

References: nbval (a skipped cell must still execute without error).
"""
from __future__ import annotations

import os

ENV = "DDPLAB_WORLD_SIZE"


def lab_world_size(default: int = 2) -> int:
    """Ranks a lab starts: ``DDPLAB_WORLD_SIZE`` if set, else ``default``."""
    raw = os.environ.get(ENV)
    if raw is None or raw == "":
        return default
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} is not a number of ranks; unset it or use e.g. 2") from None
    if n < 1:
        raise ValueError(f"{ENV}={n}: a lab needs at least one rank")
    return n


def runs_here(cluster, ranks: int = 1, gpu: bool = False, cpu: bool = False, what: str = "this cell") -> bool:
    """True when ``cluster`` has what the cell needs; otherwise print why it skips.

    ``ranks``: at least that many ranks. ``gpu``: nccl ranks with GPUs.
    ``cpu``: gloo ranks on CPU (a picture that only makes sense there).
    """
    missing = []
    if cluster.world_size < ranks:
        missing.append(f"{ranks} ranks (this cluster has {cluster.world_size}; set {ENV} or "
                       "free more GPUs)")
    if gpu and cluster.backend != "nccl":
        missing.append("GPUs (this cluster runs gloo on CPU)")
    if cpu and cluster.backend != "gloo":
        missing.append("CPU ranks (this cluster runs nccl on GPUs)")
    if missing:
        print(f"skipped: {what} needs " + " and ".join(missing) + ".")
        return False
    return True
