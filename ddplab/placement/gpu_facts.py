"""What this machine's GPUs are and who uses them, as ``nvidia-smi`` tells it.

Teaches: where the facts behind a placement come from. ``nvidia-smi`` (the
command-line face of NVML, the driver's management library) answers without
creating a CUDA context. ``--query-gpu`` gives each GPU's index, UUID, name
and memory; ``--query-compute-apps`` the processes on each; ``-L`` lists the
MIG devices under each GPU. Inside containers the process list is usually
empty (the container cannot see the host's pids): an empty list is no proof
that a GPU is free, so a GPU with no listed user but more than ``BUSY_MIB``
of memory in use counts as busy, and the reason says this was judged by
memory. ``visible`` renumbers the GPUs as CUDA does under
CUDA_VISIBLE_DEVICES (indices, GPU UUIDs, or MIG devices: ``MIG-<uuid>``,
or ``MIG-GPU-<gpu uuid>/<gi>/<ci>`` from older drivers).

``visible_gpus`` counts what torch sees (no CUDA context) and ``too_few`` says what to
do when there are not enough. This module imports nothing of the package:
``resources`` and ``gpus`` build on it, so the three form no import circle.

``discover`` is the one place that looks at the hardware; tests put a fake
``nvidia-smi`` on PATH or hand ``gpus.place`` a list of ``GPU`` records.

Leaves out: a MIG device's own memory and users (nvidia-smi reports them per
GPU; here they are unknown), and NVML's Python bindings (one more package).

References: nvidia-smi --help-query-gpu, --help-query-compute-apps and -L;
the CUDA_VISIBLE_DEVICES rules of the CUDA programming guide; NVIDIA's MIG
user guide (device names, CUDA device enumeration).
"""
from __future__ import annotations

import dataclasses
import os
import re
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
    mig: bool = False  # a MIG device (a slice of a GPU), not a whole GPU

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
        own = set(own_pids)
        mine = bool(self.pids) and all(p in own for p in self.pids)  # the memory is ours
        if not mine and self.used_mib is not None and self.used_mib > BUSY_MIB:
            # None: NVML cannot list processes here; (): it listed none, which inside a
            # container says nothing about the host's processes.
            return (f"GPU {self.index} has {self.used_mib} MiB in use and no process listed "
                    "(the driver does not show which processes from here, e.g. inside a "
                    "container, so this is judged by memory)")
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
        if len(r) < 5 or not r[0].isdigit():
            continue
        physical.append(GPU(index=int(r[0]), uuid=r[1], name=r[2], total_mib=_int(r[3]),
                            used_mib=_int(r[4]),
                            pids=tuple(pids.get(r[1], ())) if apps is not None else None))
    listing = _run(smi, "-L")
    migs = mig_devices(listing, physical) if listing else []
    return visible(physical, os.environ.get("CUDA_VISIBLE_DEVICES"), migs)


_GPU_LINE = re.compile(r"^GPU (\d+): (.*?) \(UUID: (GPU-[^)]+)\)")
_MIG_LINE = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[^)]+)\)")


def mig_devices(listing: str, physical: list[GPU]) -> list[GPU]:
    """The MIG devices in ``nvidia-smi -L`` output, each under the GPU it is a slice of.

    Memory and users are the parent GPU's business (``--query-gpu`` reports them
    per GPU), so a MIG device's are unknown here; its ``index`` is the parent's.
    """
    by_uuid = {g.uuid: g for g in physical}
    found, parent = [], None
    for line in listing.splitlines():
        m = _GPU_LINE.match(line)
        if m:
            parent = by_uuid.get(m.group(3)) or GPU(int(m.group(1)), m.group(2), m.group(3))
            continue
        m = _MIG_LINE.match(line)
        if m and parent is not None:
            found.append(GPU(parent.index, f"{parent.name} MIG {m.group(1)}", m.group(3),
                             pids=None, note=f"MIG device {m.group(2)} of GPU {parent.index}",
                             mig=True))
    return found


def visible(physical: list[GPU], cuda_visible_devices: str | None,
            migs: list[GPU] = ()) -> list[GPU]:
    """Renumber the machine's GPUs as CUDA does under CUDA_VISIBLE_DEVICES.

    CUDA reads the list up to its first entry that names no GPU, and an index
    may be written as a number or as a (prefix of a) UUID; ``MIG-...`` entries
    name MIG devices (``migs``, from ``mig_devices``).
    """
    if cuda_visible_devices is None:
        return list(physical)
    chosen: list[GPU] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        match = None
        if entry.lstrip("-").isdigit():
            match = next((g for g in physical if g.index == int(entry)), None)
        elif entry:
            pool = migs if entry.startswith("MIG-") else physical
            found = [g for g in pool if g.uuid.startswith(entry)]
            match = found[0] if len(found) == 1 else None
        if match is None or match in chosen:
            break
        chosen.append(match)
    return [dataclasses.replace(g, index=i) for i, g in enumerate(chosen)]


def _run(smi: str, *args: str) -> str | None:
    try:
        out = subprocess.run([smi, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _query(smi: str, what: str) -> list[list[str]] | None:
    text = _run(smi, what, "--format=csv,noheader,nounits")
    if text is None:
        return None
    return [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]


def _int(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None


def _from_torch() -> list[GPU]:
    # No nvidia-smi: count with torch (no CUDA context) and admit we know nothing else.
    return [GPU(i, pids=None, note="no nvidia-smi: memory and users unknown")
            for i in range(visible_gpus())]


def visible_gpus() -> int:
    """GPUs this process could give its ranks (respects CUDA_VISIBLE_DEVICES).

    Does not create a CUDA context in the calling process.
    """
    import torch

    if not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def too_few(world_size: int, n: int) -> str:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else ""
    if n == 0:
        return (f"backend='nccl' needs one GPU per rank but no GPU is visible{seen}. "
                "Use backend='gloo' (CPU) or backend='auto'.")
    return (f"backend='nccl' needs one GPU per rank: world_size={world_size} but {n} GPU(s) are "
            f"visible{seen}. Use world_size<={n} or backend='gloo' (CPU), or backend='auto' to "
            "choose for you.")
