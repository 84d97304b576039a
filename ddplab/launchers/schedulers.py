"""Joining a group that Slurm or Open MPI started: their variables, read as torchrun's.

Teaches: whoever starts the ranks tells each one its place, each launcher in
its own words. torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE
and MASTER_ADDR/PORT; ``srun`` (Slurm) and ``mpirun`` (Open MPI) set their own,
and the rendezvous address is left to you. ``init_from_env()`` calls
``adopt()``, which writes the torchrun names from theirs, then joins as under
torchrun:

    torchrun name      Slurm (a task of an srun step)         Open MPI (mpirun)
    RANK               SLURM_PROCID                           OMPI_COMM_WORLD_RANK
    WORLD_SIZE         SLURM_STEP_NUM_TASKS (SLURM_NTASKS)    OMPI_COMM_WORLD_SIZE
    LOCAL_RANK         SLURM_LOCALID                          OMPI_COMM_WORLD_LOCAL_RANK
    LOCAL_WORLD_SIZE   this node's count in                   OMPI_COMM_WORLD_LOCAL_SIZE
                       SLURM_STEP_TASKS_PER_NODE (e.g. 4(x2))
    MASTER_ADDR        the step's first node (task 0 runs there): ``scontrol show
                       hostnames`` expands the node list; a name that does not
                       resolve is replaced by its NodeAddr (``scontrol show node``)
    MASTER_PORT        20000 + SLURM_JOB_ID % 12000: two jobs sharing a node get
                       different ports (unless their ids differ by a multiple of
                       12000), all below Linux's ephemeral ports (32768-60999)

Which wins: torchrun's RANK, when set, means torchrun (or you) launched the
ranks and nothing is derived (``srun ... torchrun`` sets both: torchrun's win).
Else Open MPI's (``mpirun`` inside a Slurm job also carries Slurm's, which
describe mpirun's own daemons), else Slurm's. A variable you set yourself
(``export MASTER_PORT=...`` in the batch file) is kept.

Refused in words: the batch script itself running the training (Slurm's
batch step is one process: start the tasks with ``srun``), a step of one task
in a job of several nodes or GPUs (``srun -n 1 python train.py`` without
torchrun), tasks that do not match the node's GPUs (SLURM_GPUS_ON_NODE:
one task per GPU), and srun starting more than one torchrun on a node (each
would start the node's ranks again).

Leaves out: other MPIs (MPICH/PMI's PMI_RANK), ``srun --distribution=arbitrary``
(task 0 then need not be on the first node: set MASTER_ADDR), and
heterogeneous jobs.

References: Slurm's srun and sbatch manual pages (OUTPUT ENVIRONMENT
VARIABLES), ``scontrol show hostnames``; Open MPI's mpirun(1) ("Environment
variables"); torch's elastic/run.html for the torchrun names.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess

PORT_BASE, PORT_SPAN = 20000, 12000


class TorchrunEnvError(RuntimeError):
    """init_from_env() found no launcher's variables (torchrun, Slurm, Open MPI), or bad ones."""


def adopt(environ=None) -> str:
    """Add torchrun's variables to ``environ`` (os.environ) from Slurm's or Open MPI's.

    Returns who launched the ranks: "torchrun" (RANK already set: nothing added),
    "openmpi", "slurm", or "none" (no launcher found; init_from_env then names what
    is missing)."""
    environ = os.environ if environ is None else environ
    launcher, derived = torchrun_variables(environ)
    for name, value in derived.items():
        environ.setdefault(name, value)  # what the user set stays
    return launcher


def torchrun_variables(environ) -> tuple[str, dict[str, str]]:
    """(launcher, the torchrun variables its variables give) for an environment dict."""
    if environ.get("RANK"):
        _one_torchrun_per_node(environ)
        return "torchrun", {}
    if environ.get("OMPI_COMM_WORLD_RANK"):
        return "openmpi", _from_openmpi(environ)
    if environ.get("SLURM_PROCID"):
        return "slurm", _from_slurm(environ)
    return "none", {}


def _one_torchrun_per_node(environ) -> None:
    """Refuse srun starting several torchruns on one node: each starts LOCAL_WORLD_SIZE ranks
    there, and their rendezvous mixes agents of several tasks (some then fail far away)."""
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE")
    if not (environ.get("TORCHELASTIC_RUN_ID") and environ.get("SLURM_STEP_ID") and per_node):
        return
    here = tasks_on_node(per_node, int(environ.get("SLURM_NODEID") or 0))
    if here > 1:
        raise TorchrunEnvError(
            f"srun started {here} tasks on this node and each runs torchrun: {here} torchruns here start "
            f"{here} x --nproc-per-node ranks and meet other tasks' agents at one rendezvous. Start one "
            "torchrun per node: `srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_JOB_NUM_NODES "
            "--nproc-per-node=RANKS_PER_NODE ...` (%ddp_export --sbatch --launcher torchrun writes it), "
            "or leave torchrun out and let srun start one task per rank.")


def _int(environ, name: str) -> int:
    raw = environ.get(name)
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise TorchrunEnvError(f"{name}={raw!r} is not an integer.") from None


# -- Slurm -----------------------------------------------------------------------------------------
def _from_slurm(environ) -> dict[str, str]:
    rank = _int(environ, "SLURM_PROCID")
    nodes = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
    gpus_here = int(environ.get("SLURM_GPUS_ON_NODE") or 0)
    in_step = bool(environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID"))
    if not in_step:  # the batch script's own process (sbatch's batch step), on the first node
        tasks = int(environ.get("SLURM_NTASKS") or 1)
        if tasks > 1 or nodes > 1:
            raise TorchrunEnvError(
                f"this is the batch script's own process, not a task: the job has {tasks} task(s) on "
                f"{nodes} node(s), and Slurm runs the batch script once, on the first node. Start "
                "the ranks with srun in the batch file: `srun python train.py` (one task per GPU), "
                "or one torchrun per node: `srun --ntasks-per-node=1 torchrun ...` (docs/hpc.md).")
    world = int(environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or 1)
    if world == 1 and (nodes > 1 or gpus_here > 1):
        has = f"{nodes} nodes" if nodes > 1 else f"{gpus_here} GPUs on this node"
        raise TorchrunEnvError(
            f"this job step has one task, but the job has {has}: a group of one would leave the "
            "rest idle. Start one task per GPU (`srun python train.py`, with --ntasks-per-node "
            "equal to the GPUs per node), or torchrun in each task (`srun --ntasks-per-node=1 "
            "torchrun --nnodes=$SLURM_JOB_NUM_NODES --nproc-per-node=GPUS ...`).")
    if not 0 <= rank < world:
        raise TorchrunEnvError(f"SLURM_PROCID={rank} is outside 0..{world - 1} (the step's tasks).")
    local_rank = _int(environ, "SLURM_LOCALID")
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    local_world = (tasks_on_node(per_node, int(environ.get("SLURM_NODEID") or 0)) if per_node
                   else world)
    if not 0 <= local_rank < local_world:
        raise TorchrunEnvError(f"SLURM_LOCALID={local_rank} is outside 0..{local_world - 1} "
                               f"(tasks on this node, from {per_node!r}).")
    if gpus_here and gpus_here != local_world:
        raise TorchrunEnvError(
            f"this node runs {local_world} task(s) of the step but the job has {gpus_here} GPU(s) "
            f"here (SLURM_GPUS_ON_NODE): ddplab gives each task one GPU, so ask for as many tasks as "
            f"GPUs (--ntasks-per-node={gpus_here}), or run torchrun once per node "
            f"(--ntasks-per-node=1 and torchrun --nproc-per-node={gpus_here}).")
    out = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
           "LOCAL_WORLD_SIZE": str(local_world)}
    if not environ.get("MASTER_ADDR"):
        out["MASTER_ADDR"] = master_address(environ)
    if not environ.get("MASTER_PORT"):
        out["MASTER_PORT"] = str(job_port(environ))
    return out


def tasks_on_node(per_node: str, node: int) -> int:
    """Tasks on node ``node`` from Slurm's compressed list: "4(x2)", "2,1", "3(x2),1"."""
    counts = []
    for part in per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise TorchrunEnvError(f"cannot read the tasks per node {per_node!r}.")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node < len(counts):
        raise TorchrunEnvError(f"SLURM_NODEID={node} is outside the tasks per node {per_node!r}.")
    return counts[node]


def job_port(environ) -> int:
    """The rendezvous port of this Slurm job: 20000 + SLURM_JOB_ID % 12000."""
    return PORT_BASE + _int(environ, "SLURM_JOB_ID") % PORT_SPAN


def master_address(environ) -> str:
    """An address of the step's first node (where task 0 runs) that the other nodes can reach."""
    nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                or environ.get("SLURM_NODELIST"))
    if not nodelist:
        raise TorchrunEnvError("Slurm gave no node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST): "
                               "set MASTER_ADDR to the first node's address.")
    if "[" in nodelist or "," in nodelist:  # a compressed list, e.g. gpu[01-04]: Slurm expands it
        names = _scontrol(environ, "show", "hostnames", nodelist).split()
        if not names:
            raise TorchrunEnvError(f"`scontrol show hostnames {nodelist}` printed no node: set MASTER_ADDR.")
        first = names[0]
    else:
        first = nodelist
    try:
        socket.getaddrinfo(first, None)
        return first
    except OSError:
        pass  # a name only Slurm knows: its NodeAddr is where Slurm itself reaches the node
    shown = _scontrol(environ, "show", "node", first)
    m = re.search(r"\bNodeAddr=(\S+)", shown)
    if not m:
        raise TorchrunEnvError(f"the first node {first!r} does not resolve and `scontrol show node "
                               f"{first}` names no NodeAddr: set MASTER_ADDR to its address.")
    return m.group(1)


def _scontrol(environ, *args: str) -> str:
    exe = shutil.which("scontrol", path=environ.get("PATH", os.defpath))
    if exe is None:
        raise TorchrunEnvError(f"`scontrol {' '.join(args)}` is needed to find the first node's "
                               "address, and scontrol is not on PATH: set MASTER_ADDR yourself.")
    done = subprocess.run([exe, *args], check=False, capture_output=True, text=True, timeout=60,
                          env=dict(environ))
    if done.returncode != 0:
        raise TorchrunEnvError(f"`scontrol {' '.join(args)}` failed ({done.returncode}): "
                               f"{done.stderr.strip()[-500:]}. Set MASTER_ADDR yourself.")
    return done.stdout


# -- Open MPI --------------------------------------------------------------------------------------
def _from_openmpi(environ) -> dict[str, str]:
    names = {"RANK": "OMPI_COMM_WORLD_RANK", "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
             "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_WORLD_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE"}
    out = {ours: str(_int(environ, theirs)) for ours, theirs in names.items()}
    one_node = out["LOCAL_WORLD_SIZE"] == out["WORLD_SIZE"]
    in_slurm = bool(environ.get("SLURM_JOB_ID") and environ.get("SLURM_JOB_NODELIST"))
    if not environ.get("MASTER_ADDR"):
        if in_slurm:  # mpirun inside an allocation puts rank 0 on the allocation's first node
            out["MASTER_ADDR"] = master_address({k: v for k, v in environ.items()
                                                 if not k.startswith("SLURM_STEP_")})
        elif one_node:
            out["MASTER_ADDR"] = "127.0.0.1"
        else:
            raise TorchrunEnvError(
                "mpirun started ranks on several machines but gave no rendezvous address: pass "
                "one, e.g. mpirun -x MASTER_ADDR=<first host's address> -x MASTER_PORT=<free port> ...")
    if not environ.get("MASTER_PORT"):
        if not in_slurm:
            raise TorchrunEnvError("mpirun gives no port to meet at: pass a free one, e.g. "
                                   "mpirun -x MASTER_PORT=<free port> ...")
        out["MASTER_PORT"] = str(job_port(environ))
    return out
