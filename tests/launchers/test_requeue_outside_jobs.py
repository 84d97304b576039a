"""Resumable and finish() where no Slurm task runs: a notebook kernel inside a Slurm job (its
Cluster's ranks carry SLURM_JOB_ID), a plain torchrun run given a checkpoint path, an IPython cell.

No test here reaches a real ``scontrol``: where one could be called, PATH starts with a fake
that logs its calls, and the tests assert that it was never called.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ddplab
from ddplab.launchers import requeue, torchrun

SOURCE = Path(ddplab.__file__).resolve().parents[1]


@pytest.fixture
def fake_scontrol(tmp_path):
    """An environment whose PATH finds a fake scontrol first; its calls land in ``scontrol.log``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "scontrol.log"
    exe = bin_dir / "scontrol"
    exe.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    exe.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))}
    # the ddplab under test (this checkout's, or the one PYTHONPATH names)
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}", PYTHONPATH=str(SOURCE))
    return env, log


def test_a_kernel_inside_a_slurm_job_gets_a_plain_range(monkeypatch, tmp_path):
    """SLURM_JOB_ID alone (a JupyterLab that batchspawner started) does not make this process
    Slurm's: no checkpoint named after the job, SIGUSR1 left alone, a plain range."""
    monkeypatch.setattr(requeue, "_job", None, raising=False)  # no init_from_env joined a job here
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NAME", "jupyterlab")
    monkeypatch.setenv("SLURM_SUBMIT_DIR", str(tmp_path))
    before = signal.getsignal(signal.SIGUSR1)
    net = torch.nn.Linear(2, 1)
    run = ddplab.Resumable(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert run.path is None
    assert signal.getsignal(signal.SIGUSR1) is before
    assert list(run.steps(3)) == [0, 1, 2]
    assert list(tmp_path.iterdir()) == []


def test_only_a_task_of_the_jobs_step_is_slurms():
    job = {"SLURM_JOB_ID": "5"}
    assert torchrun.slurm_task_of("none", job) is None  # the kernel (and its ranks) in a job
    assert torchrun.slurm_task_of("slurm", dict(job, SLURM_PROCID="0")) == "5"  # srun python train.py
    assert torchrun.slurm_task_of("openmpi", dict(job, OMPI_COMM_WORLD_RANK="0")) == "5"  # mpirun in the job
    under_srun = dict(job, SLURM_STEP_ID="0", TORCHELASTIC_RUN_ID="5")
    assert torchrun.slurm_task_of("torchrun", under_srun) == "5"  # srun ... torchrun train.py
    assert torchrun.slurm_task_of("torchrun", dict(job, TORCHELASTIC_RUN_ID="x")) is None
    assert torchrun.slurm_task_of("slurm", {}) is None


@pytest.mark.more
def test_a_clusters_ranks_in_a_slurm_job_get_a_plain_range(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_SUBMIT_DIR", str(tmp_path))

    def on_rank():
        import signal

        import torch

        import ddplab

        net = torch.nn.Linear(2, 1)
        run = ddplab.Resumable(net)
        caught = signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL
        return (os.environ.get("SLURM_JOB_ID"), run.path, not caught, list(run.steps(2)))

    with ddplab.Cluster(2, backend="gloo") as cluster:
        results = cluster.run(on_rank)
    assert results == [("77", None, True, [0, 1])] * 2
    assert list(tmp_path.iterdir()) == []


SIGNALLED = """
import os, signal, torch, ddplab
net = torch.nn.Linear(2, 1)
run = ddplab.Resumable(net, path={path!r})
for step in run.steps(10):
    print("step", step, flush=True)
    if step == 2:
        os.kill(os.getpid(), signal.SIGUSR1)
print("finished", flush=True)
"""


@pytest.mark.more
def test_a_signalled_run_outside_slurm_saves_and_exits_saying_how_to_resume(fake_scontrol, tmp_path):
    env, log = fake_scontrol
    path = tmp_path / "run.ckpt.pt"
    done = subprocess.run([sys.executable, "-c", SIGNALLED.format(path=str(path))], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 75, done.stderr  # EX_TEMPFAIL: stopped early, run again
    assert requeue.EXIT_RUN_AGAIN == 75
    assert done.stdout.splitlines()[:3] == ["step 0", "step 1", "step 2"]
    assert "finished" not in done.stdout.splitlines() and "step 3" not in done.stdout.splitlines()
    assert f"no Slurm job to requeue: checkpoint at step 3 in {path}; run again to resume" in done.stderr
    assert "requeued" not in done.stdout + done.stderr
    assert torch.load(path, weights_only=True)["step"] == 3
    assert not log.exists()  # scontrol was never asked
    again = subprocess.run([sys.executable, "-c", SIGNALLED.format(path=str(path)).replace("step == 2", "False")],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    steps = [line for line in again.stdout.splitlines() if line.startswith("step ")]
    assert steps == [f"step {n}" for n in range(3, 10)] and "finished" in again.stdout


@pytest.mark.more
def test_finish_at_a_cells_top_level_returns_instead_of_ending_the_kernel(fake_scontrol):
    env, _ = fake_scontrol
    code = textwrap.dedent("""
        import ddplab.launchers.torchrun as t
        t.finish()
        print("kernel alive")
    """)
    done = subprocess.run([sys.executable, "-m", "IPython", "--quick", "--no-banner", "-c", code],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "kernel alive" in done.stdout
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and "kernel alive" not in plain.stdout  # a script's end still exits
