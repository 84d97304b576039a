"""A Cluster in a classroom: threads, dead idle ranks, endless output, stray children,
collectives out of step, and error headlines that name the root cause."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import threading
import time

import pytest
import torch
from _procs import gone, rank_children, wait_gone, wait_rank_children

import ddplab
from ddplab.cluster import output

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test


@pytest.fixture
def cluster(cluster2):
    return cluster2  # shared for the session (conftest.py)


def _reduce(x):
    import torch.distributed as dist

    t = torch.tensor([float(x)])
    dist.all_reduce(t)
    return t.item()


# -- 1. threads -----------------------------------------------------------------
def test_run_from_two_threads_at_once_gives_each_its_own_answer(cluster):
    results, errors = {"a": [], "b": []}, []

    def caller(name, x):
        try:
            for _ in range(15):
                results[name].append(cluster.run(_reduce, x))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=("a", 1)), threading.Thread(target=caller, args=("b", 100))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors
    assert results["a"] == [[2.0, 2.0]] * 15 and results["b"] == [[200.0, 200.0]] * 15


@pytest.mark.slow
def test_ranks_outlive_the_thread_that_started_or_replaced_them():
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("c", ddplab.Cluster(2, timeout=20)))
    t.start()
    t.join(60)
    c = box["c"]
    try:
        time.sleep(0.5)  # PR_SET_PDEATHSIG would fire as the thread ends
        assert c.run(_reduce, 1) == [2.0, 2.0]

        def fail_on_1():  # rank 0 waits in a collective: the ranks must be replaced
            import torch.distributed as dist

            if dist.get_rank() == 1:
                raise ValueError("boom")
            dist.all_reduce(torch.ones(1))

        def replace_from_thread():
            with pytest.raises(ddplab.RankError):
                c.run(fail_on_1)

        old = c.pids
        t = threading.Thread(target=replace_from_thread)
        t.start()
        t.join(60)
        assert c.pids != old
        time.sleep(0.5)
        assert c.run(_reduce, 2) == [4.0, 4.0]
    finally:
        c.shutdown()


@pytest.mark.slow
def test_shutdown_while_another_thread_runs_a_job_starts_nothing_new():
    before = rank_children()
    c = ddplab.Cluster(2, timeout=20)
    errors = []

    def long_job():
        try:
            c.run(time.sleep, 60)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=long_job)
    t.start()
    time.sleep(1.0)
    pids = c.pids
    t0 = time.monotonic()
    c.shutdown()
    t.join(30)
    assert time.monotonic() - t0 < 15 and not t.is_alive()
    assert isinstance(errors[0], ddplab.ClusterError) and "shut down" in str(errors[0])
    assert wait_gone(pids) and c.pids == []
    assert rank_children() <= before  # nothing started after shutdown


@pytest.mark.slow
def test_a_rank_that_died_while_idle_is_replaced_before_the_next_job(cluster, capsys):
    dead = cluster.pids[1]
    os.kill(dead, signal.SIGKILL)
    # A multi-threaded process is waitable only once all its threads have ended; a rank
    # that dies in the middle of the next job is a RankDied instead.
    assert cluster._gens.ranks.exit_status(1, wait_s=15) == -signal.SIGKILL
    assert cluster.run(_reduce, 3) == [6.0, 6.0]
    err = capsys.readouterr().err
    assert f"rank 1 (pid {dead}) had died while idle (signal SIGKILL" in err and "replaced" in err
    assert dead not in cluster.pids


@pytest.mark.slow
def test_ensure_ready_replaces_a_dead_rank_before_any_job(cluster, capsys):
    old = cluster.pids
    os.kill(old[0], signal.SIGKILL)
    assert cluster._gens.ranks.exit_status(0, wait_s=15) == -signal.SIGKILL
    new = cluster.ensure_ready()
    assert new == cluster.pids and not set(new) & set(old)
    assert "had died while idle" in capsys.readouterr().err
    assert cluster.ensure_ready() == new  # healthy ranks are kept


# -- 2. endless output --------------------------------------------------------------
@pytest.mark.slow
def test_endless_printing_still_stops_at_job_timeout(cluster, capsys, monkeypatch):
    from ddplab.cluster import lifecycle

    def flood():
        line = "x" * 200
        while True:
            print(line)

    decided = []  # when the kernel gave up on the job (the replacement, timed apart, follows)
    monkeypatch.setattr(lifecycle, "_test_hook",
                        lambda name: decided.append(time.monotonic()) if name == "replace:waiting" else None)
    t0 = time.monotonic()
    with pytest.raises(ddplab.JobTimeout):
        cluster.run_job(flood, job_timeout=2.0)
    took = time.monotonic() - t0
    monkeypatch.setattr(lifecycle, "_test_hook", None)
    out, err = capsys.readouterr()
    assert decided and decided[0] - t0 < 8, f"JobTimeout(2 s) decided after {decided[0] - t0:.1f} s"
    assert took < 60
    # The job's head and tail, and what arrived while its ranks were being stopped.
    limit = 2 * (2 * output.HEAD_BYTES + output.TAIL_BYTES)
    assert len(out) < 1.1 * limit, "the cell must show a bounded amount of each rank's output"
    assert "of this job's output dropped here" in err
    assert cluster.run(_reduce, 1) == [2.0, 2.0]


@pytest.mark.slow
def test_a_large_print_shows_its_head_and_tail_and_what_was_dropped(cluster, capsys):
    def chatty():
        for i in range(200_000):
            print(f"line {i:06d} " + "y" * 90)
        print("THE END")
        return "done"

    assert cluster.run(chatty) == ["done", "done"]
    out, err = capsys.readouterr()
    for r in range(2):
        assert f"[rank {r}] line 000000" in out and f"[rank {r}] THE END" in out
        assert f"[rank {r}] ... " in err and "MiB of this job's output dropped here" in err
    assert "line 100000" not in out
    assert len(out) < 1.3 * 2 * (output.HEAD_BYTES + output.TAIL_BYTES)


# -- 3. processes a job starts ---------------------------------------------------------
def _start_sleeper(seconds=1000, **popen):

    return subprocess.Popen(["sleep", str(seconds)], **popen).pid


def _output_threads() -> int:
    return sum(t.name.startswith("ddplab-output") for t in threading.enumerate())


@pytest.mark.slow
def test_children_of_a_job_die_at_replacement_and_at_a_fast_shutdown():
    pumps = _output_threads()
    c = ddplab.Cluster(2, timeout=20)
    try:
        kids = c.run(_start_sleeper)
        assert not any(gone(p) for p in kids)
        with pytest.raises(ddplab.JobTimeout):  # the sleepers hold the ranks' output pipes
            c.run_job(lambda: _start_sleeper() and time.sleep(60), job_timeout=1.0)
        assert wait_gone(kids, timeout=5)
        # These hold the new ranks' stdout and stderr: stopping must not wait for them.
        kids = c.run(_start_sleeper)
    finally:
        t0 = time.monotonic()
        c.shutdown()
        took = time.monotonic() - t0
    assert took < 2.0, f"shutdown took {took:.1f} s"
    assert wait_gone(kids, timeout=5)
    assert _output_threads() == pumps  # no generation's output thread outlives it


@pytest.mark.slow
def test_a_process_that_leaves_the_session_on_purpose_escapes(cluster):
    # The documented limit: start_new_session (setsid) leaves the rank's process group.
    pid = cluster.run(_start_sleeper, 1000, start_new_session=True)[0]
    try:
        cluster.run(lambda: os._exit(1) if __import__("torch").distributed.get_rank() == 0 else 0)
    except ddplab.RankDied:
        pass
    time.sleep(0.5)
    try:
        assert not gone(pid)
    finally:
        os.kill(pid, signal.SIGKILL)


# -- 5. collectives out of step -----------------------------------------------------------
def _fail_out_of_step():
    import torch.distributed as dist

    if dist.get_rank() == 0:  # like an OverlapDDP backward that raised after some hooks fired
        for _ in range(3):
            dist.all_reduce(torch.ones(1), async_op=True)
    raise ValueError(f"backward failed on rank {dist.get_rank()}")


@pytest.mark.slow
def test_ranks_whose_collectives_no_longer_line_up_are_replaced(cluster):
    old = cluster.pids
    with pytest.raises(ddplab.RankError) as info:
        cluster.run(_fail_out_of_step)
    assert "different numbers of collectives" in str(info.value)
    assert cluster.pids != old
    rank_plus_one = cluster.run(lambda: _reduce(1 + __import__("torch").distributed.get_rank()))
    assert rank_plus_one == [3.0, 3.0]  # never 4.0 from a stale all-reduce


def test_ranks_whose_collectives_line_up_are_kept(cluster):
    def reduce_then_fail():
        _reduce(1)
        raise ValueError("after a matched all-reduce, the loader timed out")

    old = cluster.pids
    with pytest.raises(ddplab.RankError) as info:
        cluster.run(reduce_then_fail)
    # "timed out" in a learner's own message is not a collective timeout.
    assert not isinstance(info.value, ddplab.CollectiveTimeout)
    assert "collectives line up" in str(info.value) and cluster.pids == old


def _mismatched():
    import torch.distributed as dist

    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:  # the same count of collectives, but not the same collective
        dist.broadcast(t, 0)


@pytest.mark.slow
def test_a_mismatched_collective_is_a_timeout_and_its_closed_connections_are_replaced():
    with ddplab.Cluster(2, timeout=3) as c:
        old = c.pids
        with pytest.raises(ddplab.CollectiveTimeout) as info:
            c.run(_mismatched)
        assert "replaced" in str(info.value) and c.pids != old
        assert c.run(lambda: _reduce(1 + __import__("torch").distributed.get_rank())) == [3.0, 3.0]


# -- 6. headlines name the root cause ----------------------------------------------------------
@pytest.mark.slow
def test_a_segfault_is_the_headline_not_the_peers_knock_on_error(cluster):
    def segfault_on_1():
        import torch.distributed as dist

        if dist.get_rank() == 1:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGSEGV)
        dist.all_reduce(torch.ones(1))

    with pytest.raises(ddplab.RankDied) as info:
        cluster.run(segfault_on_1)
    msg = str(info.value)
    assert msg.splitlines()[0].startswith("rank 1 died: the rank process ended with signal SIGSEGV")
    assert "Traceback (most recent call last):\nRankDied" not in msg
    assert cluster.run(_reduce, 1) == [2.0, 2.0]


def test_a_return_value_that_cannot_be_pickled_says_so(cluster):
    old = cluster.pids

    def make_lock():
        return threading.Lock()

    with pytest.raises(ddplab.RankError) as info:
        cluster.run(make_lock)
    head = str(info.value).splitlines()[0]
    assert "the return value of" in head and "make_lock could not be pickled" in head
    assert cluster.pids == old  # the job itself ran fine: the ranks are kept


@pytest.mark.slow
def test_a_failed_replacement_does_not_hide_the_learners_error(cluster, monkeypatch):
    from ddplab.cluster import lifecycle

    def broken_start(name):
        if name == "start:spawned":
            raise OSError("no more processes (simulated)")

    def fail_on_1():
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("the learner's own mistake")
        dist.all_reduce(torch.ones(1))

    others = rank_children() - set(cluster.pids)  # the session's other clusters' ranks
    monkeypatch.setattr(lifecycle, "_test_hook", broken_start)
    with pytest.raises(ddplab.RankError) as info:
        cluster.run(fail_on_1)
    monkeypatch.setattr(lifecycle, "_test_hook", None)
    msg = str(info.value)
    assert msg.splitlines()[0] == "rank 1 raised ValueError: the learner's own mistake"
    assert "Replacing the ranks failed (OSError: no more processes (simulated))" in msg
    assert cluster.run(_reduce, 1) == [2.0, 2.0]  # the next call starts ranks again
    expected = others | set(cluster.pids)  # the failed replacement left no rank behind
    assert wait_rank_children(expected) == expected


# -- 7. garbage collection and the --ranks filter ----------------------------------------------
@pytest.mark.slow
def test_garbage_collection_kills_ranks_without_a_slow_shutdown(capsys):
    c = ddplab.Cluster(2, timeout=20)
    pids = c.pids
    os.kill(pids[1], signal.SIGSTOP)  # a rank that would never answer a clean shutdown
    t0 = time.monotonic()
    del c  # (a clean shutdown would wait 5 s for the stopped rank)
    gc.collect()
    assert time.monotonic() - t0 < 3.0
    assert wait_gone(pids, timeout=30)
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_the_ranks_filter_of_one_job_does_not_hide_later_messages(capsys):
    def late_print_on_1():
        import threading

        import torch.distributed as dist

        if dist.get_rank() == 1:
            threading.Timer(0.5, lambda: print("late from rank 1", flush=True)).start()
        print("now")

    c = ddplab.Cluster(2, timeout=20)
    c.run_job(late_print_on_1, show_ranks=[0])
    time.sleep(1.5)
    c.shutdown()
    out = capsys.readouterr().out
    assert "[rank 0] now" in out and "[rank 1] now" not in out
    assert "[rank 1] late from rank 1" in out


def test_collective_timeouts_are_recognised_by_type_and_state_not_by_wording():
    from ddplab.cluster import diagnosis as d

    # gloo raises a plain RuntimeError at its timeout, worded as it likes.
    gloo = {"type": "RuntimeError", "message": "Application timeout caused pair closure",
            "runtime_error": True, "elapsed": 3.1}
    assert d.is_collective_timeout(gloo, 3.0, "gloo", in_step=False)
    assert not d.is_collective_timeout(gloo, 3.0, "gloo", in_step=True)  # collectives lined up
    assert not d.is_collective_timeout(dict(gloo, elapsed=0.2), 3.0, "gloo", in_step=False)
    learner = {"type": "ValueError", "message": "the loader timed out", "elapsed": 10.0}
    assert not d.is_collective_timeout(learner, 3.0, "gloo", in_step=False)
    # NCCL's watchdog aborts the rank (SIGABRT) once a collective outlives the timeout.
    # (Needs two GPUs to happen for real; not run on the machines this was written on.)
    watchdog = d.died_info(-signal.SIGABRT, elapsed=61.0)
    assert d.is_collective_timeout(watchdog, 60.0, "cpu:gloo,cuda:nccl", in_step=False)
    assert not d.is_collective_timeout(watchdog, 60.0, "gloo", in_step=False)
    assert not d.is_collective_timeout(d.died_info(-signal.SIGABRT, 5.0), 60.0, "nccl", False)
    nccl = {"type": "torch.distributed.DistBackendError", "dist_error": True, "elapsed": 60.5}
    assert d.is_collective_timeout(nccl, 60.0, "nccl", in_step=False)


def test_the_root_cause_comes_first():
    from ddplab.cluster import diagnosis as d

    failures = {0: {"type": "RuntimeError", "message": "Connection closed by peer",
                    "runtime_error": True, "elapsed": 0.4},
                1: d.died_info(-signal.SIGSEGV, elapsed=0.5)}
    assert d.root_cause_order(failures) == [1, 0]
    assert d.headline(failures).startswith("rank 1 died: the rank process ended with signal SIGSEGV")
    own = {0: {"type": "RuntimeError", "message": "Connection reset", "runtime_error": True,
               "elapsed": 0.9},
           1: {"type": "ValueError", "message": "bad batch", "elapsed": 0.1}}
    assert d.headline(own).startswith("rank 1 raised ValueError: bad batch")
