"""Seats: the GPUs and CPUs each learner's server gets when a class shares one server.

Teaches: a hub that starts 20 learners' Jupyter servers on one machine has to
split the machine out, or the learners split it by luck. Each learner's server
gets a *seat*:

- its own set of GPUs, disjoint from every other learner's, written into the
  server's ``CUDA_VISIBLE_DEVICES`` (CUDA then numbers them 0, 1, ... inside
  that server, so ``ddplab.Cluster(2)`` there takes exactly them without
  arguments);
- its own CPUs (an affinity mask), so that ddplab's fair thread count per rank
  (``resources.usable_cpus`` reads the mask) divides the learner's share, not
  the whole machine.

Which GPUs: :func:`ddplab.placement.gpus.place`, the same function every
``Cluster`` calls, asked for ``gpus_per_learner`` GPUs among those that no other
seat holds. It skips GPUs that another process uses (nvidia-smi's compute
apps, or memory in use where pids are hidden), so a GPU held by a job outside
the class is not handed out. When no set is left the learner's seat is CPU only
(an empty ``CUDA_VISIBLE_DEVICES``) and the seat's note, passed to the server
as ``DDPLAB_SEAT_NOTE``, tells them why when their first Cluster starts.

A seat is taken when the hub starts a server (its ``pre_spawn_hook``) and given
back when the server stops (``post_stop_hook``), including a stop by
jupyterhub-idle-culler: the GPUs of a learner who went for lunch go to the next
one who starts.

Leaves out: memory. A seat does not limit memory; only a spawner that runs
servers in cgroups (systemdspawner's ``mem_limit``) enforces ``mem_limit``, and
JupyterHub's local-process spawners ignore it. MIG slices count as whole GPUs.

References: JupyterHub's Spawner ``pre_spawn_hook``/``post_stop_hook``;
sched_setaffinity(2); CUDA_VISIBLE_DEVICES in the CUDA programming guide.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ddplab.placement import gpus as gpu_placement

NOTE_VAR = "DDPLAB_SEAT_NOTE"


@dataclass(frozen=True)
class Seat:
    user: str
    gpus: tuple[str, ...]  # CUDA_VISIBLE_DEVICES entries: GPU UUIDs (or indices when unknown)
    cpus: tuple[int, ...]
    note: str = ""

    def environment(self) -> dict:
        """What the learner's server gets in its environment."""
        env = {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        if self.note:
            env[NOTE_VAR] = self.note
        return env


def gpu_key(gpu: gpu_placement.GPU) -> str:
    # A UUID names the same GPU whatever CUDA_VISIBLE_DEVICES the hub itself runs under.
    return gpu.uuid or str(gpu.index)


class Seats:
    """Every seat the hub has handed out; ``take`` and ``release`` by user name."""

    def __init__(self, gpus_per_learner: int = 0, threads: int = 2, cpus=None, discover=None):
        if not isinstance(gpus_per_learner, int) or gpus_per_learner < 0:
            raise ValueError(f"gpus_per_learner must be 0 (CPU only) or more, got {gpus_per_learner!r}")
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive number of CPUs per learner, got {threads!r}")
        self.gpus_per_learner, self.threads = gpus_per_learner, threads
        self.cpus = tuple(sorted(os.sched_getaffinity(0) if cpus is None else cpus))
        if not self.cpus:
            raise ValueError("no CPUs to hand out")
        self.discover = gpu_placement.discover if discover is None else discover
        self.taken: dict[str, Seat] = {}

    def take(self, user: str) -> Seat:
        """The learner's seat: the one they hold, or a new one from what is free now."""
        if user in self.taken:
            return self.taken[user]
        gpus, note = self._gpus()
        seat = Seat(user, gpus, self._cpus(), note)
        self.taken[user] = seat
        return seat

    def release(self, user: str) -> None:
        self.taken.pop(user, None)

    def _gpus(self) -> tuple[tuple[str, ...], str]:
        if self.gpus_per_learner == 0:
            return (), ""
        found = self.discover()
        held = {g for seat in self.taken.values() for g in seat.gpus}
        free = [g for g in found if gpu_key(g) not in held]
        placed = gpu_placement.place(self.gpus_per_learner, "auto", found=free)
        if placed.backend == "nccl":
            by_index = {g.index: g for g in free}
            return tuple(gpu_key(by_index[i]) for i in placed.gpus), ""
        others = len({s.user for s in self.taken.values() if s.gpus})
        why = "; ".join(placed.notes) or "this server has no GPU"
        return (), (f"This class gives each learner {self.gpus_per_learner} GPU(s); none are free "
                    f"for you now ({others} learner(s) hold GPU sets; {why}). Your ranks run on "
                    "CPU with gloo: every lab works there. Ask the instructor for a GPU seat, or "
                    "restart your server later (File > Hub Control Panel) to try again.")

    def _cpus(self) -> tuple[int, ...]:
        # Least-used CPUs first: disjoint while there are enough, shared evenly after that.
        use = {c: 0 for c in self.cpus}
        for seat in self.taken.values():
            for c in seat.cpus:
                if c in use:
                    use[c] += 1
        order = sorted(self.cpus, key=lambda c: (use[c], c))
        return tuple(sorted(order[:min(self.threads, len(order))]))
