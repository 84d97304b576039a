"""Lab 12's grader (ddplab.checks.fsdp) says the cause where torch's words do not: a write into
a tensor whose memory free_storage released kills the rank (nothing checks it), a copy_ into a
tensor autograd saved makes the backward refuse it, and gloo stops a rank whose reduce-scatter
sizes do not match. Its catalogue (tests/_catalogue_fsdp.py) checks each is RAISED; this checks
the words."""
from __future__ import annotations

import _catalogue_fsdp as CAT
import cloudpickle
import pytest

from ddplab.checks import fsdp as FC
from ddplab.checks.mistakes import RAISED, CheckFailed

pytestmark = pytest.mark.more  # ranks replaced twice: about 30 s under load

cloudpickle.register_pickle_by_value(CAT)  # the ranks cannot import tests/


def _verdict(cluster, name):
    fn = next(f for f, _ in CAT.WRONG if f.__name__ == name)
    with pytest.raises(CheckFailed) as e:
        CAT._check(cluster, fn)
    return e.value


def test_a_write_into_freed_memory_and_an_in_place_copy_are_told_their_cause(cluster2):
    died = _verdict(cluster2, "no_alloc")  # copies into a freed full weight: SIGSEGV
    assert died.mistake == RAISED and "SIGSEGV" in str(died), str(died)
    assert "alloc_storage(full)" in str(died)
    assert cluster2.run(lambda: 1) == [1, 1]  # fresh ranks
    saved = _verdict(cluster2, "copied_under_no_grad")
    assert saved.mistake == RAISED and "modified by an inplace operation" in str(saved), str(saved)
    assert "full.data.copy_" in str(saved)


def test_an_unpadded_reduce_scatter_stopped_by_gloo_is_told_to_pad(cluster2):
    stopped = _verdict(cluster2, "floor_no_padding")
    assert stopped.mistake == RAISED and "Check failed" in str(stopped), str(stopped)
    assert "pad the flat gradient to n * world_size" in str(stopped)
    assert cluster2.run(lambda: 1) == [1, 1]


def test_a_hook_not_callable_is_refused_in_words(cluster2):
    with pytest.raises(TypeError, match="pass your post_backward function itself"):
        FC.check_fsdp_hooks(cluster2, CAT.pre_forward, CAT.post_forward, CAT.pre_forward, None)


def test_a_view_of_the_padded_gather_is_told_to_cut_the_padding():
    said = FC._hints("rank 0: RuntimeError: shape '[7, 5]' is invalid for input of size 36")
    assert "padding included" in said and "out[:sp.numel].view(sp.shape)" in said
