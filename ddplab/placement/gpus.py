"""Which GPUs a learner's ranks may take when a class shares one server.

Teaches: NCCL wants one rank per GPU. On a server shared by a workshop, a
learner whose cluster lands on a GPU that another learner's ranks already
hold gets, at best, half the GPU and a timeline that lies about speed, and at
worst an out-of-memory error in the middle of a lesson. So before a Cluster
picks nccl it looks at every GPU: who uses it (process ids) and how much
memory is taken. ``backend="auto"`` counts only GPUs that nobody else holds,
and falls back to gloo on CPU, saying why, when too few are free. Naming the
GPUs (``Cluster(2, gpus=[2, 3])``) takes them even if busy, with a warning.

The facts (who uses each GPU, its memory, MIG devices, CUDA_VISIBLE_DEVICES)
come from ``gpu_facts`` (nvidia-smi, no CUDA context); ranks get
CUDA_DEVICE_ORDER=PCI_BUS_ID so that torch numbers GPUs as nvidia-smi does.

Asking is not holding: ``place(..., reserve=True)`` (what a Cluster does)
locks the GPUs it picks (``gpu_locks``) before any rank starts, skips GPUs
another Cluster holds, and the Cluster releases them at shutdown. ``assign``
splits a server's GPUs into disjoint sets, one per learner, for a hub that
hands each learner's server its own CUDA_VISIBLE_DEVICES.

Leaves out: several MIG devices for one Cluster (CUDA enumerates only one
MIG device per process, see the MIG user guide's "CUDA Device Enumeration",
so a rank could not select its own: MIG devices serve world size 1),
several ranks per GPU (NCCL refuses it), and GPUs on other machines
(torchrun's business).

References: nvidia-smi --help-query-gpu, --help-query-compute-apps and -L; the
CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER rules of the CUDA programming guide;
NVIDIA's MIG user guide (device names, CUDA device enumeration).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from ddplab.placement import gpu_locks
from ddplab.placement.gpu_facts import BUSY_MIB, GPU, discover, mig_devices, too_few, visible  # noqa: F401 - the public names


@dataclass(frozen=True)
class Placement:
    """Where a Cluster's ranks go: the backend, one GPU per rank, and what to tell the learner."""
    backend: str
    gpus: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()  # why gloo was chosen, or warnings about busy GPUs
    # the locks on ``gpus`` when placed with reserve=True (else it holds none); release()
    reservation: gpu_locks.Reservation = field(default_factory=lambda: gpu_locks.Reservation({}),
                                               compare=False, repr=False)


def place(world_size: int, backend: str, gpus=None, found: list[GPU] | None = None,
          own_pids=(), reserve: bool = False) -> Placement:
    """Choose the backend and the GPUs for ``world_size`` ranks; ValueError says what to do.

    ``backend`` is already one of auto/gloo/nccl (``resources.choose_backend`` checks names).
    ``reserve=True`` also locks the chosen GPUs (``Placement.reservation``; release it when
    the ranks are gone) and counts GPUs that another Cluster has locked as busy.
    """
    if backend == "gloo":
        if gpus is not None:
            raise ValueError("gpus=... picks GPUs for nccl ranks; with backend='gloo' the ranks "
                             "run on CPU. Drop gpus= or use backend='nccl' (or 'auto').")
        return Placement("gloo")
    found = discover() if found is None else found
    taken: set = set()
    for _ in range(len(found) + 1):  # each round: a GPU we lost to a racing Cluster is taken
        if reserve:
            taken |= {g.index for g in found if gpu_locks.held_elsewhere(g)}
        placed = _choose(world_size, backend, gpus, found, own_pids, taken)
        if not (reserve and placed.gpus):
            return placed
        chosen = [g for g in found if g.index in placed.gpus]
        reservation, lost = gpu_locks.reserve(chosen)
        if not lost or gpus is not None:  # named GPUs are taken anyway (with a warning)
            return dataclasses.replace(placed, reservation=reservation)
        reservation.release()
        taken |= {g.index for g in lost}
    raise RuntimeError("could not reserve GPUs: other Clusters kept taking them; try again")


def _choose(world_size, backend, gpus, found, own_pids, taken) -> Placement:
    def busy(g):
        if g.index in taken:
            return f"GPU {g.index} is reserved by another ddplab Cluster (a lock file, gpu_locks)"
        return g.busy_reason(own_pids)

    by_index = {g.index: g for g in found}
    if world_size > 1 and any(g.mig for g in found):
        why = (f"{world_size} ranks cannot each select a MIG device: CUDA enumerates one MIG "
               "device per process. MIG devices serve world size 1; use whole GPUs for more.")
        if backend == "auto" and gpus is None:
            return Placement("gloo", (), (f"backend='auto' chose gloo (CPU): {why}",))
        raise ValueError(why)
    if gpus is not None:
        chosen = _check_named(list(gpus) if not isinstance(gpus, int) else gpus, world_size, by_index)
        warnings = tuple(f"{why}: your ranks will share it, which slows both and may run out "
                         "of memory." for why in (busy(by_index[i]) for i in chosen) if why)
        return Placement("nccl", chosen, warnings)
    free = [g for g in found if busy(g) is None]
    reasons = [busy(g) for g in found if busy(g)]
    if backend == "auto":
        if len(free) >= world_size:
            return Placement("nccl", tuple(g.index for g in free[:world_size]))
        if not found:  # a CPU machine, or a classroom seat without GPUs (its hub says why)
            seat_note = os.environ.get("DDPLAB_SEAT_NOTE", "")
            return Placement("gloo", (), (seat_note,) if seat_note else ())
        why = (f"backend='auto' chose gloo (CPU): {world_size} rank(s) need {world_size} free "
               f"GPU(s), {len(free)} of {len(found)} are free"
               + (" (" + "; ".join(reasons) + ")" if reasons else "")
               + ". Pass gpus=[...] to use busy GPUs anyway, or a smaller world_size.")
        return Placement("gloo", (), (why,))
    # backend == "nccl": free GPUs first, then busy ones with a warning.
    if len(found) < world_size:
        raise ValueError(too_few(world_size, len(found)))
    chosen = free[:world_size] + [g for g in found if g not in free][:world_size - len(free)]
    warnings = tuple(f"{busy(g)}: your ranks will share it." for g in chosen if busy(g))
    return Placement("nccl", tuple(sorted(g.index for g in chosen)), warnings)


def assign(found: list[GPU], sizes, own_pids=()) -> list[tuple[GPU, ...]]:
    """Disjoint sets of free GPUs, ``sizes[i]`` of them for learner ``i`` (a hub's split).

    Hand learner ``i`` ``CUDA_VISIBLE_DEVICES=",".join(g.uuid for g in sets[i])``: UUIDs
    stay right whatever order the learner's server numbers GPUs in. ValueError when the
    free GPUs are too few, naming the busy ones.
    """
    sizes = list(sizes)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes):
        raise ValueError(f"sizes must be numbers of GPUs (ints >= 0), got {sizes!r}")
    free = [g for g in found if not g.mig and g.busy_reason(own_pids) is None]
    if sum(sizes) > len(free):
        busy = "; ".join(g.busy_reason(own_pids) for g in found if g.busy_reason(own_pids))
        raise ValueError(f"{len(sizes)} learner(s) need {sum(sizes)} GPU(s) but {len(free)} of "
                         f"{len(found)} are free" + (f" ({busy})" if busy else "") +
                         ": give fewer learners GPUs, or fewer GPUs each.")
    sets, start = [], 0
    for n in sizes:
        sets.append(tuple(free[start:start + n]))
        start += n
    return sets


def _check_named(gpus, world_size: int, by_index: dict) -> tuple[int, ...]:
    if not isinstance(gpus, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                             for i in gpus):
        raise ValueError(f"gpus must be a list of GPU indices, one per rank, e.g. gpus=[0, 1]; "
                         f"got {gpus!r}")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"gpus={gpus} names a GPU twice: NCCL allows one rank per GPU.")
    if len(gpus) != world_size:
        raise ValueError(f"gpus={gpus} names {len(gpus)} GPU(s) for world_size={world_size}: "
                         "give exactly one GPU per rank.")
    missing = [i for i in gpus if i not in by_index]
    if missing:
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else ""
        raise ValueError(f"gpus={gpus}: no GPU {', '.join(map(str, missing))} here; this process "
                         f"sees {sorted(by_index) or 'no GPUs'}{seen}. `python -m ddplab doctor` "
                         "lists them with their users.")
    return tuple(gpus)
