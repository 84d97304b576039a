"""Lab 11's grader (ddplab.checks.sharding) on live ranks: correct spellings pass, and each
planted mistake of the catalogue (tests/_catalogue_sharding.py) is named."""
from __future__ import annotations

import _catalogue_sharding as CAT
import cloudpickle
import pytest
import torch.distributed as dist

from ddplab.checks import sharding as S
from ddplab.checks.mistakes import HUNG, CheckFailed

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

cloudpickle.register_pickle_by_value(CAT)  # the ranks cannot import tests/
E = CAT.SHARDED_STEP


@pytest.mark.parametrize("fn", E["correct"], ids=lambda f: f.__name__)
def test_correct_spellings_pass(cluster2, fn):
    assert len(S.check_sharded_step(cluster2, fn)) == 2
    assert S.passed["sharded_step"]


@pytest.mark.parametrize("fn,mistake", E["wrong"], ids=[f.__name__ for f, _ in E["wrong"]])
def test_each_mistake_is_named(cluster2, fn, mistake):
    with pytest.raises(CheckFailed) as e:
        S.check_sharded_step(cluster2, fn)
    assert e.value.mistake == mistake, str(e.value)
    assert not S.passed["sharded_step"]


def only_owner_sends(local, params, owner):
    local.step()
    for p in params:
        if owner[p] == dist.get_rank():
            dist.broadcast(p.data, src=owner[p])


def test_a_broadcast_only_the_owner_makes_is_named_a_hang(cluster2_short):
    with pytest.raises(CheckFailed) as e:
        S.check_sharded_step(cluster2_short, only_owner_sends, timeout=40)
    assert e.value.mistake == HUNG, str(e.value)
    assert cluster2_short.run(lambda: 1) == [1, 1]  # fresh ranks after the hang
