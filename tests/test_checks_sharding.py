"""Lab 11's grader (ddplab.checks.sharding) on live ranks: correct spellings pass, and each
planted mistake is named."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from ddplab.checks import sharding as S
from ddplab.checks.mistakes import CheckFailed, HUNG, NOT_IMPLEMENTED


def per_param(local, params, owner, group=None):
    local.step()
    for p in params:
        dist.broadcast(p.data, src=owner[p])


def async_waited(local, params, owner, group=None):
    local.step()
    works = [dist.broadcast(p.data, src=owner[p], async_op=True) for p in params]
    for w in works:
        w.wait()


def by_rank(local, params, owner, group=None):
    local.step()
    for r in range(dist.get_world_size()):
        for p in params:
            if owner[p] == r:
                dist.broadcast(p.data, src=r)


def no_broadcast(local, params, owner, group=None):
    local.step()


def broadcast_first(local, params, owner, group=None):
    for p in params:
        dist.broadcast(p.data, src=owner[p])
    local.step()


def from_rank0(local, params, owner, group=None):
    local.step()
    for p in params:
        dist.broadcast(p.data, src=0)


def no_step(local, params, owner, group=None):
    for p in params:
        dist.broadcast(p.data, src=owner[p])


def twice(local, params, owner, group=None):
    local.step()
    for p in params:
        dist.broadcast(p.data, src=owner[p])
        dist.broadcast(p.data, src=owner[p])


def all_reduced(local, params, owner, group=None):
    local.step()
    for p in params:
        dist.all_reduce(p.data)


def only_owner_sends(local, params, owner, group=None):
    local.step()
    for p in params:
        if owner[p] == dist.get_rank():
            dist.broadcast(p.data, src=owner[p])


def not_written(local, params, owner, group=None):
    raise NotImplementedError


@pytest.mark.parametrize("fn", [per_param, async_waited, by_rank])
def test_correct_spellings_pass(cluster2, fn):
    assert len(S.check_sharded_step(cluster2, fn)) == 2


@pytest.mark.parametrize("fn,mistake", [
    (no_broadcast, S.NO_BROADCAST), (broadcast_first, S.BROADCAST_FIRST),
    (from_rank0, S.WRONG_SOURCE), (no_step, S.NO_STEP), (twice, S.WRONG_BYTES),
    (all_reduced, S.WRONG_BYTES), (not_written, NOT_IMPLEMENTED)])
def test_each_mistake_is_named(cluster2, fn, mistake):
    with pytest.raises(CheckFailed) as e:
        S.check_sharded_step(cluster2, fn)
    assert e.value.mistake == mistake, str(e.value)


def test_a_broadcast_only_the_owner_makes_is_named_a_hang(cluster2_short):
    with pytest.raises(CheckFailed) as e:
        S.check_sharded_step(cluster2_short, only_owner_sends, timeout=40)
    assert e.value.mistake == HUNG, str(e.value)
