"""Any number of Interrupts at any moment leave a usable cluster and no leaked rank.

Jupyter's Interrupt is SIGINT to the kernel. Instead of hoping a timer lands
inside the right few milliseconds, each test arms the Cluster's test hook
(``ddplab.cluster.lifecycle.interruption_point``) to send SIGINT to this process at named
moments inside start, run and replacement, so every race happens on every run.
Points in the main thread raise KeyboardInterrupt right there; points on the
spawner thread interrupt the main thread while it waits for that operation.
"""
from __future__ import annotations

import os
import signal

import pytest
from _procs import rank_children, wait_gone, wait_rank_children

import ddplab
from ddplab.cluster import lifecycle

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test


@pytest.fixture(scope="module")
def cluster():
    before = rank_children()
    c = ddplab.Cluster(2, timeout=20)
    yield c, before
    c.shutdown()


@pytest.fixture
def interrupt_at(monkeypatch):
    """``interrupt_at("run:collecting", "replace:waiting")``: SIGINT at each of
    those points, in that order, once each."""
    # Jupyter's kernel turns SIGINT into KeyboardInterrupt; make sure this process does too
    # (a shell that starts pytest in the background sets SIGINT to be ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def arm(*names):
        todo = list(names)

        def hook(name):
            if todo and name == todo[0]:
                todo.pop(0)
                os.kill(os.getpid(), signal.SIGINT)

        monkeypatch.setattr(lifecycle, "_test_hook", hook)
        return todo

    yield arm
    monkeypatch.setattr(lifecycle, "_test_hook", None)
    # Let operations this test left running (an abandoned start, a replacement) end here,
    # under no hook, rather than inside the next test.
    lifecycle.spawner.submit(lambda: None).wait()
    signal.signal(signal.SIGINT, previous)


def _reduce_rank_plus_one():
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _long():
    import time

    import torch
    import torch.distributed as dist

    # Ends by itself (>= 60 s): a test whose Interrupt went astray fails, never hangs. A count,
    # not a deadline, so both ranks issue the same number of all-reduces.
    for _ in range(6000):
        dist.all_reduce(torch.ones(1))
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("points", [("start:waiting",), ("start:spawned",)])
def test_interrupt_while_the_cluster_starts_leaks_no_rank(interrupt_at, points):
    before = rank_children()
    todo = interrupt_at(*points)
    with pytest.raises(KeyboardInterrupt):
        ddplab.Cluster(2, timeout=20)
    assert not todo, "the interrupt was not delivered where the test meant"
    assert wait_rank_children(before, timeout=60) == before


@pytest.mark.slow
@pytest.mark.parametrize("points", [
    ("run:sent",),                                     # rank 0 has the job, rank 1 not yet
    ("run:collecting",),                               # while the job runs
    ("run:collected",),                                # the answers are in, not yet returned
    ("run:collecting", "replace:waiting"),             # a second Interrupt during the replacement
    ("run:collecting", "replace:stopped"),             # ... between stopping and starting ranks
    ("run:collecting", "replace:waiting", "ready:waiting"),  # and a third in the next call
])
def test_interrupts_anywhere_in_a_job_leave_a_usable_cluster(cluster, interrupt_at, points):
    c, before = cluster
    old = c.pids
    todo = interrupt_at(*points)
    job = _reduce_rank_plus_one if points == ("run:collected",) else _long
    with pytest.raises(KeyboardInterrupt):
        c.run(job)
    while todo:  # the remaining points are reached by the next calls
        with pytest.raises(KeyboardInterrupt):
            c.run(_reduce_rank_plus_one)
    assert c.run(_reduce_rank_plus_one) == [3.0, 3.0]
    assert wait_gone(old, timeout=60), "the interrupted job's ranks must be gone"
    assert wait_rank_children(before | set(c.pids), timeout=60) == before | set(c.pids), "a rank leaked"


@pytest.mark.slow
def test_after_every_interrupt_shutdown_leaves_nothing(cluster):
    c, before = cluster
    c.shutdown()
    assert wait_rank_children(before, timeout=60) == before
