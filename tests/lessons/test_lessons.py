"""The labs' checks, asserted: each one answers a learner's question by measurement."""
import pytest
import torch

from ddplab.lessons import training as L


@pytest.fixture
def cluster(cluster2):
    return cluster2  # shared for the session (conftest.py)


@pytest.mark.parametrize("strategy", ["manual", "manual_flat", "overlap", "bucketed", "ddp"])
def test_every_strategy_is_single_process_training(cluster, strategy):
    assert max(L.single_process_gap(cluster, strategy, steps=3)) < 1e-12


def test_the_loss_is_per_rank_and_the_gradients_are_shared(cluster):
    r = cluster.run(L.loss_and_grads_on_rank, "bucketed")
    assert r[0]["loss"] != r[1]["loss"]  # nobody synchronizes the loss
    assert r[0]["mean_loss"] == pytest.approx((r[0]["loss"] + r[1]["loss"]) / 2)
    assert torch.allclose(r[0]["grads"], r[1]["grads"], atol=1e-15)


def test_the_sync_happens_inside_backward_for_hooks_and_after_it_by_hand(cluster):
    order = dict(cluster.run(L.sync_order_on_rank, "bucketed")[0])
    assert order["backward_start"] < order["first launch"] < order["backward_returned"]
    assert order["last done"] <= order["backward_returned"] <= order["step_start"]
    manual = dict(cluster.run(L.sync_order_on_rank, "manual")[0])
    assert manual["backward_returned"] <= manual["first launch"]


def test_batch_size_does_not_change_the_traffic(cluster):
    t = L.traffic_by_batch_size(cluster, (4, 256))
    assert t[4]["bytes"] == t[256]["bytes"] == t[4]["param_bytes"]


def test_no_sync_sends_once_per_accumulation(cluster):
    t = L.no_sync_traffic(cluster, micro_steps=4)
    assert t["every_micro_step"]["bytes"] == 4 * t["with_no_sync"]["bytes"]


def test_autocast_does_not_compress_gradients(cluster):
    t = L.autocast_traffic(cluster)
    assert t["autocast"]["bytes"] == t["fp32"]["bytes"]
    assert t["autocast"]["grad_dtypes"] == ["torch.float32"]


def test_distributed_sampler_pads_uneven_data_with_repeats():
    ranks = L.sampler_indices(10, 4)
    flat = [i for r in ranks for i in r]
    assert len(flat) == 12 and len(set(flat)) == 10  # two samples seen twice
    assert sorted(i for r in L.sampler_indices(10, 4, drop_last=True) for i in r) == list(range(8))
