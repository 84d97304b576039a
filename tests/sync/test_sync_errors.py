"""Misuse fails at once with an error that says what to do; nothing hangs.

The argument checks need no ranks (they run before any collective), so they
run in the test process itself, where no process group exists.
"""
from __future__ import annotations

import math

import _sync_helpers as H
import pytest
import torch
from torch import nn

import ddplab
from ddplab.sync import BucketedDDP, OverlapDDP, average_gradients


@pytest.mark.parametrize("cap", [0, -1.0, math.nan, "25", True, [25]])  # None: torch's default
def test_bad_bucket_cap_says_what_to_pass(cap):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        BucketedDDP(H.MLP(), bucket_cap_mb=cap)


@pytest.mark.parametrize("wrapper", [OverlapDDP, BucketedDDP])
def test_a_module_with_nothing_to_train_is_refused(wrapper):
    frozen = H.MLP().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        wrapper(frozen)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        wrapper(nn.ReLU())


def test_wrapping_something_that_is_not_a_module_is_refused():
    with pytest.raises(TypeError, match="wraps a torch.nn.Module"):
        OverlapDDP(torch.zeros(3))


@pytest.mark.parametrize("make", [
    lambda m: OverlapDDP(m),
    lambda m: BucketedDDP(m),
    lambda m: average_gradients(m),
])
def test_without_a_process_group_the_error_says_how_to_start_one(make, monkeypatch):
    if torch.distributed.is_initialized():  # some other test left a group in this process
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    how = r"no process group.*ddplab\.Cluster.*init_process_group"
    with pytest.raises(RuntimeError, match=how):
        make(H.MLP())


class HasAnUnusedLayer(nn.Module):
    """``spare`` is declared first, so it comes LAST in reverse order: every
    other bucket has left before the missing gradient is noticed."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(H.OUT, H.OUT)
        self.mlp = H.MLP()

    def forward(self, x, use_spare=False):
        out = self.mlp(x)
        return out + self.spare(out) if use_spare else out


def _step_with_unused_layer(wrapper_name):
    torch.manual_seed(0)
    model = HasAnUnusedLayer().double()
    wrapped = OverlapDDP(model) if wrapper_name == "overlap" else BucketedDDP(model, 1e-6)
    x, y = H.union_batch(torch.distributed.get_rank(), 8)  # each rank its own data
    try:
        nn.functional.mse_loss(wrapped(x), y).backward()
    except RuntimeError as e:
        message = str(e)
    else:
        return "no error", None
    # The same wrapper is left clean: a step that uses every parameter works.
    model.zero_grad()
    nn.functional.mse_loss(wrapped(x, use_spare=True), y).backward()
    return message, model.spare.weight.grad


@pytest.mark.parametrize("wrapper", ["overlap", "bucketed"])
def test_a_parameter_unused_on_every_rank_is_named_not_a_hang(cluster2, wrapper):
    (message, grad0), (_, grad1) = cluster2.run(_step_with_unused_layer, wrapper)
    assert "spare.weight" in message and "spare.bias" in message
    assert "got no gradient" in message and "requires_grad_(False)" in message
    assert grad0 is not None and torch.equal(grad0, grad1)  # the next step synchronized


def _unused_layer_raises():
    torch.manual_seed(0)
    ddp = BucketedDDP(HasAnUnusedLayer().double())
    x, y = H.union_batch(0, 8)
    nn.functional.mse_loss(ddp(x), y).backward()


def test_the_learner_sees_one_error_naming_the_parameter(cluster2):
    with pytest.raises(ddplab.RankError, match="spare.weight"):
        cluster2.run(_unused_layer_raises)
    assert cluster2.run(lambda: 1) == [1, 1]  # the ranks are still usable


def _wrap_again_after_a_forward():
    from ddplab.sync import comm

    model = H.make_model("mlp", 0)
    x, y = H.union_batch(0, 8)
    wrapped = BucketedDDP(model)
    wrapped(x)  # a cell ran forward only...
    wrapped = BucketedDDP(model)  # ...then the wrapping cell was run again
    with comm.counting() as c:
        nn.functional.mse_loss(wrapped(x), y).backward()
    return c.grad_calls


def test_wrapping_the_same_model_again_does_not_synchronize_twice(cluster2):
    # The hooks hold their wrapper weakly, so the replaced wrapper is gone.
    assert cluster2.run(_wrap_again_after_a_forward) == [1, 1]
