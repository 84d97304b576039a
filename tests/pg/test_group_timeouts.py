"""Start-up and collectives have their own limits under the observing group.

A rank that is late to start (CUDA and NCCL initialisation differ by seconds between
ranks) must not fail a short collective timeout, while a collective that a peer never
calls still fails after that short timeout, as the graders' ``Stalled`` with its words.
The late rank is made late on purpose: a ``sitecustomize`` module (imported by every
Python process at start) wraps ``backend.init_group`` on the ranks. The early rank
leaves a mark just before it joins; the late rank waits for that mark, then 4 s more,
so the skew is at least 4 s however loaded the machine is.
"""
from __future__ import annotations

import datetime
import textwrap

import pytest

import ddplab
from ddplab.cluster.errors import RankError
from ddplab.pg.inner import START_UP_S, startup_timeout

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

LATE = textwrap.dedent("""
    import json, os, time
    cfg = os.environ.get("DDPLAB_WORKER")
    mark = os.environ.get("LATE_TEST_MARK")
    if cfg and mark:
        import ddplab.pg.backend as backend
        rank, real = json.loads(cfg)["rank"], backend.init_group

        def init_group(*args, **kwargs):
            if rank == 0:
                open(mark, "w").close()  # rank 0 joins now
            else:
                while not os.path.exists(mark):
                    time.sleep(0.05)
                time.sleep(float(os.environ["LATE_TEST_S"]))
            return real(*args, **kwargs)

        backend.init_group = init_group
""")


def test_startup_limit_is_the_collective_timeout_or_longer():
    assert startup_timeout(3.0) == datetime.timedelta(seconds=START_UP_S)
    assert startup_timeout(datetime.timedelta(minutes=30)) == datetime.timedelta(minutes=30)
    assert startup_timeout(None) == datetime.timedelta(seconds=START_UP_S)


def skip_a_collective():
    """Rank 0 all-reduces under a grader's watch with no limit of its own; rank 1 skips it."""
    import time

    import torch
    import torch.distributed as dist

    from ddplab.checks.watch import Stalled, Watch

    if dist.get_rank() == 1:
        return None
    watch = Watch(torch.nn.Linear(2, 2), hang_s=None)  # the group's own timeout applies
    t0 = time.monotonic()
    try:
        with watch.installed():
            dist.all_reduce(torch.ones(3))
    except Stalled as stalled:
        return {"stalled": str(stalled), "after_s": time.monotonic() - t0}
    return {"stalled": None, "after_s": time.monotonic() - t0}


def recv_from_nobody():
    """Rank 0 waits for a message rank 1 never sends: how long until gloo gives up?"""
    import time

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        return None
    t0 = time.monotonic()
    try:
        dist.recv(torch.empty(3), 1)
    except RuntimeError as err:
        return {"error": str(err), "after_s": time.monotonic() - t0}
    return {"error": None, "after_s": time.monotonic() - t0}


@pytest.mark.slow
def test_a_late_rank_starts_and_a_skipped_collective_stalls_after_the_short_timeout(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(LATE)
    env = {"PYTHONPATH": str(tmp_path), "LATE_TEST_MARK": str(tmp_path / "rank0-joining"),
           "LATE_TEST_S": "4"}
    with ddplab.Cluster(2, backend="gloo", timeout=3.0, env=env) as cluster:
        # the late rank was 4 s behind: more than the 3 s collective timeout
        assert cluster.run(lambda: __import__("torch.distributed").distributed.get_world_size()) == [2, 2]
        assert (tmp_path / "rank0-joining").exists()
        try:
            result = cluster.run(skip_a_collective)[0]
        except RankError as err:  # the ranks disagree on collectives issued: replaced
            pytest.fail(f"the skipped collective should end inside the job: {err}")
        # gloo's recv reads its limit from the pairs (connected under the start-up limit):
        # the observing group gives each wait the collective timeout itself. (Fresh ranks
        # first: the timed-out pair is closed.)
        cluster.ensure_ready(stale="rank 0 timed out")
        lonely = cluster.run(recv_from_nobody)[0]
    assert result["stalled"] is not None, "the all-reduce whose peer never came returned"
    assert result["stalled"].startswith("rank 0 timed out: was waiting for all_reduce on "
                                        "a tensor of 3 elements")
    # the Cluster's 3 s, not the 60 s start-up limit nor torch's 30 min default
    assert 2.5 <= result["after_s"] < 20, result
    assert "Timed out waiting 3000ms for recv" in lonely["error"] and lonely["after_s"] < 20, lonely


def test_the_nccl_half_gets_the_collective_timeout_and_groups_its_point_to_point():
    """The observing group as an NCCL rank builds it, on one CPU process, NCCL faked."""
    import torch.distributed as dist
    from _fake_nccl import FakeNCCL, installed

    from ddplab.pg.group import ObservingGroup
    from ddplab.pg.p2p_blocks import CoalescedP2P

    with installed():
        group = ObservingGroup(dist.HashStore(), 0, 1, datetime.timedelta(seconds=3),
                              "cpu:gloo,cuda:nccl")
        group.shutdown()
    assert isinstance(group.cuda, FakeNCCL) and group.getBackendName() == "ddplab_nccl"
    assert group.cuda.options._timeout == datetime.timedelta(seconds=3)  # the watchdog's limit
    assert isinstance(group.p2p, CoalescedP2P) and group.p2p.backend is group.cuda
    gloo_only = ObservingGroup(dist.HashStore(), 0, 1, datetime.timedelta(seconds=3), "gloo")
    assert gloo_only.cuda is None and gloo_only.p2p is None
