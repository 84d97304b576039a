"""A seat's GPUs enforced: the learner's processes cannot open another seat's GPU.

Teaches why ``CUDA_VISIBLE_DEVICES`` is a courtesy and what makes it a limit. The variable only
tells the CUDA runtime which GPUs to number; a learner who sets it to every GPU (in a cell, or
``os.environ`` before importing torch) sees and takes them all. The kernel decides what a process
may open: each GPU is a character device ``/dev/nvidia<minor>`` (major 195), and the cgroup v1
``devices`` controller can refuse a device number to every process of a group, root's included.
So the hub writes, into the learner's ``devices`` group (:mod:`ddplab.course.limits`), one
``devices.deny`` line per GPU that is not in their seat: ``c 195:<minor> rwm``. Opening such a
node then fails with EPERM whatever the environment says, so no CUDA context can be made on that
GPU. Slurm's ``ConstrainDevices=yes`` does the same for a job's GPUs.

What stays allowed, because CUDA opens it for any GPU: ``/dev/nvidiactl`` (195:255), the UVM
devices ``/dev/nvidia-uvm`` and ``/dev/nvidia-uvm-tools`` (a major the kernel picks when the
module loads) and ``/dev/nvidia-modeset`` (195:254). Only GPU nodes are denied, so the group keeps
its parent's "everything else allowed".

Which minor is which GPU: the driver writes ``/proc/driver/nvidia/gpus/<PCI address>/information``
per GPU, with its ``GPU UUID`` and ``Device Minor``; the minor is not always nvidia-smi's index. A
seat names GPUs by UUID (or, where nvidia-smi gave none, by index: the GPUs in PCI order, the
order nvidia-smi and ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` number them). GPU nodes found in ``/dev``
without driver information are denied too.

Leaves out: MIG slices (their access goes through ``/dev/nvidia-caps``; a seat counts whole GPUs),
cgroup v2 (its device control is an eBPF program, not files), and GPUs of other vendors.
References: the kernel's cgroup-v1 devices.txt; NVIDIA's Linux driver README on its device files
(/dev/nvidiactl, /dev/nvidia[0-N], /dev/nvidia-uvm); Slurm's cgroup.conf ``ConstrainDevices``.
"""
from __future__ import annotations

import os
import pathlib
import re
import stat

MAJOR = 195  # the NVIDIA character devices' major number
NOT_GPUS = {254, 255}  # nvidia-modeset and nvidiactl: every CUDA process needs nvidiactl
DRIVER = pathlib.Path("/proc/driver/nvidia/gpus")


def driver_gpus(driver: pathlib.Path = DRIVER) -> list[tuple[str, str, int]]:
    """Each GPU the driver knows, as (PCI address, UUID, minor), in PCI order."""
    found = []
    for info in sorted(driver.glob("*/information")):
        text = info.read_text()
        uuid = re.search(r"^GPU UUID:\s*(\S+)", text, re.M)
        minor = re.search(r"^Device Minor:\s*(\d+)", text, re.M)
        if minor:
            found.append((info.parent.name, uuid.group(1) if uuid else "", int(minor.group(1))))
    return found


def dev_minors(dev: pathlib.Path = pathlib.Path("/dev")) -> set[int]:
    """The minors of the GPU nodes in ``dev`` (nvidia0, nvidia1, ...)."""
    minors = set()
    for node in dev.glob("nvidia[0-9]*"):
        try:
            st = node.stat()
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == MAJOR and os.minor(st.st_rdev) not in NOT_GPUS:
            minors.add(os.minor(st.st_rdev))
    return minors


def minors(driver: pathlib.Path = DRIVER, dev: pathlib.Path = pathlib.Path("/dev")) -> dict[str, int]:
    """Every GPU of this machine, by the names a seat may use (its UUID and its index), to its minor.
    A node in ``dev`` the driver does not describe is named ``minor-<N>`` (denied to every seat)."""
    known: dict[str, int] = {}
    for index, (_, uuid, minor) in enumerate(driver_gpus(driver)):
        known[str(index)] = minor
        if uuid:
            known[uuid] = minor
    for minor in dev_minors(dev) - set(known.values()):
        known[f"minor-{minor}"] = minor
    return known


def denied(seat_gpus, known: dict[str, int] | None = None) -> list[int]:
    """The minors of every GPU but the seat's (a CPU-only seat: every GPU). A seat's GPU this
    machine cannot find is an error: denying by guess could leave the learner their neighbour's.
    On a machine with no GPU node at all (a seat named by a stand-in nvidia-smi) nothing is denied."""
    known = minors() if known is None else known
    if not known:  # no GPU node and no driver here: nothing a learner could open, nothing to deny
        return []
    mine = set()
    for gpu in seat_gpus:
        if gpu not in known:
            raise ValueError(f"the seat's GPU {gpu!r} is not among this machine's GPU devices "
                             f"({sorted(known) or 'none'}): its /dev/nvidia node cannot be kept open to it")
        mine.add(known[gpu])
    return sorted(set(known.values()) - mine)


def rules(minors_: list[int]) -> list[str]:
    """The ``devices.deny`` lines for these minors: read, write and mknod refused."""
    return [f"c {MAJOR}:{m} rwm" for m in minors_]
