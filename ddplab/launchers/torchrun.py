"""Joining a process group that torchrun started: the same code, another launcher.

Teaches: in a notebook the kernel starts the ranks (``ddplab.Cluster``); on
real servers ``torchrun`` does, one process per rank on every machine, and
tells each process its place through environment variables:

    RANK              global rank, 0 .. WORLD_SIZE-1
    LOCAL_RANK        rank among the processes on this machine: the GPU to use
    WORLD_SIZE        ranks in all, over every machine
    LOCAL_WORLD_SIZE  ranks on this machine (they share its cores and GPUs)
    MASTER_ADDR/PORT  where the rendezvous store lives

``init_from_env()`` reads them and joins the group, choosing the backend and
the threads per rank exactly as the Cluster does, so a %%ddp cell and its
``%ddp_export`` script run the same way. It returns a ``DistEnv`` whose
``rank``, ``local_rank``, ``world_size`` and ``device`` are the names every
%%ddp cell finds on its rank (``publish_names``).

Launch (the exported script's docstring repeats these):
    one machine, 2 ranks:       torchrun --nproc-per-node=2 train.py
    2 machines x 4 GPUs, on each of them:
        torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d \\
                 --rdzv-endpoint=HOST:PORT --rdzv-id=JOB train.py
    HOST is an address of one machine that the other can reach, PORT a free
    port there; the rendezvous decides which machine holds ranks 0-3.

Several nodes: gloo (which carries CPU tensors, also beside NCCL) is told
to listen on the interface that reaches MASTER_ADDR (``GLOO_SOCKET_IFNAME``,
unless set), so that the other nodes can connect to it.

Several nodes, one backend: each node counts its own GPUs, so a node with a
GPU per rank and a node without would choose differently, while one group
needs one backend on every rank. So before the group starts,
every process leaves in the rendezvous store (the one ``env://`` opens at
MASTER_ADDR:MASTER_PORT) what it was asked for and what its node can run,
reads everyone's, and all take the same decision (``agree``): under
``auto`` nccl only when every rank can have a GPU of its own, else gloo
(saying which ranks had none); an explicit backend that some node cannot run,
or different explicit backends on different nodes, are refused in words on
every rank.

Under Slurm (``srun python train.py``) or Open MPI (``mpirun``) there are no
torchrun variables: ``schedulers.adopt`` writes them from SLURM_PROCID or
OMPI_COMM_WORLD_RANK and the rest first (torchrun's, when set, win).

Leaves out, compared with torchrun and torch.distributed: elastic membership
and restarts (``--max-restarts``) and torchrun's error files. ``finish()`` is not in torch: it is how a rank leaves
without gloo's teardown abort (see worker.py).

References: https://docs.pytorch.org/docs/stable/elastic/run.html
(environment variables, multi-node); torch.distributed.init_process_group
with the ``env://`` init method; nanoGPT's train.py launch comments.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import NamedTuple

from ddplab.launchers import jobstore, requeue, schedulers, stragglers
from ddplab.launchers.schedulers import TorchrunEnvError
from ddplab.pg import backend as rank_backend
from ddplab.placement import resources

REQUIRED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DistEnv(NamedTuple):
    """Where this process sits in the group."""
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    device: object  # a torch.device (typed loosely: importing this module must not import torch)


def _launch_hint() -> str:
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else "train.py"
    return (
        "Launch the script with torchrun, e.g.\n"
        f"    torchrun --nproc-per-node=2 {script}\n"
        "or, on each of 2 machines (4 GPUs each):\n"
        "    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d "
        f"--rdzv-endpoint=HOST:PORT --rdzv-id=JOB {script}\n"
        "Under Slurm, start one task per GPU: srun python train.py (docs/hpc.md).\n"
        "In a notebook, start ranks with %ddp_start 2 (or ddplab.Cluster(2)) instead."
    )


def read_env(environ=None) -> dict:
    """The torchrun variables as ints/strings; TorchrunEnvError names what is missing."""
    environ = os.environ if environ is None else environ
    missing = [name for name in REQUIRED if not environ.get(name)]
    if missing:
        raise TorchrunEnvError(
            "init_from_env() joins a process group that torchrun started, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set.\n" + _launch_hint())
    values = {"master_addr": environ["MASTER_ADDR"]}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        # LOCAL_WORLD_SIZE is optional: torchrun sets it, hand-made launches may not.
        raw = environ.get(name, environ["WORLD_SIZE"] if name == "LOCAL_WORLD_SIZE" else None)
        try:
            values[name.lower()] = int(raw)
        except ValueError:
            raise TorchrunEnvError(f"{name}={raw!r} is not an integer.\n" + _launch_hint()) from None
    if not 0 <= values["rank"] < values["world_size"]:
        raise TorchrunEnvError(f"RANK={values['rank']} is outside 0..WORLD_SIZE-1 "
                               f"(WORLD_SIZE={values['world_size']}).")
    if not 0 <= values["local_rank"] < values["local_world_size"]:
        raise TorchrunEnvError(f"LOCAL_RANK={values['local_rank']} is outside 0..LOCAL_WORLD_SIZE-1 "
                               f"(LOCAL_WORLD_SIZE={values['local_world_size']}).")
    return values


def init_from_env(backend: str = "auto", timeout: float | None = None,
                  threads: int | None = None) -> DistEnv:
    """Join the group torchrun (or srun, or mpirun) started; return this rank's ``DistEnv``.

    ``backend="auto"`` is nccl when every rank, on every node, can have its own
    GPU, else gloo (each node counts with ``resources.choose_backend``, as the
    Cluster does; the nodes then agree through the rendezvous store).
    ``timeout`` (seconds) bounds how long a collective may stall; None keeps
    torch's default. ``threads`` defaults to this machine's usable CPUs
    divided by the ranks on it, overriding torchrun's OMP_NUM_THREADS=1.
    Calling it again in the same process returns the same DistEnv.
    """
    port_set = bool(os.environ.get("MASTER_PORT"))  # by the user (or torchrun), not derived from the job
    launcher = schedulers.adopt()  # Slurm's or Open MPI's variables, as torchrun's (when RANK is not set)
    env = read_env()  # a wrong launch fails here, before the seconds torch takes to import
    import torch
    import torch.distributed as dist

    if dist.is_initialized():  # a Cluster's rank (or a second call): not a task of a Slurm job
        return current_env()
    job = slurm_task_of(launcher, os.environ)
    if job:
        # Slurm's warning before the time limit (the batch file's --signal=USR1@90) would
        # kill the task: note it instead, for a ddplab.Resumable loop to save and requeue.
        requeue.listen()
        requeue.adopt_job(job)
    # Ranks share this machine's GPUs and cores, not the whole job's: count local ranks.
    # A launcher that gives each process one GPU of its own (CUDA_VISIBLE_DEVICES=<its GPU>)
    # leaves every process seeing one GPU, its GPU 0: that is one GPU per rank too.
    gpu, gpus = local_gpu(env["local_rank"], env["local_world_size"], resources.visible_gpus())
    asked = resources.check_backend(backend)
    could = resources.choose_backend("auto", env["local_world_size"], gpus)  # this node alone
    torch.set_num_threads(threads or resources.threads_per_rank(env["local_world_size"]))
    # gloo (CPU tensors, also beside NCCL) listens on the interface it is given: the one
    # that reaches MASTER_ADDR, which every node can then reach too.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_towards(os.environ["MASTER_ADDR"]))
    # env:// opens the store at MASTER_ADDR/MASTER_PORT (torchrun's agent store, or one
    # rank 0 hosts), with the start-up limit: the nodes meet there before the group starts.
    from ddplab.pg.inner import startup_timeout

    # a taken port said in words; another job's store refused (jobstore.py)
    store = jobstore.open_store(env["rank"], env["world_size"], startup_timeout(timeout),
                                env["master_port"], port_set)
    backend = publish_and_agree(store, env["rank"], env["world_size"], asked, could,
                                startup_timeout(timeout))
    # Under nccl the group also serves CPU tensors through gloo (pg/backend.py).
    if backend == "nccl":
        warn_if_taken(gpu, env["rank"])
    rank_backend.init_group(backend, rank=env["rank"], world_size=env["world_size"],
                            timeout=timeout, gpu=gpu, store=store)
    # A collective that times out names the ranks that never issued it (stragglers.py).
    from ddplab.pg.group import observing_group

    stragglers.watch(observing_group(), env["rank"], env["world_size"], env["master_addr"],
                     env["master_port"])
    return current_env()


def slurm_task_of(launcher: str, environ) -> str | None:
    """The Slurm job this process runs as a task of, or None: srun started it (``launcher``
    "slurm"), mpirun did in the job (Open MPI's ranks), or torchrun did inside a step of the
    job (srun ... torchrun). A kernel in a Slurm job (batchspawner) and its Cluster's ranks
    carry SLURM_JOB_ID too, but join no group through here."""
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return None
    if launcher in ("slurm", "openmpi") or (environ.get("SLURM_STEP_ID") and environ.get("TORCHELASTIC_RUN_ID")):
        return job
    return None


AGREE_KEY = "ddplab/backend"


def publish_and_agree(store, rank: int, world_size: int, asked: str, could: str, timeout) -> str:
    """Leave ``asked,could`` for this rank in ``store``, wait for every rank's, and return
    the backend they all take (``agree``); ``timeout`` is a timedelta."""
    # one set of keys per torchrun restart: a restarted job must not read the last one's
    prefix = f"{AGREE_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store.set(f"{prefix}/{rank}", f"{asked},{could}")
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    store.wait(keys, timeout)
    choices = {}
    for r, key in enumerate(keys):
        a, c = store.get(key).decode().split(",")
        choices[r] = (a, c)
    backend, note = agree(choices)
    if note and rank == 0:
        print(f"ddplab: {note}", file=sys.stderr)
    return backend


def agree(choices: dict) -> tuple[str, str | None]:
    """The backend every rank takes, and a note (or None), from each rank's ``(asked, could)``.

    ``asked`` is what init_from_env was given there (auto, gloo or nccl); ``could`` what
    that rank's node can run (nccl when each of its ranks has a GPU of its own, else
    gloo). Raises TorchrunEnvError, naming the ranks, when the asks differ or an asked
    nccl cannot run on some node; the same on every rank, since all read the same."""
    def ranks(rs, verb=""):
        rs = sorted(rs)
        if len(rs) == 1:
            return f"rank {rs[0]}" + {"": "", "have": " has"}[verb]
        return "ranks " + ", ".join(map(str, rs)) + (f" {verb}" if verb else "")

    explicit = {}
    for r, (a, _) in choices.items():
        if a != "auto":
            explicit.setdefault(a, []).append(r)
    if len(explicit) > 1:
        told = "; ".join(f"{ranks(rs)} asked for {b}" for b, rs in sorted(explicit.items()))
        raise TorchrunEnvError(f"the nodes asked for different backends ({told}): pass the same "
                               "backend to init_from_env on every node, or 'auto' everywhere.")
    without = [r for r, (_, c) in choices.items() if c != "nccl"]
    if explicit:
        (want, _), = explicit.items()
        if want == "nccl" and without:
            raise TorchrunEnvError(
                f"backend='nccl' was asked for, but {ranks(without, 'have')} no GPU of their own (their "
                "node has fewer visible GPUs than ranks). Start fewer ranks per node there "
                "(--nproc-per-node), or pass backend='gloo' (or 'auto') on every node.")
        return want, None
    if without and len(without) < len(choices):
        return "gloo", (f"gloo for every rank: {ranks(without, 'have')} no GPU of their own, and "
                        "one group needs one backend (every rank on nccl needs a GPU per rank).")
    return ("gloo" if without else "nccl"), None


def warn_if_taken(gpu: int, rank: int) -> str | None:
    """Say so (stderr) when another process already holds the GPU this rank is about to take.

    torchrun gives local rank i GPU i, whoever holds it; on a shared server that may be
    another learner's. Returns the warning, or None."""
    from ddplab.placement.gpus import discover

    found = {g.index: g for g in discover()}
    why = found[gpu].busy_reason() if gpu in found else None
    if why is None:
        return None
    msg = (f"ddplab: rank {rank} takes GPU {gpu}, but {why}. On a shared server, run with "
           "CUDA_VISIBLE_DEVICES naming free GPUs (python -m ddplab doctor lists them).")
    print(msg, file=sys.stderr)
    return msg


def in_ipython() -> bool:
    """Is this process an IPython shell or a Jupyter kernel?"""
    ipython = sys.modules.get("IPython")
    if ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None:
        return True
    return any("ipykernel" in arg for arg in sys.argv[:3])  # the kernel, before IPython is set up


def local_gpu(local_rank: int, local_world_size: int, visible: int) -> tuple[int, int]:
    """(this rank's GPU index, GPUs counted for the backend choice) on its machine."""
    if visible == 1 and local_world_size > 1 and os.environ.get("CUDA_VISIBLE_DEVICES"):
        return 0, local_world_size  # one GPU per process, chosen by the launcher
    return local_rank, visible


def interface_towards(addr: str) -> str:
    """The name of this machine's network interface that packets to ``addr`` leave by."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))  # UDP: picks the route, sends nothing
        local = s.getsockname()[0]
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == local:
                return name
    raise RuntimeError(f"no network interface of this machine has the address {local} that "
                       f"reaches MASTER_ADDR={addr}; set GLOO_SOCKET_IFNAME yourself")


def current_env() -> DistEnv:
    """Describe this rank once its group is up: under torchrun or in a Cluster rank."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    # A Cluster's ranks all live on the kernel's machine and have no LOCAL_RANK.
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    # The rank's own GPU (the Cluster may give rank 0 GPU 2), or the CPU under gloo.
    backend, device = rank_backend.backend_name(), rank_backend.device()
    return DistEnv(rank, local_rank, world_size, local_world_size, backend, device)


def publish_names(namespace: dict) -> None:
    """Put ``rank``, ``local_rank``, ``world_size`` and ``device`` into a %%ddp namespace.

    Runs on each Cluster rank; the exported script gets the same names from
    ``init_from_env()``, so cells that use them run unchanged under torchrun.
    """
    env = current_env()
    namespace.update(rank=env.rank, local_rank=env.local_rank, world_size=env.world_size,
                     device=env.device)


def finish(code: int = 0, exit: bool | None = None) -> None:
    """End a torchrun script: wait for every rank, leave the group, exit now.

    Exiting through the interpreter's teardown with a live gloo group can
    abort the process ("terminate called without an active exception"), and
    torchrun would report the run as failed. So the rank destroys the group
    and leaves by ``os._exit``, as the Cluster's ranks do, once the threads the
    interpreter would have waited for are done (a recording's files are written
    on one).

    That exit is only for the script's end: ``exit=None`` exits when called at
    the top level of the ``__main__`` script (the exported script's last line)
    and otherwise returns once the group is gone, so that a caller (submitit's
    runner, a function of yours) gets its result back. ``exit=True``/``False``
    decides it yourself. In IPython or Jupyter it never exits, whatever
    ``exit`` says: a cell runs in ``__main__`` too, and exiting would end the kernel.
    """
    import torch.distributed as dist

    if exit is None:
        caller = sys._getframe(1)
        exit = caller.f_code.co_name == "<module>" and caller.f_globals.get("__name__") == "__main__"
    if exit and in_ipython():
        exit = False  # a cell's top level is __main__ too: exiting would end the kernel
    failure = None
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        stragglers.stop_all()  # its thread uses the store the group is about to drop
        if dist.is_initialized():
            dist.barrier()  # nobody tears down while a peer still needs it
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - report, then still leave without teardown
        print(f"ddplab.launchers.torchrun.finish: {type(exc).__name__}: {exc}", file=sys.stderr)
        code, failure = code or 1, exc
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if exit:
            _wait_for_threads()
            os._exit(code)
    if failure is not None:
        raise failure


def _wait_for_threads(limit_s: float = 120.0) -> None:
    """What the interpreter waits for at a normal exit and ``os._exit`` would cut short: the
    threads that are not daemons (``ddplab.record`` writes its files on one). At most
    ``limit_s`` in all, so a thread that never ends cannot keep the job."""
    deadline = time.monotonic() + limit_s
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon and t.is_alive():
            t.join(max(0.0, deadline - time.monotonic()))
