"""The observing process group sees every collective, however it is called, and counts as gloo does."""
import sys

import cloudpickle
import pytest

from ddplab.cluster.cluster import Cluster
from ddplab.cluster.errors import RankError

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster():
    with Cluster(2, timeout=30) as c:
        yield c


class Noting:
    """An observer that lists (op, numels, peer) and the waits on each op."""

    timeout = None

    def __init__(self):
        self.ops, self.waits, self.futures = [], [], []

    def launched(self, op, tensors, group, peer):
        self.ops.append((op, tuple(t.numel() for t in tensors), peer))
        return len(self.ops) - 1

    def started(self, token, work):
        return None

    def waiting(self, token):
        self.waits.append(token)

    def future_taken(self, token):
        self.futures.append(token)

    def failed(self, token, exc):
        pass


def _spellings():
    import torch
    import torch.distributed as dist
    from torch.distributed import all_reduce, distributed_c10d

    from ddplab.pg.group import observe

    peer = 1 - dist.get_rank()
    with observe(Noting()) as seen:
        t = torch.ones(2)
        all_reduce(t)                                   # imported before anyone could patch it
        distributed_c10d.all_reduce(torch.ones(3))
        dist.all_reduce(torch.ones(4), async_op=True).wait()
        dist.all_reduce(torch.ones(5), async_op=True).get_future().wait()
        out = torch.zeros(2)
        ops = [dist.P2POp(dist.isend, torch.ones(6), peer), dist.P2POp(dist.irecv, torch.zeros(6), peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        if dist.get_rank() == 0:
            dist.send(torch.ones(7), 1)
        else:
            dist.recv(torch.zeros(7), 0)
        dist.all_gather_into_tensor(torch.zeros(4), out)
    return seen.ops, seen.waits, seen.futures, float(t[0])


def test_every_spelling_is_seen(cluster):
    for rank, (ops, waits, futures, value) in enumerate(cluster.run(_spellings)):
        assert value == 2.0  # the ops still run: the sum over two ranks
        peer = 1 - rank
        p2p = "send" if rank == 0 else "recv"
        assert ops == [("all_reduce", (2,), None), ("all_reduce", (3,), None),
                       ("all_reduce", (4,), None), ("all_reduce", (5,), None),
                       ("send", (6,), peer), ("recv", (6,), peer), (p2p, (7,), peer),
                       ("all_gather_into_tensor", (2,), None)]
        assert {0, 1, 2, 4, 5, 6, 7} <= set(waits) and 3 not in waits  # op 3 waited through its future
        assert 3 in futures


def _same_work(group):
    import torch
    import torch.distributed as dist

    peer = 1 - dist.get_rank()
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    dist.broadcast(t, 0, group=group)
    dist.barrier(group=group)
    dist.all_gather([torch.zeros(3), torch.zeros(3)], t, group=group)
    dist.reduce(t, 0, group=group)
    dist.all_reduce(t, group=group, async_op=True).wait()
    ops = [dist.P2POp(dist.isend, t, peer, group), dist.P2POp(dist.irecv, torch.zeros(3), peer, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4), process_group=group)
    model(torch.randn(2, 4)).sum().backward()


def _counts():
    import torch
    import torch.distributed as dist

    plain, observed = dist.new_group(backend="gloo"), dist.new_group()
    _same_work(plain)
    _same_work(observed)
    gloo = plain._get_backend(torch.device("cpu"))._get_sequence_number_for_group()
    ours = observed._get_sequence_number_for_group()
    for g in (plain, observed):
        dist.destroy_process_group(g)
    return gloo, ours, type(observed).__name__


def test_counts_equal_plain_gloo(cluster):
    for gloo, ours, kind in cluster.run(_counts):
        assert kind == "ObservingGroup"
        assert gloo == ours and gloo > 10


def _ddp_buckets():
    import torch
    import torch.distributed as dist

    from ddplab.pg.group import observe

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.03)
    per_iteration = []
    for _ in range(3):
        with observe(Noting()) as seen:
            ddp(torch.randn(8, 64)).sum().backward()
        per_iteration.append([n[0] for op, n, _ in seen.ops if op == "all_reduce"])
    data = ddp._get_ddp_logging_data()
    params = list(net.parameters())
    buckets = [sum(params[int(i)].numel() for i in chunk.split())
               for chunk in data["rebuilt_per_bucket_param_indices"].split(",")]
    return per_iteration, buckets, dist.get_rank()


def test_torch_ddp_buckets_seen_as_its_logging_data_says(cluster):
    for per_iteration, buckets, _ in cluster.run(_ddp_buckets):
        assert len(buckets) > 2
        # after the rebuild every iteration all-reduces the logged buckets, in index order
        assert per_iteration[1] == per_iteration[2] == buckets
        assert sum(per_iteration[0]) == sum(buckets)


class ShortWait(Noting):
    timeout = 1.0

    def failed(self, token, exc):
        raise TimeoutError(f"op {self.ops[token][0]} waited {self.timeout} s")


def _stall():
    import time

    import torch
    import torch.distributed as dist

    from ddplab.pg.group import observe

    if dist.get_rank() == 1:
        time.sleep(3)  # never joins: rank 0 waits alone
        return None
    t0 = time.monotonic()
    with observe(ShortWait()):
        dist.all_reduce(torch.ones(1))
    return time.monotonic() - t0


@pytest.mark.slow
def test_a_short_timeout_ends_a_stall_and_the_ranks_are_replaced(cluster):
    before = cluster.pids
    with pytest.raises(RankError) as err:
        cluster.run(_stall)
    assert "op all_reduce waited 1.0 s" in str(err.value)
    assert "replaced" in str(err.value)  # rank 0 issued one collective, rank 1 none
    assert cluster.pids != before
    cluster.ensure_ready()


def _equal_then_raise():
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    raise ValueError("the learner's own mistake")


def test_ranks_that_issued_the_same_collectives_are_kept(cluster):
    before = cluster.pids
    with pytest.raises(RankError) as err:
        cluster.run(_equal_then_raise)
    assert "ValueError" in str(err.value) and "replaced" not in str(err.value)
    assert cluster.pids == before
    assert cluster.run(lambda: 1) == [1, 1]


def _not_observed():
    import torch.distributed as dist

    from ddplab.pg.group import observe

    plain = dist.new_group(backend="gloo")
    try:
        with observe(Noting(), plain):
            pass
    except RuntimeError as exc:
        return str(exc)
    finally:
        # Both ranks must be connected before either destroys the group: a rank that
        # leaves early closes the connection its peer is still opening.
        dist.barrier(group=plain)
        dist.destroy_process_group(plain)


def test_a_plain_group_is_refused_with_a_way_out(cluster):
    assert all("not observed" in m and "ddplab_gloo" in m for m in cluster.run(_not_observed))
