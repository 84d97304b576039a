"""Limits per learner that the learner cannot lift, and nothing of theirs left when their server stops.

Teaches how a class on one server keeps one learner from taking the machine from the others,
with what the kernel gives where systemd does not run (The Littlest JupyterHub uses systemd's
transient units; systemdspawner does the same). The hub runs as root; for each learner it makes
control groups (cgroup v1, one per controller) under ``/sys/fs/cgroup/<controller>/ddplab/<class>/``:

- ``memory``: ``memory.limit_in_bytes``, all of the learner's processes together (server,
  kernels, ranks); past it the kernel's OOM killer ends a process of that learner only;
- ``pids``: ``pids.max`` processes and threads together (a fork bomb stops there);
- ``cpu``: ``cpu.cfs_quota_us`` = threads x the period: the learner's CPU time per second;
- ``cpuset``: ``cpuset.cpus`` = the seat's CPUs, so widening one's own affinity mask fails;
- ``devices``: ``devices.deny`` for every GPU node but the seat's (:mod:`ddplab.course.gpu_nodes`):
  another seat's GPU cannot be opened, whatever ``CUDA_VISIBLE_DEVICES`` says.

The learner's server joins them while still root, just before the switch to the learner's
account (:func:`join`, in the spawner's preexec); its children inherit the groups, and the
learner cannot move out (the groups' files are root's). When the server stops, :func:`end`
kills every process still in the learner's groups (a ``nohup``ed process included) and removes
them. Where no cgroup can be written (not root, or a v2-only machine whose unified hierarchy
has no controllers delegated), :func:`rlimits` stands in, each labelled for what it enforces:
address space per process (not the learner's total), processes per account.

Grading gets groups of its own (:class:`GradingRun`): each autograded submission runs in fresh
memory, pids and cpu groups under ``ddplab/<class>/grading/``, so its kernel and ranks are limited
together and everything left in them ends with the run. The hub hands ``grading/`` to the
instructor (:func:`delegate_grading`: the folder and its member lists are theirs, the limits
above it root's), because autograde runs as the instructor: in cgroup v1 a user may make groups
in a folder they own, and move their own processes into them, never another account's.
:func:`enforced` says which of all this a machine enforces (``doctor`` and ``classroom`` print it).

Leaves out: cgroup v2 controllers (their files have other names: ``memory.max``, ``cpu.max``;
devices are an eBPF program there), disk quotas; private /tmp and /dev/shm are a mount namespace
(:mod:`ddplab.course.private_tmp`).
References: the kernel's cgroup-v1 documentation (memory.txt, pids.txt, cpusets.txt,
sched-bwc.txt, devices.txt); setrlimit(2); systemd.resource-control(5) for what TLJH sets.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import resource
import signal
import time

BASE = pathlib.Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu", "cpuset", "devices")
GRADING_CONTROLLERS = ("memory", "pids", "cpu")
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


def describe(memory_gib: float, threads: int, base: pathlib.Path = BASE,
             namespace: str | None = "unchecked") -> list[str]:
    """What this machine enforces per learner, one line each (``classroom`` prints it);
    ``namespace``: why a private /tmp cannot be made here (None: it can; by default, checked)."""
    from ddplab.course import private_tmp

    have = writable(base)
    why_not = private_tmp.works() if namespace == "unchecked" else namespace
    said = {
        "memory": f"memory: {memory_gib:g} GiB for all of a learner's processes together (cgroup v1 memory)",
        "pids": f"processes: {PIDS_PER_LEARNER} processes and threads per learner (cgroup v1 pids)",
        "cpu": f"CPU time: {threads} CPU(s) per second per learner (cgroup v1 cpu quota)",
        "cpuset": "CPUs: the seat's CPUs only; a learner cannot widen their affinity (cgroup v1 cpuset)",
        "devices": "GPUs: only the seat's /dev/nvidia<N> open; another seat's GPU is refused (cgroup v1 devices)",
    }
    lines = [said[c] for c in CONTROLLERS if c in have]
    if "memory" not in have:
        lines.append(f"memory: NOT per learner: {address_space_gib(memory_gib):g} GiB of address space per process "
                     "(RLIMIT_AS; a learner's processes together may use more)")
    if "pids" not in have:
        lines.append(f"processes: {PIDS_PER_LEARNER} per account (RLIMIT_NPROC)")
    if "cpuset" not in have:
        lines.append("CPUs: the seat's CPUs as the affinity mask only: a learner can widen it")
    if "devices" not in have:
        lines.append("GPUs: NOT enforced: a seat's GPUs are CUDA_VISIBLE_DEVICES only, which a learner can change")
    lines.append(f"/tmp and /dev/shm: a tmpfs of {memory_gib:g} GiB each per server, private, gone when it stops "
                 "(mount namespace)" if why_not is None else
                 f"/tmp and /dev/shm: NOT private, shared by every learner (no mount namespace: {why_not})")
    if have:
        lines.append("every process of a learner ends when their server stops (their cgroups)")
    else:
        lines.append("a learner's background processes may outlive their server: no cgroup is writable here")
    grading = [c for c in GRADING_CONTROLLERS if c in have]
    lines.append(f"grading: each submission in its own {', '.join(grading)} groups, ended and removed after it"
                 if grading == list(GRADING_CONTROLLERS) else
                 "grading: rlimits per process only (address space, processes per account): no cgroup here")
    return lines


def enforced(base: pathlib.Path = BASE, namespace: str | None = "unchecked") -> dict[str, str]:
    """What a class's hub (root) would enforce on this machine, by kind, in words: "yes: how" or
    "no: why" (``python -m ddplab doctor`` prints it)."""
    from ddplab.course import gpu_nodes, private_tmp

    mounted = [c for c in CONTROLLERS if (base / c / "cgroup.procs").exists()]
    have = writable(base)
    root = os.geteuid() == 0
    why_not = private_tmp.works() if namespace == "unchecked" else namespace

    def cgroup(controllers, how, instead):
        missing = [c for c in controllers if c not in mounted]
        if missing:
            return f"no: cgroup v1 {', '.join(missing)} not mounted here; instead {instead}"
        if not root:
            return f"yes, for a hub run as root: cgroup v1 {', '.join(controllers)} mounted ({how})"
        unwritable = [c for c in controllers if c not in have]
        return (f"no: cgroup v1 {', '.join(unwritable)} not writable; instead {instead}" if unwritable
                else f"yes: cgroup v1 {', '.join(controllers)} ({how})")

    return {
        "memory per learner": cgroup(["memory"], "all of a learner's processes together",
                                     "address space per process (RLIMIT_AS)"),
        "processes per learner": cgroup(["pids"], "processes and threads together",
                                        "processes per account (RLIMIT_NPROC)"),
        "CPU per learner": cgroup(["cpu", "cpuset"], "a CPU quota and the seat's CPUs",
                                  "the seat's CPUs as an affinity mask a learner can widen"),
        "GPUs per learner": cgroup(["devices"], "other seats' /dev/nvidia<N> refused" if gpu_nodes.minors()
                                   else "no GPU node on this machine: nothing to refuse yet",
                                   "CUDA_VISIBLE_DEVICES only, which a learner can change"),
        "nothing outlives a server": cgroup(["memory", "pids", "cpu"], "every member of a learner's groups ended",
                                            "background processes may outlive a server"),
        "private /tmp and /dev/shm": ("yes: a mount namespace and a tmpfs per server" if why_not is None else
                                      f"unchecked: {why_not}" if not root else
                                      f"no: {why_not}; /tmp and /dev/shm are shared"),
        "grading in a cgroup": cgroup(list(GRADING_CONTROLLERS), "each submission's own groups, removed after",
                                      "rlimits per process"),
    }


def groups(cls: str, user: str, base: pathlib.Path = BASE) -> list[pathlib.Path]:
    return [base / c / "ddplab" / cls / user for c in writable(base)]


def _make(group: pathlib.Path, base: pathlib.Path) -> None:
    """``group`` and the levels above it under ``base/<controller>``, made where missing."""
    controller = group.relative_to(base).parts[0]
    levels = [group, *group.parents]
    for level in reversed(levels[:levels.index(base / controller)]):
        if not level.exists():
            level.mkdir(exist_ok=True)  # (another class's hub may make ddplab/ at the same time)
            if controller == "cpuset":  # a cpuset starts empty: give it its parent's
                for name in ("cpuset.cpus", "cpuset.mems"):
                    (level / name).write_text((level.parent / name).read_text())


def prepare(cls: str, user: str, memory_bytes: int, threads: int, cpus: list[int],
            base: pathlib.Path = BASE, denied_gpus: list[int] = ()) -> list[pathlib.Path]:
    """The learner's groups, made (as root) with their limits; returns them. ``denied_gpus``: the
    minors of the GPU nodes the learner may not open (:func:`ddplab.course.gpu_nodes.denied`)."""
    from ddplab.course import gpu_nodes

    made = []
    for group in groups(cls, user, base):
        controller = group.relative_to(base).parts[0]
        _make(group, base)
        settings = {
            "memory": [("memory.limit_in_bytes", str(memory_bytes))],
            "pids": [("pids.max", str(PIDS_PER_LEARNER))],
            "cpu": [("cpu.cfs_period_us", str(PERIOD_US)), ("cpu.cfs_quota_us", str(threads * PERIOD_US))],
            "cpuset": [("cpuset.cpus", ",".join(map(str, cpus)))] if cpus else [],
            # "a": back to everything allowed (a group left from another seat keeps no old rule),
            # then one rule per GPU node of another seat's
            "devices": [("devices.allow", "a"), *(("devices.deny", r) for r in gpu_nodes.rules(denied_gpus))],
        }[controller]
        for name, value in settings:
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
        inside = sorted((p for p in (top / cls).rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for group in [*inside, top / cls, top]:  # the deepest first: a group with groups in it stays
            try:
                group.rmdir()
            except OSError:
                pass  # absent, or still holding another class or a process


def grading_folders(cls: str, base: pathlib.Path = BASE) -> list[pathlib.Path]:
    return [base / c / "ddplab" / cls / "grading" for c in GRADING_CONTROLLERS]


def delegate_grading(cls: str, owner: int, base: pathlib.Path = BASE) -> list[pathlib.Path]:
    """As root (the hub's start): ``ddplab/<cls>/grading/`` made in the memory, pids and cpu
    hierarchies and handed to ``owner`` (the instructor's uid), who may then make a group per
    submission in it (:class:`GradingRun`); the limits above it stay root's."""
    folders = [f for f in grading_folders(cls, base) if f.parts[len(base.parts)] in writable(base)]
    for folder in folders:
        _make(folder, base)
        for path in (folder, folder / "cgroup.procs", folder / "tasks"):
            os.chown(path, owner, -1)
    return folders


class GradingRun:
    """One submission's memory, pids and cpu groups, under the class's ``grading/``: made by the
    process that grades (root, or the instructor it was delegated to), joined by the child that
    starts the sandbox (so the kernel and ranks start inside them), ended and removed after."""

    def __init__(self, groups: list[pathlib.Path]):
        self.groups = groups
        # the member lists by name, made here: join() runs in a forked child, which should not
        # do more than open and write
        self._procs = [str(g / "cgroup.procs") for g in groups]

    @classmethod
    def make(cls_, cls: str, memory_bytes: int, tasks: int, cpus: float,
             base: pathlib.Path = BASE) -> GradingRun | None:
        """Fresh groups with these limits; None where this process cannot make them (then only
        rlimits hold: say so)."""
        folders = grading_folders(cls, base)
        if os.geteuid() == 0 and set(GRADING_CONTROLLERS) <= set(writable(base)):
            for folder in folders:
                _make(folder, base)
        if not all(f.is_dir() and os.access(f, os.W_OK) for f in folders):
            return None
        name = f"run-{os.getpid()}-{time.monotonic_ns()}"
        settings = {"memory": [("memory.limit_in_bytes", str(memory_bytes))],
                    "pids": [("pids.max", str(tasks))],
                    "cpu": [("cpu.cfs_period_us", str(PERIOD_US)),
                            ("cpu.cfs_quota_us", str(max(1000, int(cpus * PERIOD_US))))]}
        run = cls_([])
        try:
            for folder in folders:
                group = folder / name
                group.mkdir()
                run.groups.append(group)
                for file, value in settings[folder.parts[len(base.parts)]]:
                    (group / file).write_text(value)
        except OSError:
            run.end(wait_s=0)
            raise
        return cls_(run.groups)

    def join(self) -> None:
        """This process into the groups (a ``preexec_fn``: the child, before it execs)."""
        pid = str(os.getpid()).encode()
        for procs in self._procs:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)

    def members(self) -> set[int]:
        found = set()
        for group in self.groups:
            try:
                found |= {int(p) for p in (group / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        return found

    def end(self, wait_s: float = 10.0) -> set[int]:
        """Kill what is left in the groups (as root; the instructor's autograde ends the grading
        account's processes itself first) and remove them; the pids that would not go."""
        deadline = time.monotonic() + wait_s
        while True:
            left = self.members()
            if not left or time.monotonic() > deadline:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:  # gone, or another account's (not root): it is ended by its owner
                    pass
            time.sleep(0.05)
        if not left:
            for group in self.groups:
                try:
                    group.rmdir()
                except OSError:
                    pass
        return left


def rlimits(memory_bytes: int) -> None:
    """Where no cgroup is writable: per-process address space and per-account processes (set as
    root before the switch of account: the learner cannot raise them again)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (PIDS_PER_LEARNER, PIDS_PER_LEARNER))
