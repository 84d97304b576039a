"""The reference reducers (ddplab.sync.core): what the differential test does not show.

Their training results are checked in tests/sync/test_sync_differential.py (equal
to the full reducers, torch DDP and one process after every step, at 2 and 3
ranks). Here: they refuse what they do not support, naming who does; the
bucketed one launches in index order however gradients arrive; a parameter
that gets no gradient is an error naming it, on every rank, not a hang (the
bucketed one as torch's DDP: backward returns without averaging, the next
forward raises); a model wrapped twice is synchronized once.
"""
from __future__ import annotations

import _sync_helpers as H
import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddplab
from ddplab.sync import core


@pytest.mark.parametrize("wrapper, option, full", [
    (core.BucketedDDP, "find_unused_parameters", "ddplab.BucketedDDP"),
    (core.BucketedDDP, "bucket_cap_mb_list", "ddplab.BucketedDDP"),
    (core.OverlapDDP, "recorder", "ddplab.OverlapDDP")])
def test_an_option_the_reference_leaves_out_is_refused_naming_who_has_it(wrapper, option, full):
    with pytest.raises(TypeError, match=rf"does not take {option}.*{full}"):
        wrapper(H.MLP(), **{option: True})


class DeclaredBackwards(nn.Module):
    """The last layer is declared first: reverse parameters() order is not ready order."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(16, H.OUT)
        self.early = nn.Linear(H.IN, 16)

    def forward(self, x):
        return self.late(torch.tanh(self.early(x)))


def _launch_order():
    torch.manual_seed(0)
    model = DeclaredBackwards().double()
    ddp = core.BucketedDDP(model, bucket_cap_mb=1e-6)  # one parameter per bucket
    buffers = {b.buffer.data_ptr(): b.index for b in ddp.buckets}
    ready, launched, real = [], [], dist.all_reduce
    names = {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: ready.append(names[id(p)]))

    def spy(tensor, *args, **kwargs):  # looked up at call time: the reference calls dist.*
        launched.append(buffers.get(tensor.data_ptr()))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        x, y = H.union_batch(0, 8)
        nn.functional.mse_loss(ddp(x), y).backward()
    finally:
        dist.all_reduce = real
    return [[names[id(p)] for p in b.params] for b in ddp.buckets], ready, launched


def test_buckets_launch_in_index_order_even_when_later_ones_are_ready_first(cluster2):
    for layout, ready, launched in cluster2.run(_launch_order):
        assert layout == [["early.bias"], ["early.weight"], ["late.bias"], ["late.weight"]]
        assert ready[0].startswith("late.")  # backward finished late.* first...
        assert launched == [0, 1, 2, 3]  # ...and they still left after 0 and 1


class HasAnUnusedLayer(H.MLP):
    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(3, 3)


def _unused(wrapper):
    ddp = getattr(core, wrapper)(HasAnUnusedLayer().double())
    x, y = H.union_batch(0, 8)
    nn.functional.mse_loss(ddp(x), y).backward()
    ddp(x)  # the reference BucketedDDP raises here, at the next forward, as torch's DDP does


def _unused_beside_torch():
    """The reference and torch's DDP on a model with an unused layer, rank-own data: where
    each raises, and whether the backward before averaged anything."""
    out = {}
    for name, wrap in (("core", core.BucketedDDP), ("torch", nn.parallel.DistributedDataParallel)):
        torch.manual_seed(0)
        ddp = wrap(HasAnUnusedLayer().double())
        x, y = H.union_batch(dist.get_rank(), 8)  # each rank its own batch
        nn.functional.mse_loss(ddp(x), y).backward()  # returns: no finalize was queued
        grad = ddp.module.fc1.weight.grad.clone()
        mine = torch.zeros_like(grad)
        dist.all_reduce(mine.copy_(grad))  # the group is clean: no bucket went out
        try:
            ddp(x)
            raised = ""
        except RuntimeError as err:
            raised = str(err)
        out[name] = {"averaged": torch.equal(mine / dist.get_world_size(), grad),
                     "raised": raised}
        if name == "core":  # and the reference goes on once the model is fixed
            ddp.module.spare.requires_grad_(False)
            ddp2 = core.BucketedDDP(ddp.module)
            nn.functional.mse_loss(ddp2(x), y).backward()
            out["core_after_fix"] = ddp2.ready == set()
    return out


def test_a_parameter_without_gradient_lets_backward_return_and_the_next_forward_raise_as_torch(
        cluster2):
    for r in cluster2.run(_unused_beside_torch):
        for name in ("core", "torch"):
            assert not r[name]["averaged"], name  # that backward averaged nothing
            assert "Expected to have finished reduction in the prior iteration" in r[name]["raised"]
        assert "spare.weight" in r["core"]["raised"] and r["core_after_fix"]


@pytest.mark.parametrize("wrapper", ["BucketedDDP", "OverlapDDP"])
def test_a_parameter_without_gradient_is_named_on_every_rank(cluster2, wrapper):
    with pytest.raises(ddplab.RankError, match="spare.weight") as e:
        cluster2.run(_unused, wrapper)
    assert "rank 0" in str(e.value) and "rank 1" in str(e.value)
    assert cluster2.run(lambda: 1) == [1, 1]


def _wrap_twice(wrapper):
    model = H.make_model("mlp", 0)
    x, y = H.union_batch(0, 8)
    wrapped = getattr(core, wrapper)(model)
    wrapped(x)  # a cell ran forward only, then the wrapping cell ran again
    wrapped = getattr(core, wrapper)(model)
    calls, real = [], dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: calls.append(1) or real(t, *a, **k)
    try:
        nn.functional.mse_loss(wrapped(x), y).backward()
    finally:
        dist.all_reduce = real
    return len(calls)


@pytest.mark.parametrize("wrapper, calls", [("BucketedDDP", 1), ("OverlapDDP", 6)])
def test_wrapping_the_same_model_again_synchronizes_once(cluster2, wrapper, calls):
    assert cluster2.run(_wrap_twice, wrapper) == [calls, calls]
