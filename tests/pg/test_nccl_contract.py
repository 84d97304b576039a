"""The observing group over NCCL, as ProcessGroupNCCL behaves, on CPU (tests/_fake_nccl.py).

Two ranks are two threads of this process sharing a HashStore (NCCL's group depth is
per thread, as on two processes). First the fake is held to the contract it stands for;
then each divergence of the observing group from NCCL's meaning gets a test that fails
without its fix (docs/gpu.md lists them).
"""
from __future__ import annotations

import datetime
import os
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from _fake_nccl import FakeNCCL, installed
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

LIMIT = datetime.timedelta(seconds=5)


def two_ranks(fn, device_count=2, gpu=0, join_s=30.0):
    """``fn(rank, store)`` on two threads under the fake NCCL; their results (errors re-raised)."""
    store, out, errors = dist.HashStore(), {}, {}

    def run(rank):
        try:
            out[rank] = fn(rank, store)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors[rank] = exc

    with installed(device_count=device_count, gpu=gpu):
        threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(join_s)
        assert not any(t.is_alive() for t in threads), "a rank thread hung"
    if errors:
        raise next(iter(errors.values()))
    return [out[0], out[1]]


def observed_group(rank, store, prefix="g/", timeout=LIMIT):
    from ddplab.pg.group import ObservingGroup

    return ObservingGroup(dist.PrefixStore(prefix, store), rank, 2, timeout, "cpu:gloo,cuda:nccl")


def blocking(opts_cls, **fields):
    opts = opts_cls()
    opts.asyncOp = False
    for k, v in fields.items():
        setattr(opts, k, v)
    return opts


# -- the fake keeps NCCL's contract --------------------------------------------------------------
def _kinds(rank, store):
    pg = FakeNCCL(store, rank, 2, FakeNCCL.Options())
    t, out = torch.ones(4) * (rank + 1), torch.zeros(8)
    got = {
        "allreduce": pg.allreduce([t], blocking(AllreduceOptions)),
        "broadcast": pg.broadcast([t], blocking(BroadcastOptions)),
        "allgather": pg.allgather([[torch.zeros(4), torch.zeros(4)]], [t], blocking(AllgatherOptions)),
        "_allgather_base": pg._allgather_base(out, t, blocking(AllgatherOptions)),
        "_reduce_scatter_base": pg._reduce_scatter_base(torch.zeros(2), t, blocking(ReduceScatterOptions)),
        "barrier": pg.barrier(blocking(BarrierOptions)),
    }
    asynchronous = AllreduceOptions()
    asynchronous.asyncOp = True
    work = pg.allreduce([t], asynchronous)
    work.wait()
    return got, work, t.tolist()


def test_the_fake_returns_no_work_for_every_blocking_kind_and_a_work_when_asked():
    for got, work, value in two_ranks(_kinds):
        assert all(w is None for w in got.values()), got
        assert work is not None and value == [6.0] * 4  # 3 after the blocking one, then doubled
        with pytest.raises(NotImplementedError, match="isSuccess"):
            work.is_success()


def _enqueue(rank, store):
    pg = FakeNCCL(store, rank, 2, FakeNCCL.Options())
    pg.eager_connect_single_device(torch.device("cuda", 0))
    opts = AllreduceOptions()
    opts.asyncOp = True
    if rank == 1:
        time.sleep(0.5)  # rank 0's op cannot have ended yet
    work = pg.allreduce([torch.ones(2)], opts)
    seen = (work.get_future().done(), work.is_completed())
    work.wait()
    return seen, work.is_completed()


def test_the_fakes_future_is_complete_at_enqueue_before_the_transfer_ends():
    (seen0, done0), _ = two_ranks(_enqueue)
    assert seen0 == (True, False) and done0


def _timeout(rank, store):
    pg = FakeNCCL(store, rank, 2, FakeNCCL.Options())
    pg.eager_connect_single_device(torch.device("cuda", 0))
    if rank == 1:
        return None  # never joins
    opts = AllreduceOptions()
    opts.asyncOp = True
    work = pg.allreduce([torch.ones(2)], opts)
    try:
        work.wait(datetime.timedelta(seconds=0.3))
    except dist.DistBackendError as exc:
        with pytest.raises(dist.DistBackendError):  # the communicator was aborted
            pg.allreduce([torch.ones(2)], opts)
        return str(exc)


def test_the_fakes_capped_wait_raises_nccls_own_words():
    text, _ = two_ranks(_timeout)
    assert "WorkNCCL(SeqNum=1, OpType=ALLREDUCE" in text and "milliseconds before timing out" in text
    assert "imed out" not in text  # which is why ddplab must know NCCL's words


def _depth(rank, store):
    a = FakeNCCL(dist.PrefixStore("a/", store), rank, 2, FakeNCCL.Options())
    b = FakeNCCL(dist.PrefixStore("b/", store), rank, 2, FakeNCCL.Options())
    a.eager_connect_single_device(torch.device("cuda", 0))
    b.eager_connect_single_device(torch.device("cuda", 0))
    a._start_coalescing()
    a.send([torch.ones(1)], 1 - rank, 0) if rank == 0 else a.recv([torch.zeros(1)], 1 - rank, 0)
    b.allreduce([torch.ones(1)], blocking(AllreduceOptions))  # joins a's group: returns None
    swallowed = ("allreduce", rank) in FakeNCCL.swallowed
    block = a._end_coalescing()
    return swallowed, block.get_future().value(), block.result()


def test_the_fakes_group_depth_is_one_per_thread_across_instances():
    for swallowed, value, result in two_ranks(_depth):
        assert swallowed  # b's all-reduce joined the group a opened on this thread
        assert value == [] and result == []  # a coalesced block's future holds no tensors


def _guess(rank, store):
    pg = FakeNCCL(store, rank, 2, FakeNCCL.Options())
    pg.barrier(blocking(BarrierOptions, device=torch.device("cpu")))
    return pg.barrier_devices


def test_the_fakes_barrier_ignores_opts_device_and_guesses():
    assert two_ranks(_guess, device_count=4) == [[torch.device("cuda", 0)], [torch.device("cuda", 1)]]


# -- Deliver 1: a blocking call waits on a real work ------------------------------------------
class Noting:
    """An observer noting launches, waits and failures (``timeout``: its wait limit)."""

    def __init__(self, timeout=None):
        self.timeout, self.ops, self.waits, self.failures = timeout, [], [], []

    def launched(self, op, tensors, group, peer):
        self.ops.append(op)
        return len(self.ops) - 1

    def started(self, token, work):
        return None

    def waiting(self, token):
        self.waits.append(token)

    def future_taken(self, token):
        pass

    def failed(self, token, exc):
        self.failures.append(str(exc))


def _blocking_calls():
    """World size 1 through ``dist.*``: c10d skips the wait when a group answers None."""
    from ddplab.pg.group import observe, register

    register()
    dist.init_process_group("ddplab_nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=LIMIT)
    try:
        pg = dist.distributed_c10d._get_default_group()
        with observe(Noting(timeout=5.0)) as seen:
            t = torch.ones(3)
            dist.all_reduce(t)
            dist.broadcast(t, 0)
            dist.barrier()
        return seen, pg.cuda, t.tolist()
    finally:
        dist.destroy_process_group()


def test_a_blocking_call_on_nccl_waits_on_a_real_work_under_the_observers():
    with installed():
        seen, nccl, value = _blocking_calls()
    assert seen.ops == ["all_reduce", "broadcast", "barrier"] and seen.waits == [0, 1, 2]
    # forwarded with asyncOp=True: NCCL gave a work, and the wait (capped) was on it
    assert nccl.ops == [("allreduce", False), ("broadcast", False), ("barrier", False)]
    assert value == [1.0, 1.0, 1.0]
    # divergence 8: destroy_process_group reached the NCCL half
    assert nccl.shut


# -- divergence 1: a hang on CUDA tensors comes back as HUNG -------------------------------------
def _hung(rank, store):
    from ddplab.checks.watch import Stalled, Watch

    g = observed_group(rank, store)
    if rank == 1:
        return None  # never joins the all-reduce
    watch = Watch.__new__(Watch)  # the grader's observer, without a model
    watch.__dict__.update(rank=0, hang_s=0.5, recorder=None, named=[], events=[], step=1,
                          phase="forward", backwards=0, _in_backward=False, _seq=0,
                          _launches_in_step=0, _last_hook_t=None)
    t0 = time.monotonic()
    with g.observe(watch):
        try:
            g.allreduce([torch.ones(3)], blocking(AllreduceOptions)).wait()  # dist.all_reduce
        except Stalled as exc:
            return str(exc), time.monotonic() - t0
    return "no stall", time.monotonic() - t0


def test_a_hang_on_cuda_tensors_is_named_by_the_grader_within_its_limit():
    (text, took), _ = two_ranks(_hung)
    assert text.startswith("rank 0 timed out: was waiting for all_reduce on a tensor of 3 elements")
    assert 0.4 < took < 5


def test_nccls_timeout_text_counts_as_timed_out_for_the_ring_and_the_grader():
    from ddplab.pg.inner import timed_out
    from ddplab.pg.p2p_watch import P2PStalled, P2PWatch

    nccl = dist.DistBackendError("[PG ID 0 PG GUID 0 Rank 0] Watchdog caught collective operation "
                                 "timeout: WorkNCCL(SeqNum=3, OpType=SEND, Timeout(ms)=500) ran for "
                                 "512 milliseconds before timing out.")
    assert timed_out(nccl) and timed_out(RuntimeError("[../gloo/transport/tcp/pair.cc] Timed out"))
    assert not timed_out(RuntimeError("Connection closed by peer"))
    watch = P2PWatch.__new__(P2PWatch)
    watch.timeout = 0.5
    with pytest.raises(P2PStalled):
        watch.failed({"op": "send", "peer": 1}, nccl)


# -- divergence 2: the ranks' NCCL environment is pinned ----------------------------------------
def test_the_nccl_half_is_made_with_the_error_handling_pinned(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "3")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)

    def make(rank, store):
        return observed_group(rank, store).cuda.env

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        envs = two_ranks(make)
    for env in envs:  # what ProcessGroupNCCL read when it was made
        assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "0"}
    assert "NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    assert any("pins NCCL's error handling" in str(w.message) for w in caught)


# -- divergence 3: a host stamp of an NCCL future is "enqueued", not "done" ----------------------
def test_the_graders_recording_stamps_a_device_ops_future_as_enqueued():
    from ddplab.checks.watch import Watch
    from ddplab.timeline.recorder import Recorder

    class Done:  # a work whose future is complete (as NCCL's is at enqueue)
        def get_future(self):
            f = torch.futures.Future()
            f.set_result([])
            return f

    ends = {}
    for device in ("cpu", "cuda"):
        rec = Recorder("yours", 0, 2)
        rec.begin_iteration(0)
        watch = Watch.__new__(Watch)
        watch.__dict__.update(recorder=rec, _launches_in_step=0, _last_hook_t=None)
        watch._record({"phase_": "after backward", "param": None, "numel": 4, "op": "all_reduce",
                       "kind": "own", "nbytes": 16, "device": device}, Done())
        rec.end_iteration()
        ends[device] = [b.comm_end for b in rec.result().buckets]
    assert ends["cpu"][0] is not None  # gloo: the future completes when the transfer did
    assert ends["cuda"] == [None]  # NCCL: no transfer end is claimed from a host callback


# -- divergence 4: barrier on the rank's GPU ------------------------------------------------------
def _barrier(rank, store):
    g = observed_group(rank, store)
    g.barrier(blocking(BarrierOptions, device=torch.device("cpu"))).wait()  # as dist.barrier
    return g.cuda.barrier_devices, g.cuda.barrier_reasons


def test_a_barrier_runs_on_the_ranks_gpu_not_on_a_guessed_one():
    for devices, reasons in two_ranks(_barrier, device_count=4, gpu=3):
        assert devices == [torch.device("cuda", 3)] and reasons == ["device_ids"]


# -- divergence 5: no rank kept with unfinished NCCL work ---------------------------------------
def _unfinished(rank, store):
    from ddplab.pg import group

    g = observed_group(rank, store)
    if rank == 1:
        time.sleep(1.0)
        g.allreduce([torch.ones(1)], blocking(AllreduceOptions)).wait()
        return None
    opts = AllreduceOptions()
    opts.asyncOp = True
    work = g.allreduce([torch.ones(1)], opts)  # rank 1 joins only later
    pending = g.unfinished(grace_s=0.1), group.unfinished_device_work(grace_s=0.1)
    work.wait()
    return pending, g.unfinished(grace_s=0.1), group.unfinished_device_work(grace_s=0.1)


def test_a_rank_with_unfinished_nccl_work_is_not_kept():
    from ddplab.cluster import diagnosis
    from ddplab.pg.group import UNFINISHED_GPU_WORK

    ((pending, state), after, state_after), _ = two_ranks(_unfinished)
    assert pending == 1 and state == {UNFINISHED_GPU_WORK: (1,)}  # worker.group_state's entry
    assert after == 0 and state_after == {}
    groups = {0: {"default": (4,), UNFINISHED_GPU_WORK: (1,)}, 1: {"default": (4,)}}
    reason = diagnosis.replace_reason({1: {"type": "ValueError"}}, set(), groups, [])
    assert reason and "had not finished on the GPU" in reason


# -- divergence 6: the open send/recv block stays within its exchange -----------------------------
def _other_group_inside_block(rank, store):
    a, b = observed_group(rank, store, "a/"), observed_group(rank, store, "b/")
    peer = 1 - rank
    posted = a.send([torch.ones(2)], peer, 0) if rank == 0 else a.recv([torch.zeros(2)], peer, 0)
    b.allreduce([torch.ones(1)], blocking(AllreduceOptions)).wait()  # another group's op
    posted.wait()
    return list(FakeNCCL.swallowed)


def test_an_op_on_another_group_is_not_swallowed_into_an_open_block():
    assert two_ranks(_other_group_inside_block) == [[], []]


def _stall_in_waiting(rank, store):
    from ddplab.pg import p2p_blocks

    class Refuses(Noting):
        def waiting(self, token):
            raise RuntimeError("no partner came")

    g = observed_group(rank, store)
    peer = 1 - rank
    with g.observe(Refuses()):
        posted = g.send([torch.ones(2)], peer, 0) if rank == 0 else g.recv([torch.zeros(2)], peer, 0)
        with pytest.raises(RuntimeError, match="no partner"):
            posted.wait()
    left_open = len(p2p_blocks.open_blocks())
    later = g.allreduce([torch.ones(1)], blocking(AllreduceOptions))
    later.wait()
    return left_open, list(FakeNCCL.swallowed)


def test_a_stall_found_while_waiting_closes_the_block():
    assert two_ranks(_stall_in_waiting) == [(0, []), (0, [])]


def _other_thread(rank, store):
    g = observed_group(rank, store)
    peer = 1 - rank
    posted = g.send([torch.ones(2)], peer, 0) if rank == 0 else g.recv([torch.zeros(2)], peer, 0)
    caught = []
    waiter = threading.Thread(target=lambda: caught.append(_raises(posted.wait)))
    waiter.start()
    waiter.join()
    posted.wait()
    return caught[0]


def _raises(fn):
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_a_wait_from_another_thread_is_refused_in_words():
    for text in two_ranks(_other_thread):
        assert text and "wait in the thread that posted them" in text


def _group_made_inside_block(rank, store):
    a = observed_group(rank, store, "a/")
    peer = 1 - rank
    posted = a.send([torch.ones(2)], peer, 0) if rank == 0 else a.recv([torch.zeros(2)], peer, 0)
    observed_group(rank, store, "late/")  # e.g. a grader's new_group
    posted.wait()
    return FakeNCCL.groups_ended_by_connect


def test_a_group_made_while_a_block_is_open_does_not_end_it_behind_our_back():
    assert two_ranks(_group_made_inside_block) == [0, 0]


# -- divergence 7: each group connects when it is made ---------------------------------------------
def test_the_nccl_half_connects_eagerly_on_the_ranks_gpu():
    def make(rank, store):
        g = observed_group(rank, store)
        return g.cuda.connected, g.cuda.used_device

    assert two_ranks(make, gpu=1) == [("eager", torch.device("cuda", 1))] * 2


# -- divergence 8: shutdown reaches the NCCL half ---------------------------------------------------
def test_shutdown_is_forwarded_to_the_nccl_half():
    def make(rank, store):
        g = observed_group(rank, store)
        g.shutdown()
        return g.cuda.shut

    assert two_ranks(make) == [True, True]


# -- divergence 9: an isend's future holds its tensor, as a lone NCCL send's does ----------------
def _futures(rank, store):
    g = observed_group(rank, store)
    peer = 1 - rank
    t = torch.ones(2) if rank == 0 else torch.zeros(2)
    posted = g.send([t], peer, 0) if rank == 0 else g.recv([t], peer, 0)
    value = posted.get_future().wait()
    posted.wait()  # the fake's host is its device: read after the wait (on a GPU, stream order)
    return [x is t for x in value], [x is t for x in posted.result()], t.tolist()


def test_a_posted_sends_future_and_result_hold_its_tensor():
    assert two_ranks(_futures) == [([True], [True], [1.0, 1.0])] * 2


def test_the_fake_devices_nccl_work_blocks_the_host_only_under_a_limit():
    from _fake_cuda import Clock, Device, NcclWork

    dev = Device(Clock())
    NcclWork(dev, end=2.0).wait()  # a stream wait: the host goes on
    assert dev.clock() == 0.0 and dev.main.busy_until == 2.0
    NcclWork(dev, end=3.0).wait(datetime.timedelta(seconds=5))  # the host waits for the end
    assert dev.clock() == 3.0
    with pytest.raises(dist.DistBackendError, match="ran for 1000 milliseconds before timing out"):
        NcclWork(dev, end=10.0).wait(datetime.timedelta(seconds=1))
    work = NcclWork(dev, end=60.0)
    assert work.get_future().done() and not work.is_completed()  # complete at enqueue
