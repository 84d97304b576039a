"""The Cluster inside a real Jupyter kernel: cell-defined functions, Interrupt, a killed kernel."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from _kernel import execute, running_kernel
from test_cluster import gone

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

START = "import ddplab, os, time\nc = ddplab.Cluster(2, timeout=30)\nprint('PIDS', c.pids)"


def pids_of(out: dict) -> list[int]:
    line = next(ln for ln in out["stdout"].splitlines() if ln.startswith("PIDS"))
    return [int(x) for x in line.split("[", 1)[1].rstrip("]").split(",")]


@pytest.mark.slow
def test_cell_defined_function_and_its_traceback():
    with running_kernel() as (km, kc):
        assert execute(kc, START)["status"] == "ok"
        out = execute(kc, "offset = 40\ndef answer(x):\n    return x + offset\nprint(c.run(answer, 2))")
        assert out["status"] == "ok" and "[42, 42]" in out["stdout"]
        out = execute(kc, "def broken():\n    import torch.distributed as dist\n"
                          "    return {'rank': dist.get_rank()}['nope']\nc.run(broken)")
        assert out["ename"] == "RankError"
        assert "{'rank': dist.get_rank()}['nope']" in out["traceback"]  # the cell's own line
        assert "KeyError" in out["evalue"]
        assert execute(kc, "print(c.run(lambda: 'ok'))")["stdout"].strip().endswith("['ok', 'ok']")
        execute(kc, "c.shutdown()")


@pytest.mark.slow
def test_interrupt_stops_the_job_and_keeps_the_kernel_and_cluster():
    with running_kernel() as (km, kc):
        old = pids_of(execute(kc, START))
        job = ("def slow():\n    import torch, torch.distributed as dist\n"
               "    for i in range(600):\n        dist.all_reduce(torch.ones(1))\n"
               "        time.sleep(0.1)\n    return 'stale'\nc.run(slow)")
        timer = threading.Timer(4.0, km.interrupt_kernel)  # SIGINT to the kernel's process group
        timer.start()
        t0 = time.monotonic()
        out = execute(kc, job)
        timer.join()
        assert out["ename"] == "KeyboardInterrupt"
        assert time.monotonic() - t0 < 30
        assert km.is_alive()
        out = execute(kc, "print(c.run(lambda: 'fresh'))\nprint('PIDS', c.pids)")
        assert "['fresh', 'fresh']" in out["stdout"]  # never the interrupted job's 'stale'
        assert all(gone(p) for p in old) and not set(old) & set(pids_of(out))
        execute(kc, "c.shutdown()")


@pytest.mark.slow
def test_killing_the_kernel_leaves_no_rank_behind():
    with running_kernel() as (km, kc):
        pids = pids_of(execute(kc, START))
        # Processes a job started (here `sleep`) must die with the ranks too.
        out = execute(kc, "import subprocess\n"
                          "print('PIDS', c.run(lambda: subprocess.Popen(['sleep', '1000']).pid))")
        kids = pids_of(out)
        assert not any(gone(p) for p in pids + kids)
        os.kill(km.provisioner.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not all(gone(p) for p in pids + kids):
            time.sleep(0.1)
        assert all(gone(p) for p in pids), "a rank outlived the kernel"
        assert all(gone(p) for p in kids), "a process started by a job outlived the kernel"


def write_later(path):
    """A job that leaves a thread behind (not a daemon) that writes ``path`` 1.5 s later, as
    ddplab.record's gathering writes its files after the last step."""
    def later():
        time.sleep(1.5)
        with open(path, "w") as f:
            f.write("written")

    threading.Thread(target=later).start()
    return os.getpid()


@pytest.mark.slow
def test_a_shutdown_right_after_a_job_lets_its_threads_finish_their_files(tmp_path):
    import ddplab

    path = str(tmp_path / "late.txt")
    cluster = ddplab.Cluster(world_size=1)
    try:
        [pid] = cluster.run(write_later, path)
    finally:
        cluster.shutdown()  # at once: the thread is still sleeping
    assert open(path).read() == "written"  # the rank waited for it before it left
    assert gone(pid)
