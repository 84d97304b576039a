"""The sharding graders name what happened: a deadlock in lab 12's FSDP check is "hung" (it
was "raised an exception"), and lab 11's and lab 12's untouched exercises say "not implemented"
without first saying the step stopped halfway and replacing the ranks."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from ddplab.checks import fsdp as FC
from ddplab.checks import sharding as S
from ddplab.checks.mistakes import HUNG, NOT_IMPLEMENTED, CheckFailed

pytestmark = pytest.mark.more


def _pre_forward(fsdp, unit):
    from ddplab.sync.core.fsdp import alloc_storage

    for sp, full in zip(unit.params, unit.fulls):
        out = sp.shard.new_empty(fsdp.world_size * sp.shard.numel())
        dist.all_gather_single(out, sp.shard.detach())
        alloc_storage(full)
        full.data.copy_(out[:sp.numel].view(sp.shape))
    fsdp.swap_in(unit)


def only_rank0_gathers(fsdp, unit):
    if dist.get_rank() == 0:
        _pre_forward(fsdp, unit)
        return
    dist.recv(unit.params[0].shard.detach().new_empty(1), src=0)  # a send rank 0 never makes


def not_written(fsdp, unit):
    raise NotImplementedError


def test_a_gather_only_one_rank_makes_is_named_a_hang(cluster2_short):
    with pytest.raises(CheckFailed) as e:
        FC.check_fsdp_hooks(cluster2_short, only_rank0_gathers, not_written, not_written, not_written)
    assert e.value.mistake == HUNG, str(e.value)
    assert "every all-gather and reduce-scatter" in str(e.value)
    assert cluster2_short.run(lambda: 1) == [1, 1]  # fresh ranks after the hang


def test_the_untouched_lab12_exercise_says_not_implemented_and_keeps_its_ranks(cluster2, capfd):
    pids = cluster2.run(lambda: __import__("os").getpid())
    capfd.readouterr()
    with pytest.raises(CheckFailed) as e:
        FC.check_fsdp_hooks(cluster2, not_written, not_written, not_written, not_written)
    assert e.value.mistake == NOT_IMPLEMENTED, str(e.value)
    said = "".join(capfd.readouterr())
    assert "halfway" not in said and "replaced" not in said, said
    assert cluster2.run(lambda: __import__("os").getpid()) == pids  # the same ranks, usable


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
