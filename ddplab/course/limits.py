"""Limits per learner that the learner cannot lift, and nothing of theirs left when their server stops.

Teaches how a class on one server keeps one learner from taking the machine from the others,
with what the kernel gives where systemd does not run (The Littlest JupyterHub uses systemd's
transient units; systemdspawner does the same). The hub runs as root; for each learner it makes
control groups (cgroup v1, one per controller) under ``/sys/fs/cgroup/<controller>/ddplab/<class>/``:

- ``memory``: ``memory.limit_in_bytes``, all of the learner's processes together (server,
  kernels, ranks); past it the kernel's OOM killer ends a process of that learner only;
- ``pids``: ``pids.max`` processes and threads together (a fork bomb stops there);
- ``cpu``: ``cpu.cfs_quota_us`` = threads x the period: the learner's CPU time per second;
- ``cpuset``: ``cpuset.cpus`` = the seat's CPUs, so widening one's own affinity mask fails.

The learner's server joins them while still root, just before the switch to the learner's
account (:func:`join`, in the spawner's preexec); its children inherit the groups, and the
learner cannot move out (the groups' files are root's). When the server stops, :func:`end`
kills every process still in the learner's groups (a ``nohup``ed process included) and removes
them. Where no cgroup can be written (not root, or a v2-only machine whose unified hierarchy
has no controllers delegated), :func:`rlimits` stands in, each labelled for what it enforces:
address space per process (not the learner's total), processes per account.

Leaves out: cgroup v2 controllers (their files have other names: ``memory.max``, ``cpu.max``),
GPUs (a seat's GPUs are still only CUDA_VISIBLE_DEVICES: the ``devices`` controller could close
the others' /dev/nvidia*), private /tmp and /dev/shm (a mount namespace per server), disk quotas.
References: the kernel's cgroup-v1 documentation (memory.txt, pids.txt, cpusets.txt,
sched-bwc.txt); setrlimit(2); systemd.resource-control(5) for what TLJH sets.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import resource
import signal
import time

BASE = pathlib.Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu", "cpuset")
PIDS_PER_LEARNER = 1024  # a server, a few kernels, their ranks and every thread of each
PERIOD_US = 100_000
# The rlimit stand-in bounds address space, and torch with gloo reserves far more of it than it
# touches: below this a learner's kernel fails to import torch.
ADDRESS_SPACE_MIN_GIB = 8.0


def address_space_gib(memory_gib: float) -> float:
    return max(memory_gib, ADDRESS_SPACE_MIN_GIB)


def class_name(folder: str) -> str:
    """A short name for a class (its folder) under /sys/fs/cgroup/<controller>/ddplab/."""
    return "class-" + hashlib.sha1(str(folder).encode()).hexdigest()[:10]


def writable(base: pathlib.Path = BASE) -> list[str]:
    """The cgroup v1 controllers this process may make groups in."""
    return [c for c in CONTROLLERS
            if (base / c / "cgroup.procs").exists() and os.access(base / c, os.W_OK)]


def describe(memory_gib: float, threads: int, base: pathlib.Path = BASE) -> list[str]:
    """What this machine enforces per learner, one line each (``classroom`` prints it)."""
    have = writable(base)
    said = {
        "memory": f"memory: {memory_gib:g} GiB for all of a learner's processes together (cgroup v1 memory)",
        "pids": f"processes: {PIDS_PER_LEARNER} processes and threads per learner (cgroup v1 pids)",
        "cpu": f"CPU time: {threads} CPU(s) per second per learner (cgroup v1 cpu quota)",
        "cpuset": "CPUs: the seat's CPUs only; a learner cannot widen their affinity (cgroup v1 cpuset)",
    }
    lines = [said[c] for c in CONTROLLERS if c in have]
    if "memory" not in have:
        lines.append(f"memory: NOT per learner: {address_space_gib(memory_gib):g} GiB of address space per process "
                     "(RLIMIT_AS; a learner's processes together may use more)")
    if "pids" not in have:
        lines.append(f"processes: {PIDS_PER_LEARNER} per account (RLIMIT_NPROC)")
    if "cpuset" not in have:
        lines.append("CPUs: the seat's CPUs as the affinity mask only: a learner can widen it")
    if have:
        lines.append("every process of a learner ends when their server stops (their cgroups)")
    else:
        lines.append("a learner's background processes may outlive their server: no cgroup is writable here")
    return lines


def groups(cls: str, user: str, base: pathlib.Path = BASE) -> list[pathlib.Path]:
    return [base / c / "ddplab" / cls / user for c in writable(base)]


def prepare(cls: str, user: str, memory_bytes: int, threads: int, cpus: list[int],
            base: pathlib.Path = BASE) -> list[pathlib.Path]:
    """The learner's groups, made (as root) with their limits; returns them."""
    made = []
    for group in groups(cls, user, base):
        controller = group.relative_to(base).parts[0]
        for level in [group.parent.parent, group.parent, group]:
            if not level.exists():
                level.mkdir()
                if controller == "cpuset":  # a cpuset starts empty: give it its parent's
                    for name in ("cpuset.cpus", "cpuset.mems"):
                        (level / name).write_text((level.parent / name).read_text())
        settings = {
            "memory": {"memory.limit_in_bytes": str(memory_bytes)},
            "pids": {"pids.max": str(PIDS_PER_LEARNER)},
            "cpu": {"cpu.cfs_period_us": str(PERIOD_US), "cpu.cfs_quota_us": str(threads * PERIOD_US)},
            "cpuset": {"cpuset.cpus": ",".join(map(str, cpus))} if cpus else {},
        }[controller]
        for name, value in settings.items():
            (group / name).write_text(value)
        made.append(group)
    return made


def join(cls: str, user: str, base: pathlib.Path = BASE) -> None:
    """Move this process into the learner's groups (called as root, before the switch of account)."""
    for group in groups(cls, user, base):
        if group.exists():
            (group / "cgroup.procs").write_text(str(os.getpid()))


def members(cls: str, user: str, base: pathlib.Path = BASE) -> set[int]:
    found = set()
    for group in groups(cls, user, base):
        try:
            found |= {int(p) for p in (group / "cgroup.procs").read_text().split()}
        except OSError:
            pass
    return found


def end(cls: str, user: str, base: pathlib.Path = BASE, wait_s: float = 10.0) -> set[int]:
    """Kill every process left in the learner's groups and remove the groups; returns any that
    would not die within ``wait_s`` (then the groups stay)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = members(cls, user, base)
        if not left or time.monotonic() > deadline:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    if not left:
        for group in groups(cls, user, base):
            try:
                group.rmdir()
            except OSError:
                pass
    return left


def remove_class(cls: str, base: pathlib.Path = BASE) -> None:
    """The class's empty groups removed (the end of the class), and ddplab's if no class is left."""
    for controller in CONTROLLERS:
        top = base / controller / "ddplab"
        for group in [*(top / cls).glob("*/"), top / cls, top]:
            try:
                group.rmdir()
            except OSError:
                pass  # absent, or still holding another class or a process


def rlimits(memory_bytes: int) -> None:
    """Where no cgroup is writable: per-process address space and per-account processes (set as
    root before the switch of account: the learner cannot raise them again)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (PIDS_PER_LEARNER, PIDS_PER_LEARNER))
