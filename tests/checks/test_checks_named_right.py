"""The sharding graders name what happened: a deadlock in lab 12's FSDP check is "hung" (it
was "raised an exception"), and lab 11's untouched exercise says "not implemented" without
first saying the step stopped halfway and replacing the ranks."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from ddplab.checks import fsdp as FC
from ddplab.checks import sharding as S
from ddplab.checks.mistakes import HUNG, NOT_IMPLEMENTED, CheckFailed

pytestmark = pytest.mark.more


def only_rank0_gathers(shard, numel, shape, group=None):
    if dist.get_rank(group) == 0:
        out = shard.new_empty(dist.get_world_size(group) * shard.numel())
        dist.all_gather_single(out, shard, group=group)
        return out[:numel].view(shape)
    dist.recv(shard.new_empty(1), src=0, group=group)  # waits for a send rank 0 never makes
    return None


def reduce_scatter_grad(full_grad, group=None):
    raise AssertionError("never reached: the gather hangs first")


def test_a_gather_only_one_rank_makes_is_named_a_hang(cluster2_short):
    with pytest.raises(CheckFailed) as e:
        FC.check_fsdp_collectives(cluster2_short, only_rank0_gathers, reduce_scatter_grad)
    assert e.value.mistake == HUNG, str(e.value)
    assert "every all-gather and reduce-scatter" in str(e.value)


def untouched(local_optimizer, params, owner):
    raise NotImplementedError


def untouched_partition(params, world_size):
    raise NotImplementedError


def test_the_untouched_lab11_exercise_says_not_implemented_and_keeps_its_ranks(cluster2, capfd):
    pids = cluster2.run(lambda: __import__("os").getpid())
    with pytest.raises(CheckFailed) as e:
        S.check_sharded_step(cluster2, untouched, untouched_partition)
    assert e.value.mistake == NOT_IMPLEMENTED, str(e.value)
    said = "".join(capfd.readouterr())
    assert "halfway" not in said and "replaced" not in said, said
    assert cluster2.run(lambda: __import__("os").getpid()) == pids  # the same ranks, usable
