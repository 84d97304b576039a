"""A class on a Slurm cluster: each learner's JupyterLab is a Slurm job (``classroom --spawner slurm``).

Teaches what changes when the learners' servers leave the hub's machine. JupyterHub and its
proxy stay on the login node; batchspawner's ``SlurmSpawner`` writes a batch script per
learner and submits it *as that learner* (``sudo -E -u NAME sbatch``), so the job, its
kernels and its ranks run under the learner's own Unix account on a compute node:

- the job asks for the learner's GPUs (``--gres=gpu:N``), CPUs (``--cpus-per-task``), memory
  (``--mem``) and a time limit (``--time``); Slurm enforces them, not the hub;
- the server binds the node's address as Slurm knows it (``NodeAddr`` in ``scontrol show
  node``), and the hub connects to that same address (:class:`ClassSlurmSpawner`), because node
  names need not resolve on the login node;
- stopping a server (the idle culler, the hub's stop, the learner's log-out) runs ``scancel``;
  a job outlives a SIGKILLed hub only until its time limit;
- the hub needs sudo for exactly three programs run as the learners: :func:`sudoers` writes
  that rule (a file for ``/etc/sudoers.d``, checked with ``visudo -c``).

Leaves out: Slurm accounting and QOS, job arrays, multi-node servers, batchspawner's
``wrapspawner`` profiles.
References: batchspawner 1.3.0's README and ``SlurmSpawner``; sbatch(1), scancel(1),
sudoers(5); docs/hpc.md ("A class on Slurm").
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from batchspawner import SlurmSpawner

from ddplab.launchers.schedulers import master_address

# Run in the job's batch script before the server starts: the address Slurm reaches this node at.
NODE_ADDR = ('export DDPLAB_NODE_ADDR="$(scontrol show node "$SLURMD_NODENAME" '
             "| grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)\"")
PROGRAMS = ("sbatch", "squeue", "scancel")


class ClassSlurmSpawner(SlurmSpawner):
    """SlurmSpawner that reaches the server at its node's NodeAddr when the name does not resolve."""

    def state_gethost(self):
        node = super().state_gethost()
        env = {**os.environ, "SLURM_JOB_NODELIST": node}
        return master_address(env)  # the name if it resolves, else Slurm's NodeAddr for it


def gres(gpus: int) -> str:
    return f"gpu:{gpus}" if gpus else ""


def sudoers(hub_user: str, learners: list[str]) -> str:
    """A sudoers.d rule: ``hub_user`` may run only sbatch, squeue and scancel, only as a learner."""
    paths = []
    for name in PROGRAMS:
        path = shutil.which(name)
        if path is None:
            raise ValueError(f"{name} not found on PATH: the hub's machine needs Slurm's client "
                             "programs (Debian: apt-get install slurm-client)")
        paths.append(str(Path(path).resolve()))
    alias = "DDPLAB_" + re.sub(r"[^A-Z0-9]", "_", hub_user.upper())
    return "\n".join([
        "# Written by `python -m ddplab classroom --spawner slurm`: the hub submits, watches and",
        "# cancels each learner's server job as that learner (batchspawner runs `sudo -E -u NAME`).",
        f"Runas_Alias {alias}_LEARNERS = {', '.join(sorted(learners))}",
        f"Cmnd_Alias {alias}_SLURM = {', '.join(paths)}",
        f"{hub_user} ALL=({alias}_LEARNERS) NOPASSWD:SETENV: {alias}_SLURM",
        "",
    ])

