"""Sends and receives as NCCL needs them: grouped per exchange, and graded for it on CPU.

NCCL runs point-to-point calls that must progress together only when they are one
group; ``batch_isend_irecv`` groups them for torch's own groups but hands the observing
group its ops one by one. The observing group therefore opens a coalescing block on
its NCCL half at the first send or recv and closes it when something waits
(``ddplab.pg.p2p_blocks.CoalescedP2P``). No GPU here: a fake NCCL stands in, which,
like NCCL, launches nothing before the block ends (it then hands the ops to the real
gloo group), so a ring whose sends and recvs were not grouped would show it.

The ring grader judges for NCCL from what the observing group saw (was a wait made
before the other half of its exchange was posted?), so that judgement runs on gloo
ranks with ``backend="nccl"``.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddplab import checks
from ddplab.checks import ring as R
from ddplab.lessons import ring
from ddplab.pg.p2p_blocks import BlockWork, CoalescedP2P, issue_on_inner


@pytest.fixture
def cluster(cluster3):
    return cluster3


class FakeNCCL:
    """Stands for ProcessGroupNCCL: sends and recvs inside a coalescing block are only
    noted, and launched (here on ``real``, a gloo group, when given) when the block ends,
    as NCCL launches a group at ncclGroupEnd. Anything else goes straight to ``real``."""

    def __init__(self, real=None):
        self.real, self.block, self.groups, self.calls = real, None, [], []

    def _start_coalescing(self):  # the Backend binding's signature (no device)
        assert self.block is None, "a block opened inside another"
        self.block = []
        self.calls.append(("start", None))

    def send(self, tensors, dst, tag):
        assert self.block is not None, "a send outside a group"
        self.block.append(("send", tensors, dst, tag))

    def recv(self, tensors, src, tag):
        assert self.block is not None, "a recv outside a group"
        self.block.append(("recv", tensors, src, tag))

    def _end_coalescing(self):
        ops, self.block = self.block, None
        self.groups.append([(op, peer) for op, _, peer, _ in ops])
        self.calls.append(("end", None))
        works = [getattr(self.real, op)(t, peer, tag) for op, t, peer, tag in ops] if self.real else []
        return AllOf(works)

    def __getattr__(self, name):  # collectives: straight to the real group
        return getattr(self.real, name)


class AllOf:
    def __init__(self, works):
        self.works, self.waits = works, 0

    def wait(self, timeout=None):
        self.waits += 1
        if self.waits == 1:  # like NCCL's work, waited once per op of the group; gloo's once
            for work in self.works:
                work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


def test_sends_and_recvs_go_out_as_one_group_when_someone_waits():
    fake = FakeNCCL()
    block = CoalescedP2P(fake)
    t, u = torch.ones(2), torch.zeros(2)
    send = issue_on_inner(block, "send", fake, lambda b: b.send([t], 1, 0), [t])
    recv = issue_on_inner(block, "recv", fake, lambda b: b.recv([u], 2, 0), [u])
    assert isinstance(send, BlockWork) and fake.groups == []  # nothing launched yet
    recv.wait()
    assert fake.groups == [[("send", 1), ("recv", 2)]]
    send.wait()  # the same group's work: no second group
    assert fake.groups == [[("send", 1), ("recv", 2)]] and send.real is recv.real
    assert send.real.waits == 2


def test_a_blocking_send_is_a_group_of_its_own_and_collectives_close_the_block():
    fake = FakeNCCL()
    block = CoalescedP2P(fake)
    t = torch.ones(2)
    issue_on_inner(block, "send", fake, lambda b: b.send([t], 1, 0), [t]).wait()  # dist.send
    issue_on_inner(block, "recv", fake, lambda b: b.recv([t], 2, 0), [t]).wait()  # dist.recv
    assert fake.groups == [[("send", 1)], [("recv", 2)]]
    issue_on_inner(block, "send", fake, lambda b: b.send([t], 1, 0), [t])  # an isend, not waited yet
    called = []
    issue_on_inner(block, "all_reduce", fake, lambda b: called.append("all_reduce"), [t])
    # the open block went to NCCL first: ops reach it in the order they were called
    assert fake.groups[-1] == [("send", 1)] and called == ["all_reduce"]
    assert [c for c, _ in fake.calls] == ["start", "end"] * 3


def test_the_fake_has_the_signatures_of_torchs_backend_binding():
    from torch._C._distributed_c10d import Backend

    # ProcessGroupNCCL is a Backend: its coalescing methods take no device (CPU wheel: no NCCL)
    assert "_start_coalescing(self: torch._C._distributed_c10d.Backend) -> None" in \
        Backend._start_coalescing.__doc__
    assert "_end_coalescing(self: torch._C._distributed_c10d.Backend)" in Backend._end_coalescing.__doc__


def test_a_gloo_only_group_issues_each_op_alone():
    issued = []
    work = issue_on_inner(None, "send", "gloo", lambda b: issued.append(b) or "work", [torch.ones(1)])
    assert work == "work" and issued == ["gloo"]


def ring_under_fake_nccl():
    """On each rank: the observing group's NCCL half replaced by FakeNCCL over its gloo half."""
    from ddplab.pg.group import observing_group
    from ddplab.pg.p2p_blocks import CoalescedP2P

    pg = observing_group()
    fake = FakeNCCL(pg.cpu)
    pg.p2p, pg._backend = CoalescedP2P(fake), (lambda tensors: fake)
    try:
        t = torch.arange(10.0) * (dist.get_rank() + 1)
        ring.ring_all_reduce(t)
        return t, fake.groups
    finally:
        pg.p2p = None
        del pg._backend


def test_the_reference_ring_sends_each_exchange_as_one_group(cluster):
    out = cluster.run(ring_under_fake_nccl)
    p = 3
    for t, groups in out:
        assert torch.equal(t, torch.arange(10.0) * 6)  # 1 + 2 + 3
        # 2(p-1) steps, each one group: a send to the right and a recv from the left
        assert len(groups) == 2 * (p - 1)
    for rank, (_, groups) in enumerate(out):
        assert all(g == [("send", (rank + 1) % p), ("recv", (rank - 1) % p)] for g in groups)


# -- the grader, judging for NCCL on gloo ranks ----------------------------------------------
def ring_p2pop(t):
    from torch.distributed import P2POp, batch_isend_irecv, irecv, isend  # imported names

    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(t, p)
    for phase in (0, 1):
        for s in range(p - 1):
            out, into = chunks[(rank - s + phase) % p], chunks[(rank - s - 1 + phase) % p]
            buf = torch.empty_like(into)
            for work in batch_isend_irecv([P2POp(isend, out.contiguous(), (rank + 1) % p),
                                           P2POp(irecv, buf, (rank - 1) % p)]):
                work.wait()
            into.copy_(buf) if phase else into.add_(buf)


def ring_blocking_even_odd(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(t, p)
    for phase in (0, 1):
        for s in range(p - 1):
            out, into = chunks[(rank - s + phase) % p], chunks[(rank - s - 1 + phase) % p]
            buf = torch.empty_like(into)
            if rank % 2 == 0:
                dist.send(out.contiguous(), (rank + 1) % p)
                dist.recv(buf, (rank - 1) % p)
            else:
                dist.recv(buf, (rank - 1) % p)
                dist.send(out.contiguous(), (rank + 1) % p)
            into.copy_(buf) if phase else into.add_(buf)


@pytest.mark.parametrize("fn", [ring_p2pop, ring.ring_all_reduce])
def test_grouped_rings_pass_when_judged_for_nccl(cluster, fn):
    per_rank = checks.check_ring_all_reduce(cluster, fn, timeout=5.0, backend="nccl")
    assert checks.graders.passed["ring_all_reduce"]
    assert all(c["log"]["ungrouped"] is None for r in per_rank for c in r)


def test_a_blocking_ring_passes_on_gloo_and_is_refused_for_nccl_in_words(cluster):
    per_rank = checks.check_ring_all_reduce(cluster, ring_blocking_even_odd, timeout=5.0)
    assert checks.graders.passed["ring_all_reduce"]  # gloo pairs them as they come
    notes = {r: c["log"]["ungrouped"] for r, cases in enumerate(per_rank) for c in cases[:1]}
    assert notes[0] == "waited for its send to rank 1 before posting its recv"
    assert notes[1] == "waited for its recv from rank 0 before posting its send"
    with pytest.raises(checks.CheckFailed) as info:
        checks.check_ring_all_reduce(cluster, ring_blocking_even_odd, timeout=5.0, backend="nccl")
    assert info.value.mistake == R.UNGROUPED
    text = str(info.value)
    assert "rank 0 (length 10, float64, on 3 ranks) waited for its send to rank 1" in text
    assert "batch_isend_irecv" in text and "P2POp" in text
