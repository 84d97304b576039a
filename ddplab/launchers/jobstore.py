"""A job's rendezvous store: its port, taken or not, and only this job's ranks in it.

Teaches: ranks started by srun (or mpirun) meet at MASTER_ADDR:MASTER_PORT,
where rank 0 opens torch's TCPStore and the others connect. Under Slurm ddplab
derives the port from the job id (schedulers.job_port), so two jobs sharing a
node usually differ, but a port can still be taken: by another program, or by
a job whose id differs by a multiple of 12000, or by a MASTER_PORT set by hand.
Then rank 0 cannot listen (EADDRINUSE) and the others may connect to whoever
holds the port: a stranger that never answers, or another job's store, whose
group they would try to join. So:

- rank 0's failure to listen is said in words: which port on which host, who
  chose it, and what to set (``export MASTER_PORT=...`` before srun);
- rank 0 claims its store for its job (the key ``ddplab/job`` set to the job
  id, with compare-and-set, so a store already claimed keeps its owner), and
  every other rank reads the claim before it joins: a store of another job is
  refused, naming both jobs.

Leaves out: choosing a free port for the user (the ranks cannot agree on one
before they meet; a site can give one through the batch file), and torchrun's
own rendezvous (its agent hosts the store, ``--rdzv-endpoint``; the batch file
derives that port the same way).

References: torch.distributed.TCPStore (``compare_set``, ``wait``) and the
``env://`` rendezvous; torch's DistNetworkError ("EADDRINUSE").
"""
from __future__ import annotations

import os
import socket

from ddplab.launchers.schedulers import PORT_BASE, PORT_SPAN, TorchrunEnvError

OWNER_KEY = "ddplab/job"


def job_id(environ=None) -> str:
    """This job's id for the claim: Slurm's job, torchrun's run, or Open MPI's job."""
    environ = os.environ if environ is None else environ
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "OMPI_MCA_ess_base_jobid"):
        if environ.get(name):
            return f"{name}={environ[name]}"
    return "no job id"


def place(environ=None) -> dict:
    """Where this process runs, for recordings: its job (None outside one), Slurm's name for
    its node (None outside Slurm) and its host name."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID")
    return {"job": job, "node": environ.get("SLURMD_NODENAME"), "host": socket.gethostname()}


def place_words(ranks: list) -> str:
    """``[{"rank": 0, "job": ..., "node": ..., "host": ...}, ...]`` as one line for a page."""
    jobs = sorted({r["job"] for r in ranks if r.get("job")})
    where = "; ".join(f"rank {r['rank']} on " + (f"node {r['node']} (host {r['host']})" if r.get("node")
                                                 else f"host {r['host']}") for r in ranks)
    return (f"job {', '.join(jobs)}: " if jobs else "") + where


def taken_message(port: int, chosen_by_user: bool, host: str | None = None) -> str:
    host = host or socket.gethostname()
    if chosen_by_user:
        who = "MASTER_PORT, set in the job's environment,"
    else:
        who = f"the port ddplab derived from the job id ({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN})"
    return (f"rank 0 cannot listen on port {port} on {host}: {who} is taken there (EADDRINUSE: another "
            "program, or another job on this node, listens on it). Set a free port for this job: "
            "`export MASTER_PORT=<free port>` in the batch file before srun (e.g. one from "
            "`python -c \"import socket; s=socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])\"` "
            "on the first node).")


def open_store(rank: int, world_size: int, timeout, port: int, chosen_by_user: bool):
    """The env:// store for this rank, with a taken port said in words and the job's claim checked."""
    from torch.distributed.rendezvous import rendezvous

    try:
        store, _, _ = next(rendezvous("env://", rank, world_size, timeout=timeout))
    except RuntimeError as exc:
        if rank == 0 and "EADDRINUSE" in str(exc):
            raise TorchrunEnvError(taken_message(port, chosen_by_user)) from exc
        raise
    claim(store, rank, job_id(), timeout)
    return store


def claim(store, rank: int, job: str, timeout) -> None:
    """Rank 0 claims ``store`` for ``job``; every rank refuses a store claimed by another job."""
    if rank == 0:
        owner = store.compare_set(OWNER_KEY, "", job).decode()
    else:
        store.wait([OWNER_KEY], timeout)
        owner = store.get(OWNER_KEY).decode()
    if owner != job:
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        raise TorchrunEnvError(
            f"rank {rank} of {job} reached the rendezvous store at {addr}:{port}, but it belongs to "
            f"{owner}: both jobs meet at the same port. This job's rank 0 could not listen there; "
            "set a free port for this job (`export MASTER_PORT=<free port>` in the batch file before srun).")
