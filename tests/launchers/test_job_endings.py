"""A job's endings in words: who never joined a timed-out collective, and a loop that resumes.

Runs in one process (no group): the message ``stragglers.describe`` builds from every rank's
published count, the store keys that keep jobs and attempts apart, and ``Resumable``'s
checkpoint, written as lab 05 writes it and read back into a fresh model and optimizer. The
same code in real Slurm jobs (a planted hang, a signalled job that requeues itself) is in
tests/launchers/test_slurm.py.
"""
from __future__ import annotations

import pytest
import torch

from ddplab.launchers import requeue, stragglers


def test_the_timeout_message_names_the_ranks_behind_their_node_and_last_collective():
    seen = {0: (7, "all_reduce", "node n1, host a"), 1: (5, "broadcast", "node n2, host b"),
            2: None, 3: (7, "all_reduce", "node n2, host b")}
    text = stragglers.describe(0, 7, "all_reduce", seen, "Operation timed out!")
    assert text.startswith("rank 0 timed out in all_reduce (its collective #7) waiting for its peers "
                           "(Operation timed out!).")
    assert "rank 1 (node n2, host b) never joined it: its last was #5 broadcast." in text
    assert "rank 2 never joined it: it left no count in the store" in text
    assert "rank 3" not in text  # it issued #7 too


def test_when_every_rank_reached_the_collective_the_message_says_so():
    seen = {0: (4, "all_reduce", "host a"), 1: (4, "all_gather", "host b")}
    text = stragglers.describe(0, 4, "all_reduce", seen, "Timed out")
    assert "Every rank issued a collective #4" in text and "rank 1: #4 all_gather (host b)" in text


def test_jobs_and_attempts_use_their_own_keys():
    one = stragglers.job_key({"SLURM_JOB_ID": "12"})
    assert one != stragglers.job_key({"SLURM_JOB_ID": "13"})
    assert one != stragglers.job_key({"SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": "1"})
    assert stragglers.where({"SLURMD_NODENAME": "n2"}).startswith("node n2, host ")


def test_a_checkpoint_resumes_the_loop_at_its_step_with_the_optimizer_state(tmp_path):
    def fresh():
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 1).double()
        return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)  # state to restore

    def train(net, opt, run, stop_after=None):
        for step in run.steps(6):
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
            if step == stop_after:
                run.step = step + 1
                run.save()  # what a signalled loop does before it requeues
                return

    net, opt = fresh()
    train(net, opt, requeue.Resumable(net, opt, path=None))  # no Slurm: a plain range
    path = tmp_path / "job-1.ckpt.pt"
    cut, cut_opt = fresh()
    train(cut, cut_opt, requeue.Resumable(cut, cut_opt, path=path), stop_after=2)
    assert sorted(torch.load(path, weights_only=True)) == ["model", "optimizer", "step"]
    again, again_opt = fresh()
    run = requeue.Resumable(again, again_opt, path=path)
    assert run.step == 3
    train(again, again_opt, run)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), again.parameters()))
    assert requeue.default_path({}) is None
    assert requeue.default_path({"SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "lab",
                                 "SLURM_SUBMIT_DIR": "/x"}).as_posix() == "/x/lab-7.ckpt.pt"


def test_a_rank_that_reaches_another_jobs_store_is_refused_naming_both_jobs():
    import datetime

    import torch.distributed as dist

    from ddplab.launchers import jobstore
    from ddplab.launchers.schedulers import TorchrunEnvError

    limit = datetime.timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=limit)
    jobstore.claim(server, 0, "SLURM_JOB_ID=41", limit)  # job 41's rank 0 holds the port
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=limit)
    jobstore.claim(client, 1, "SLURM_JOB_ID=41", limit)  # its own rank joins
    with pytest.raises(TorchrunEnvError, match=r"rank 1 of SLURM_JOB_ID=12041 reached the rendezvous store "
                                               r".* but it belongs to SLURM_JOB_ID=41(.|\n)*MASTER_PORT"):
        jobstore.claim(client, 1, "SLURM_JOB_ID=12041", limit)
    with pytest.raises(TorchrunEnvError, match="belongs to SLURM_JOB_ID=41"):  # a second rank 0 too
        jobstore.claim(client, 0, "SLURM_JOB_ID=12041", limit)


def test_an_export_names_each_cell_left_out_and_refuses_zero_cells():
    from ddplab.notebook import export

    rec = export.Recording(2)
    assert "no %%ddp cell has run" in export.nothing_to_export(rec)
    rec.add_left_out("<ddp-cell-3>", "rank 0 raised KeyError: 'SLURM_JOB_ID'")
    why = export.nothing_to_export(rec)  # only a cell that raised: no script, no batch file
    assert why.startswith("nothing to export: every %%ddp cell since the ranks started raised")
    assert "<ddp-cell-3>: rank 0 raised KeyError: 'SLURM_JOB_ID'" in why
    rec.add_cell("<ddp-cell-4>", "x = rank")
    assert export.nothing_to_export(rec) is None
    script, _ = export.script_text(rec)  # a run at another world size says so at its start
    assert "if world_size != 2 and rank == 0:" in script and "the notebook had 2" in script
    hint = export.export_hint("t.py", rec)
    assert "1 cell(s), 0 push(es), 1 failed cell(s) left out" in hint
    assert "Left out: <ddp-cell-3> raised in the notebook (rank 0 raised KeyError: 'SLURM_JOB_ID')" in hint


FINISH = """
import ddplab
import ddplab.launchers.torchrun


def train():  # as submitit calls a function: it must get the value back
    env = ddplab.init_from_env(timeout=30)
    ddplab.launchers.torchrun.finish()
    return 40 + env.world_size + 1


print("result", train(), flush=True)
ddplab.launchers.torchrun.finish()  # the script's end: the process exits here
print("after the end", flush=True)
"""


@pytest.mark.more
def test_finish_returns_to_a_caller_and_exits_only_at_the_scripts_end(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "job.py").write_text(FINISH)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    done = subprocess.run([sys.executable, str(tmp_path / "job.py")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["result 42"], done.stdout + done.stderr


def test_every_lab_that_trains_says_whether_and_how_it_exports():
    """Lab 01's %%ddp cells export (and it says how); the labs that train through ddplab's
    functions say that %ddp_export has nothing to write there, and what to do instead."""
    from pathlib import Path

    import nbformat

    labs = sorted((Path(__file__).resolve().parents[1] / "labs").glob("[0-9][0-9]-*.ipynb"))
    for lab in labs:
        if lab.name.startswith("00-"):  # one all-reduce: nothing trains
            continue
        cells = nbformat.read(lab, as_version=4).cells
        ddp = [c for c in cells if c.cell_type == "code" and c.source.startswith("%%ddp")]
        says = " ".join(c.source for c in cells if c.cell_type == "markdown")
        if ddp:
            assert "%ddp_export" in says, lab.name
        else:
            assert "**Exporting this lab.**" in says and "`%ddp_export` has nothing to write here" in says, lab.name


def test_progress_published_in_a_real_store_names_the_rank_behind_on_a_timeout():
    """Two ranks' Progress on one TCPStore (in one process): rank 1 stops after two collectives,
    rank 0 times out in its third and raises NeverJoined naming rank 1 and its last one."""
    import datetime

    import torch.distributed as dist

    limit = datetime.timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=limit)
    ranks = [stragglers.Progress(server, r, 2, prefix="ddplab/progress/test") for r in (0, 1)]
    try:
        for op in ("all_reduce", "broadcast"):
            for p in ranks:
                p.launched(op, [], None, None)
        token = ranks[0].launched("all_reduce", [], None, None)
        with pytest.raises(stragglers.NeverJoined, match=r"rank 0 timed out in all_reduce \(its collective #3\)"
                                                         r"(.|\n)*rank 1 \(host .*\) never joined it: its last "
                                                         r"was #2 broadcast"):
            ranks[0].failed(token, RuntimeError("Operation timed out!"))
        ranks[0].failed(token, RuntimeError("Connection closed by peer"))  # not a timeout: not ours to explain
    finally:
        for p in ranks:
            p.stop()
