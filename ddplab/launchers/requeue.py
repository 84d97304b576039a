"""Surviving the time limit and preemption: a checkpoint on Slurm's warning, a requeue, a resume.

Teaches: a Slurm job ends at its time limit, and a preempted or failed node
ends it earlier; a run that keeps no checkpoint starts again from step 0. The
batch file that ``%ddp_export --sbatch`` writes asks Slurm for a warning
before the limit (``#SBATCH --signal=USR1@90``: SIGUSR1 to every task 90 s
before it), for the job to be requeueable (``--requeue``) and for its output
to be appended to, not overwritten, by a later attempt (``--open-mode=append``).
On the ranks:

- ``listen()`` (``init_from_env`` calls it under Slurm) catches SIGUSR1, which
  would otherwise kill the task, and only notes it: the signal reaches each
  rank at a different point of its step.
- ``Resumable(model, optimizer).steps(total)`` is the training loop's range.
  After each step every rank says whether it was signalled, in one all-reduce
  (MAX), so all of them stop after the same step. Rank 0 then writes lab 05's
  checkpoint (``{"model": module.state_dict(), "optimizer": ..., "step": n}``,
  written beside and renamed, so a kill mid-write leaves the last one whole),
  every rank waits for it (a barrier), rank 0 asks Slurm to requeue the job
  (``scontrol requeue $SLURM_JOB_ID``) and the ranks leave. The requeued job
  keeps its id, finds the checkpoint under that id and starts at its step.
  The same loop in a notebook is a plain ``range`` from 0, also where the
  kernel itself runs in a Slurm job (a JupyterLab that batchspawner started):
  only a process that ``init_from_env`` joined as a task of the job's step
  (``srun``, or ``torchrun`` under ``srun``) counts as Slurm's (``adopt_job``);
  a Cluster's ranks never do, whatever SLURM_JOB_ID says, so they never
  requeue the learner's JupyterLab job.
- Given a ``path`` outside a Slurm task (plain torchrun), a signalled loop
  saves, says that there is no job to requeue and where the checkpoint is, and
  every rank exits with ``EXIT_RUN_AGAIN`` (75, EX_TEMPFAIL): the run did not
  finish, and running it again resumes at the saved step.

What a step uses besides the weights and the optimizer must come back too: draw
each step's batch from its step number (a generator seeded with the step and
the rank, as lab 05 does), or save the sampler's epoch yourself.

Leaves out: saving on SIGTERM (a preempting scheduler's ``scancel`` gives
KillWait seconds, often 30, too short for a big model's checkpoint: ask for
the signal early instead), the RNG states of DataLoader workers, sharded
checkpoints (``torch.distributed.checkpoint``, lab 05), and submitit's
``checkpoint()`` protocol, which does the same for a pickled function.

References: Slurm's sbatch(1) (``--signal=[B:]SIG[@TIME]``, ``--requeue``,
``--open-mode``, SLURM_RESTART_COUNT) and scontrol(1) (``requeue``);
Lightning's SLURMEnvironment auto-requeue, which answers the same signal the
same way; the PyTorch DDP tutorial's checkpointing section.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

SIGNAL = signal.SIGUSR1
_asked: list[int] = []  # the signals this process received (a handler may only note)
_listening = False
_job: str | None = None  # the Slurm job this process is a task of (adopt_job); None: not Slurm's
EXIT_RUN_AGAIN = 75  # sysexits' EX_TEMPFAIL: stopped early on purpose, run again to resume


def adopt_job(job: str | None) -> None:
    """Mark this process as a task of Slurm job ``job`` (init_from_env under srun, or torchrun
    in a job's step): its Resumable loops then checkpoint under the job and requeue it."""
    global _job
    _job = job or None


def slurm_job() -> str | None:
    """The job this process is a task of; None in a notebook and its Cluster's ranks, even
    where the kernel runs inside a Slurm job (SLURM_JOB_ID set)."""
    return _job


def _note(signum, frame) -> None:
    _asked.append(signum)
    rank = os.environ.get("RANK", "?")
    print(f"ddplab: rank {rank} got {signal.Signals(signum).name} (Slurm's warning before the time "
          "limit): a ddplab.Resumable loop saves a checkpoint after this step and requeues the job; "
          "a script without one runs on until the limit.", file=sys.stderr, flush=True)


def listen() -> bool:
    """Catch SIGUSR1 (it would kill the task) and note it; True once listening."""
    global _listening
    if not _listening:
        try:
            signal.signal(SIGNAL, _note)
            _listening = True
        except ValueError:  # not the main thread: the signal keeps its default
            return False
    return True


def signalled() -> bool:
    return bool(_asked)


def default_path(environ=None) -> Path | None:
    """Where a Slurm job keeps its checkpoint: the submit folder, named by job and id (a
    requeued job keeps its id); None outside Slurm."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return None
    folder = Path(environ.get("SLURM_SUBMIT_DIR") or os.getcwd())
    return folder / f"{environ.get('SLURM_JOB_NAME', 'job')}-{job}.ckpt.pt"


class Resumable:
    """A training loop that survives Slurm's time limit: ``for step in run.steps(total)``."""

    def __init__(self, model, optimizer=None, path=None):
        self.model = getattr(model, "module", model)  # DDP's keys say module.<name>: save the plain ones
        self.optimizer = optimizer
        # Only a task of a Slurm job names its checkpoint after the job; elsewhere (a notebook,
        # a Cluster's ranks, plain torchrun) no path means a plain range, with no all-reduce.
        self.path = Path(path) if path is not None else (default_path() if slurm_job() else None)
        self.step = 0
        if self.path is not None:
            listen()
            self.load()

    def load(self) -> int:
        """Load the checkpoint when there is one; the step to start from."""
        import torch

        from ddplab.pg.backend import device

        if self.path is None or not self.path.exists():
            return self.step
        state = torch.load(self.path, map_location=device(), weights_only=True)
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        if _rank() == 0:
            attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0) + 1
            said = f"attempt {attempt}: " if slurm_job() else ""  # a job's attempts; elsewhere none counted
            print(f"ddplab: {said}resumed from {self.path} at step {self.step}", flush=True)
        return self.step

    def steps(self, total: int):
        """The steps from the checkpoint's (0 without one) to ``total``; stops after a step
        once any rank was signalled, saving and requeueing."""
        for step in range(self.step, total):
            yield step
            self.step = step + 1
            if self.path is not None and self.agreed_to_stop() and self.step < total:
                self.save()
                self.requeue_and_leave()

    def agreed_to_stop(self) -> bool:
        """Was any rank signalled? One all-reduce: every rank gets the same answer at the same step."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if signalled() else 0])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def save(self) -> None:
        """Rank 0 writes the checkpoint (every rank holds the same weights); all wait for it."""
        import torch
        import torch.distributed as dist

        if _rank() == 0:
            state = {"model": self.model.state_dict(), "step": self.step}
            if self.optimizer is not None:
                state["optimizer"] = self.optimizer.state_dict()
            part = self.path.with_name(self.path.name + ".part")
            torch.save(state, part)
            os.replace(part, self.path)  # whole or not at all
            print(f"ddplab: saved {self.path} at step {self.step}", flush=True)
        if dist.is_initialized():
            dist.barrier()  # nobody leaves (or is requeued) before the file is complete

    def requeue_and_leave(self) -> None:
        """Rank 0 asks Slurm to requeue this job; every rank then leaves. Outside a Slurm task
        nothing is requeued: every rank exits with EXIT_RUN_AGAIN, saying how to resume."""
        import torch.distributed as dist

        code = 0
        job = slurm_job()
        if job is None:
            code = EXIT_RUN_AGAIN
            if _rank() == 0:
                print(f"ddplab: no Slurm job to requeue: checkpoint at step {self.step} in {self.path}; "
                      f"run again to resume (exit code {code}).", file=sys.stderr, flush=True)
        elif _rank() == 0:
            done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                code = 1
                print(f"ddplab: `scontrol requeue {job}` failed ({done.stderr.strip()}); the checkpoint "
                      f"{self.path} is kept: pass it to Resumable(path=...) in a new job.",
                      file=sys.stderr, flush=True)
            else:
                print(f"ddplab: job {job} requeued; it resumes at step {self.step}", flush=True)
        # Leave as torchrun.finish() does (no interpreter teardown with a live gloo group);
        # not that function itself: torchrun.py imports this module.
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
