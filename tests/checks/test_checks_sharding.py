"""Lab 11's grader (ddplab.checks.sharding) on live ranks, where its mutation catalogue
(tests/_catalogue_sharding.py, ``make test-graders``) cannot prove it: the owners given by
ShardedOptimizer when no partition is passed, fresh ranks after a hang, and the hint an
unpadded all-gather gets from gloo's refusal."""
from __future__ import annotations

import _catalogue_sharding as CAT
import cloudpickle
import pytest
import torch.distributed as dist

from ddplab.checks import sharding as S
from ddplab.checks.mistakes import HUNG, RAISED, CheckFailed

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

cloudpickle.register_pickle_by_value(CAT)  # the ranks cannot import tests/


def test_without_a_partition_shardedoptimizers_owners_are_used(cluster2):
    per_rank = S.check_sharded_step(cluster2, CAT.gathered_padded)  # 12 s under load (a first job)
    assert per_rank[0]["steps"][0]["by_op"] == {"all_gather": 53 * 8}  # the larger share, padded
    assert S.passed["sharded_step"]


def test_an_unpadded_all_gather_is_refused_by_gloo_and_told_to_pad(cluster2):
    with pytest.raises(CheckFailed) as e:  # 14 s under load: the ranks are replaced after
        S.check_sharded_step(cluster2, CAT.gathered_without_padding, CAT.largest_first)
    assert e.value.mistake == RAISED and "invalid tensor size" in str(e.value), str(e.value)
    assert "pad each rank's flat shard" in str(e.value)


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


def test_a_buffer_of_another_dtype_and_a_piece_without_its_shape_are_told_their_cause(cluster2):
    for step, words in ((CAT.float32_buffer, "another dtype than the parameters'"),
                        (CAT.flat_pieces_kept, "piece.view_as(p)")):
        with pytest.raises(CheckFailed) as e:  # each replaces the ranks: about 15 s under load
            S.check_sharded_step(cluster2, step, CAT.largest_first)
        assert e.value.mistake == RAISED and words in str(e.value), str(e.value)


def test_an_async_broadcast_never_waited_for_is_named(cluster2):
    with pytest.raises(CheckFailed) as e:
        S.check_sharded_step(cluster2, CAT.async_never_waited, CAT.largest_first)
    assert e.value.mistake == S.NOT_WAITED and "work.wait()" in str(e.value), str(e.value)


def _leave_changed_torch():
    """What a learner's cell might leave on a rank: grad mode off, float64, a patched collective."""
    import torch

    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    dist.broadcast = lambda *a, **k: None


def _undo():
    import torch
    from torch.distributed import distributed_c10d as c10d

    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    dist.broadcast = c10d.broadcast


def test_torch_changed_by_an_earlier_cell_is_named_before_grading_both_labs(cluster2):
    import _catalogue_fsdp as FCAT

    from ddplab.checks.graders import STATE_CHANGED

    cloudpickle.register_pickle_by_value(FCAT)
    cluster2.run(_leave_changed_torch)
    try:
        for grade in (lambda: S.check_sharded_step(cluster2, CAT.per_param),
                      lambda: FCAT._check(cluster2, FCAT.CORRECT[0])):
            with pytest.raises(CheckFailed) as e:  # correct code, refused before it runs
                grade()
            said = str(e.value)
            assert e.value.mistake == STATE_CHANGED, said
            for change in ("grad mode is off", "default dtype is torch.float64",
                           "torch.distributed.broadcast is not torch's own", "restart the ranks"):
                assert change in said, said
    finally:
        cluster2.run(_undo)
    assert S.check_sharded_step(cluster2, CAT.per_param)  # undone: graded, and passes


def _never_ends(*args):
    while True:
        pass


@pytest.mark.slow  # two job timeouts of 6 s, and the ranks replaced after each: ~40 s
def test_a_loop_that_never_ends_is_not_called_a_hang_in_a_collective(cluster2):
    import _catalogue_fsdp as FCAT

    from ddplab.checks.graders import NOT_FINISHED

    cloudpickle.register_pickle_by_value(FCAT)
    with pytest.raises(CheckFailed) as e:  # ~8 s, then the ranks are replaced
        S.check_sharded_step(cluster2, _never_ends, CAT.largest_first, timeout=6)
    assert e.value.mistake == NOT_FINISHED and "_never_ends" in str(e.value), str(e.value)
    fn = FCAT.CORRECT[0]
    with pytest.raises(CheckFailed) as e:
        FCAT.FC.check_fsdp_hooks(cluster2, _never_ends, fn.post_forward, fn.pre_backward,
                                 fn.post_backward, timeout=6)
    assert e.value.mistake == NOT_FINISHED, str(e.value)
