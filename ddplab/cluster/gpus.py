"""Which GPUs a learner's ranks may take when a class shares one server.

Teaches: NCCL wants one rank per GPU. On a server shared by a workshop, a
learner whose cluster lands on a GPU that another learner's ranks already
hold gets, at best, half the GPU and a timeline that lies about speed, and at
worst an out-of-memory error in the middle of a lesson. So before a Cluster
picks nccl it looks at every GPU: who uses it (process ids) and how much
memory is taken. ``backend="auto"`` counts only GPUs that nobody else holds,
and falls back to gloo on CPU, saying why, when too few are free. Naming the
GPUs (``Cluster(2, gpus=[2, 3])``) takes them even if busy, with a warning.

How the facts are read: ``nvidia-smi`` (the command-line face of NVML, the
driver's management library) answers without creating a CUDA context, so the
learner's kernel never grabs GPU memory just by asking. Inside some containers
NVML cannot see other processes' pids; then a GPU counts as busy when more than
``BUSY_MIB`` of its memory is used, and the reason says that this was a guess
from memory. Indices are the ones torch sees after CUDA_VISIBLE_DEVICES (which
may list indices or UUIDs); ranks get CUDA_DEVICE_ORDER=PCI_BUS_ID so that
torch numbers GPUs in the same order as nvidia-smi.

``discover`` is the one place that looks at the hardware: tests replace it
with a list of ``GPU`` records so the selection, refusal and warning rules run
on machines without GPUs.

Leaves out: MIG slices (a MIG UUID in CUDA_VISIBLE_DEVICES is treated as one
opaque GPU), several ranks per GPU (NCCL refuses it), and GPUs on other
machines (torchrun's business).

References: nvidia-smi --help-query-gpu and --help-query-compute-apps; the
CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER rules of the CUDA programming guide.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

BUSY_MIB = 256  # an idle GPU shows a few MiB used; one CUDA context alone takes ~300-500 MiB


@dataclass(frozen=True)
class GPU:
    """One GPU as this process would number it (after CUDA_VISIBLE_DEVICES)."""
    index: int
    name: str = "GPU"
    uuid: str = ""
    total_mib: int | None = None
    used_mib: int | None = None
    # pids of the processes using it; None when NVML cannot see processes here
    pids: tuple[int, ...] | None = ()
    note: str = field(default="", compare=False)

    @property
    def free_mib(self) -> int | None:
        if self.total_mib is None or self.used_mib is None:
            return None
        return self.total_mib - self.used_mib

    def users(self, own_pids=()) -> tuple[int, ...] | None:
        """Other processes holding this GPU (None: unknown)."""
        if self.pids is None:
            return None
        return tuple(p for p in self.pids if p not in set(own_pids))

    def busy_reason(self, own_pids=()) -> str | None:
        """Why another learner seems to hold this GPU, or None when it looks free."""
        users = self.users(own_pids)
        if users:
            return f"GPU {self.index} is used by pid(s) {', '.join(map(str, users))}"
        if users is None and self.used_mib is not None and self.used_mib > BUSY_MIB:
            return (f"GPU {self.index} has {self.used_mib} MiB in use (the driver does not show "
                    "which processes from here, so this is judged by memory)")
        return None


def discover() -> list[GPU]:
    """The GPUs this process may give its ranks, with their memory and users."""
    smi = shutil.which("nvidia-smi")
    rows = _query(smi, "--query-gpu=index,uuid,name,memory.total,memory.used") if smi else None
    if rows is None:
        return _from_torch()
    apps = _query(smi, "--query-compute-apps=gpu_uuid,pid")
    pids: dict[str, list[int]] = {}
    for app in apps or []:
        if len(app) >= 2 and app[1].isdigit():
            pids.setdefault(app[0], []).append(int(app[1]))
    physical = []
    for r in rows:
        if len(r) < 5:
            continue
        physical.append(GPU(index=int(r[0]), uuid=r[1], name=r[2], total_mib=_int(r[3]),
                            used_mib=_int(r[4]),
                            pids=tuple(pids.get(r[1], ())) if apps is not None else None))
    return visible(physical, os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible(physical: list[GPU], cuda_visible_devices: str | None) -> list[GPU]:
    """Renumber the machine's GPUs as CUDA does under CUDA_VISIBLE_DEVICES.

    CUDA reads the list up to its first entry that names no GPU, and an index
    may be written as a number or as a (prefix of a) UUID.
    """
    if cuda_visible_devices is None:
        return list(physical)
    chosen: list[GPU] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        match = None
        if entry.lstrip("-").isdigit():
            match = next((g for g in physical if g.index == int(entry)), None)
        elif entry:
            found = [g for g in physical if g.uuid.startswith(entry)]
            match = found[0] if len(found) == 1 else None
        if match is None or match in chosen:
            break
        chosen.append(match)
    return [GPU(i, g.name, g.uuid, g.total_mib, g.used_mib, g.pids, g.note)
            for i, g in enumerate(chosen)]


def _query(smi: str, what: str) -> list[list[str]] | None:
    try:
        out = subprocess.run([smi, what, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def _int(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None


def _from_torch() -> list[GPU]:
    # No nvidia-smi: count with torch (no CUDA context) and admit we know nothing else.
    from ddplab.cluster.resources import visible_gpus

    return [GPU(i, pids=None, note="no nvidia-smi: memory and users unknown")
            for i in range(visible_gpus())]


@dataclass(frozen=True)
class Placement:
    """Where a Cluster's ranks go: the backend, one GPU per rank, and what to tell the learner."""
    backend: str
    gpus: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()  # why gloo was chosen, or warnings about busy GPUs


def place(world_size: int, backend: str, gpus=None, found: list[GPU] | None = None,
          own_pids=()) -> Placement:
    """Choose the backend and the GPUs for ``world_size`` ranks; ValueError says what to do.

    ``backend`` is already one of auto/gloo/nccl (``resources.choose_backend`` checks names).
    """
    if backend == "gloo":
        if gpus is not None:
            raise ValueError("gpus=... picks GPUs for nccl ranks; with backend='gloo' the ranks "
                             "run on CPU. Drop gpus= or use backend='nccl' (or 'auto').")
        return Placement("gloo")
    found = discover() if found is None else found
    by_index = {g.index: g for g in found}
    if gpus is not None:
        chosen = _check_named(list(gpus) if not isinstance(gpus, int) else gpus, world_size, by_index)
        warnings = tuple(f"{why}: your ranks will share it, which slows both and may run out "
                         "of memory." for why in (by_index[i].busy_reason(own_pids) for i in chosen)
                         if why)
        return Placement("nccl", chosen, warnings)
    free = [g for g in found if g.busy_reason(own_pids) is None]
    busy = [g.busy_reason(own_pids) for g in found if g.busy_reason(own_pids)]
    if backend == "auto":
        if len(free) >= world_size:
            return Placement("nccl", tuple(g.index for g in free[:world_size]))
        if not found:  # a CPU machine, or a classroom seat without GPUs (its hub says why)
            seat_note = os.environ.get("DDPLAB_SEAT_NOTE", "")
            return Placement("gloo", (), (seat_note,) if seat_note else ())
        why = (f"backend='auto' chose gloo (CPU): {world_size} rank(s) need {world_size} free "
               f"GPU(s), {len(free)} of {len(found)} are free"
               + (" (" + "; ".join(busy) + ")" if busy else "")
               + ". Pass gpus=[...] to use busy GPUs anyway, or a smaller world_size.")
        return Placement("gloo", (), (why,))
    # backend == "nccl": free GPUs first, then busy ones with a warning.
    if len(found) < world_size:
        raise ValueError(too_few(world_size, len(found)))
    chosen = free[:world_size] + [g for g in found if g not in free][:world_size - len(free)]
    warnings = tuple(f"{g.busy_reason(own_pids)}: your ranks will share it." for g in chosen
                     if g.busy_reason(own_pids))
    return Placement("nccl", tuple(sorted(g.index for g in chosen)), warnings)


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


def too_few(world_size: int, n: int) -> str:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else ""
    if n == 0:
        return (f"backend='nccl' needs one GPU per rank but no GPU is visible{seen}. "
                "Use backend='gloo' (CPU) or backend='auto'.")
    return (f"backend='nccl' needs one GPU per rank: world_size={world_size} but {n} GPU(s) are "
            f"visible{seen}. Use world_size<={n} or backend='gloo' (CPU), or backend='auto' to "
            "choose for you.")
