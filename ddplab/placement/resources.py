"""What this machine offers the ranks: usable CPUs, GPUs, and the backend to pick.

Teaches: a rank's share of the machine is not ``os.cpu_count()``. Containers
and job schedulers restrict a process with an affinity mask or a cgroup CPU
quota, and ranks that oversubscribe the cores run several times slower (each
rank's intra-op thread pool fights the others). So ranks get
``max(1, usable_cpus // world_size)`` threads each.

Leaves out, compared with torch: torchrun's ``--nproc-per-node=auto`` and
multi-node topology; here every rank lives on this machine.

The kernel process never initialises CUDA: ``torch.cuda.device_count()``
answers without creating a context: the kernel decides which GPU each rank gets
(``placement.gpus.place``) and the rank selects it (``pg.backend.init_group``).

References: sched_getaffinity(2); cgroup v2 ``cpu.max``; torch.cuda.device_count.
"""
from __future__ import annotations

import math
import os

# GPU facts live below this module (gpu_facts imports nothing of the package): no import circle
from ddplab.placement.gpu_facts import too_few, visible_gpus  # noqa: F401 - visible_gpus is public here

BACKENDS = ("auto", "gloo", "nccl")


def usable_cpus() -> int:
    """CPUs this process may use: the affinity mask, capped by a cgroup quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity mask
        n = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        n = min(n, max(1, math.floor(quota)))
    return max(1, n)


def _cgroup_cpu_quota() -> float | None:
    # cgroup v2: "max 100000" (no limit) or "200000 100000" (2 CPUs).
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    # cgroup v1.
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota_us = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period_us = int(f.read())
        if quota_us > 0:
            return quota_us / period_us
    except (OSError, ValueError):
        pass
    return None


def threads_per_rank(world_size: int, cpus: int | None = None) -> int:
    """Intra-op threads for each rank so that ranks do not oversubscribe the cores."""
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, cpus // world_size)


def check_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"world_size must be a positive integer (the number of ranks), got {world_size!r}. "
            "Try world_size=2."
        )
    return world_size


def check_backend(backend) -> str:
    """'auto', 'gloo' or 'nccl' (lower case); ValueError saying what to use instead."""
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r}: use 'auto' (nccl when every rank can have its own "
            "GPU, else gloo), 'gloo' (CPU) or 'nccl' (one GPU per rank)."
        )
    backend = backend.lower()
    if backend == "nccl":
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise ValueError(
                "backend='nccl' but this torch build has no NCCL (a CPU build?). "
                "Use backend='gloo' or backend='auto'."
            )
    return backend


def oversubscribed(world_size: int, backend: str, cpus: int | None = None) -> bool:
    """More CPU ranks than usable CPUs: their timings describe a crowded machine."""
    return backend == "gloo" and world_size > (usable_cpus() if cpus is None else cpus)


def check_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def check_env(env) -> dict:
    if env is not None and not (isinstance(env, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("env must be a dict of str -> str, e.g. {'TORCH_DISTRIBUTED_DEBUG': 'DETAIL'}")
    return dict(env or {})


def check_threads(threads, world_size: int) -> int:
    """Intra-op threads per rank: ``threads`` if given (a positive int), else the fair share."""
    if threads is None:
        return threads_per_rank(world_size)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer (intra-op threads per rank), got "
                         f"{threads!r}. On a server shared by a class, threads=1 is fair.")
    return threads


def choose_backend(backend: str, world_size: int, gpus: int | None = None) -> str:
    """Resolve ``backend`` for ``world_size`` ranks by counting GPUs (torchrun's rule:
    the GPUs belong to the job); raise ValueError saying what to do. A Cluster, which
    shares a server with other learners, decides with ``gpus.place`` instead."""
    check_world_size(world_size)
    backend = check_backend(backend)
    gpus = visible_gpus() if gpus is None else gpus
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl":
        if gpus < world_size:
            raise ValueError(too_few(world_size, gpus))
    return backend
