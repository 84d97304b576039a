"""A classroom day in a few minutes: 1,000 jobs, replacements of every kind, a compare().

After each stage the kernel (this test process) must hold no more threads, file
descriptors, rank processes or memory than after the warm-up: a leak of one fd
or one thread per replacement would show here long before a learner's kernel
runs out of them.

The unit suite runs 1,000 jobs and one replacement of each kind (a raise, a
JobTimeout, an Interrupt), to stay inside its time budget; ``DDPLAB_SOAK=1``
runs 7 of each (21 replacements; about 1 minute on a quiet 2-core machine):

    DDPLAB_SOAK=1 .venv/bin/python -m pytest -q tests/cluster/test_cluster_soak.py
"""
from __future__ import annotations

import os
import signal

import pytest
from _procs import fds, rank_children, rss_mb, threads, wait_rank_children

import ddplab
from ddplab.cluster import lifecycle

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

PER_KIND = 7 if os.environ.get("DDPLAB_SOAK") == "1" else 1
JOBS = 1000
RSS_SLACK_MB = 40  # allocator noise; a leak per job or per replacement grows far past it


def _reduce(x):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(x)])
    dist.all_reduce(t)
    return t.item()


def _out_of_step():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)
    raise ValueError("planted")


def _sleep():
    import time

    time.sleep(60)


def _interrupt_at(name):
    def hook(point):
        if point == name:
            lifecycle._test_hook = None
            os.kill(os.getpid(), signal.SIGINT)

    return hook


def _replace_once(c, kind) -> None:
    old = c.pids
    if kind == "raise":
        with pytest.raises(ddplab.RankError):
            c.run(_out_of_step)
    elif kind == "job_timeout":
        with pytest.raises(ddplab.JobTimeout):
            c.run_job(_sleep, job_timeout=0.3)
    else:
        # As in Jupyter, SIGINT must raise KeyboardInterrupt (a shell starting this in the
        # background may have set it to be ignored).
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        lifecycle._test_hook = _interrupt_at("run:collecting")
        try:
            with pytest.raises(KeyboardInterrupt):
                c.run(_sleep)
        finally:
            lifecycle._test_hook = None
            signal.signal(signal.SIGINT, previous)
    assert c.pids != old and c.run(_reduce, 1) == [2.0, 2.0]


def _compare(c):
    from ddplab.measure import compare

    result = compare(c, strategies=("manual", "bucketed"), steps=2, warmup=1, n_params=2e5,
                     link="10gbe")
    assert result is not None


def _usage(c) -> dict:
    return {"threads": threads(), "fds": fds(), "ranks": rank_children(), "rss": rss_mb(),
            "pids": set(c.pids)}


def _check(stage: str, base: dict, c) -> None:
    now = _usage(c)
    assert now["threads"] <= base["threads"], f"{stage}: threads grew {base['threads']} -> {now['threads']}"
    assert now["fds"] <= base["fds"], f"{stage}: file descriptors grew {base['fds']} -> {now['fds']}"
    mine = now["ranks"] - base["others"]  # other clusters the test session keeps are not counted
    assert mine == now["pids"], f"{stage}: rank processes {mine} != the cluster's {now['pids']}"
    assert now["rss"] <= base["rss"] + RSS_SLACK_MB, f"{stage}: memory grew {base['rss']:.0f} -> {now['rss']:.0f} MB"


@pytest.mark.slow
def test_a_classroom_day_leaks_nothing(capsys):
    before = rank_children()
    c = ddplab.Cluster(2, timeout=20)
    try:
        # Warm-up: every path once, so lazy imports and caches are in the baseline.
        _replace_once(c, "job_timeout")  # stacks, notes, a new generation
        _compare(c)
        for i in range(20):
            c.run(_reduce, i)
        base = dict(_usage(c), others=before)

        for i in range(JOBS):
            expected = float(2 * i)
            assert c.run(_reduce, i) == [expected, expected]
        _check(f"{JOBS} jobs", base, c)

        replaced = 0
        for kind in ("raise", "job_timeout", "interrupt"):
            for _ in range(PER_KIND):
                _replace_once(c, kind)
                replaced += 1
            _check(f"{PER_KIND} replacements by {kind}", base, c)
            capsys.readouterr()  # the notes and stacks: keep the captured text small

        _compare(c)
        _check("compare() with a simulated link", base, c)
        assert replaced == 3 * PER_KIND
    finally:
        c.shutdown()
    assert wait_rank_children(before) == before
