"""The strategies never train wrong in silence: eight cases where they used to part from torch DDP.

Each case trains average_gradients, OverlapDDP and BucketedDDP (one bucket,
and one bucket per parameter) beside torch's DistributedDataParallel and one
process, at 2 and 3 ranks, float64, several SGD+momentum steps, ranks
starting from different weights (see _parity_cases.py). A strategy either
equals torch and one process after every step, with every rank holding the
same parameters, or refuses at the first step with an error that names the
case, the parameter and what to do. Before the fix, cases 1-3 trained
wrong without a word, 4, 5, 7 and 8 failed where torch trains, and 6 hung.

Cases 1 and 2 run over a slow simulated link (20 ms per all-reduce), so the
all-reduces launched in a backward are still in flight when the mistake
happens; the errors do not depend on timing.
"""
from __future__ import annotations

import _parity_cases as C
import pytest

from ddplab.sync import MB

TOL = 1e-12
ONE_BUCKET = "bucketed:25"
PER_PARAM = f"bucketed:{1 / MB}"  # a 1-byte cap: a bucket per parameter
WRAPPERS = ["overlap", ONE_BUCKET, PER_PARAM]
ALL = ["manual", "manual_flat"] + WRAPPERS


@pytest.fixture(params=["cluster2", "cluster3"])
def cluster(request):
    return request.getfixturevalue(request.param)


def _many(case, strategies, slow_link=False, **kw):
    # the slow link matters where all-reduces overlap backward, not after it
    return {s: C.train(case, s, slow_link=slow_link and s in WRAPPERS, **kw) for s in strategies}


def run(cluster, case, strategies, **kw):
    """{strategy: [rank 0's result, rank 1's, ...]} from one job."""
    per_rank = cluster.run(_many, case, strategies, **kw)
    return {s: [r[s] for r in per_rank] for s in strategies}


def trains_like_torch(results, steps, vs_ddp=True, what=""):
    for rank, r in enumerate(results):
        assert not r["errors"], f"{what} rank {rank} raised: {r['errors']}"
        assert len(r["vs_ref"]) == steps
        assert max(r["vs_ref"]) < TOL, f"{what} rank {rank} vs one process: {r['vs_ref']}"
        if vs_ddp:
            assert max(r["vs_ddp"]) < TOL, f"{what} rank {rank} vs torch DDP: {r['vs_ddp']}"
    for step in range(steps):  # no replica drifts away from rank 0's
        drift = max((r["params"][step] - results[0]["params"][step]).abs().max().item()
                    for r in results)
        assert drift < TOL, f"{what} replicas {drift} apart after step {step}"


def refused(results, who, step, *words):
    for rank, r in enumerate(results):
        assert who in r["errors"], f"rank {rank}: {who} did not refuse: {r['errors']}"
        at, message = r["errors"][who]
        assert at == step, f"rank {rank}: {who} refused at step {at}, not {step}: {message}"
        for w in words:
            assert w in message, f"{w!r} not in {who}'s error: {message}"


# 1 -------------------------------------------------------------------------------------------
def test_1_a_hook_firing_twice_is_refused_as_torch_refuses_it(cluster):
    results = run(cluster, "reused_in_checkpoint", ALL, slow_link=True)
    for s in WRAPPERS:
        refused(results[s], "ours", 0, "shared.", "twice", "use_reentrant=False", "static_graph")
        refused(results[s], "ddp", 0, "mark a variable ready only once")
    for s in ("manual", "manual_flat"):  # after backward, nothing can fire twice
        assert max(max(r["vs_ref"]) for r in results[s]) < TOL


@pytest.mark.parametrize("strategy", [ONE_BUCKET, PER_PARAM])
def test_1_static_graph_counts_the_hooks_and_equals_torch(cluster, strategy):
    opt = {"static_graph": True}
    results = run(cluster, "reused_in_checkpoint", [strategy], ours_kw=opt, torch_kw=opt,
                  slow_link=True)
    trains_like_torch(results[strategy], 4, what=strategy)


# 2 -------------------------------------------------------------------------------------------
def test_2_a_forward_after_a_backward_that_broke_off_is_refused_as_in_torch(cluster):
    results = run(cluster, "fails_mid_backward", ALL, slow_link=True)
    for s in WRAPPERS:
        refused(results[s], "ours", 2, "previous backward stopped", "fc1.weight",
                "wrap the module again")
        refused(results[s], "ddp", 2, "Expected to have finished reduction")
        for r in results[s]:  # steps 0 and 1 (the exception, no update) were exact
            assert len(r["vs_ref"]) == 2 and max(r["vs_ref"]) < TOL
    for s in ("manual", "manual_flat"):  # nothing in flight: the loop goes on, exactly
        for r in results[s]:
            assert "ours" not in r["errors"] and len(r["vs_ref"]) == 4
            assert max(r["vs_ref"]) < TOL


@pytest.mark.slow
def test_2_an_exception_before_any_gradient_leaves_nothing_in_flight_and_training_goes_on(cluster):
    results = run(cluster, "fails_before_any_hook", ALL, slow_link=True)
    for s in ALL:  # as in torch: nothing was launched, so nothing to refuse
        trains_like_torch(results[s], 4, what=s)


# 3 -------------------------------------------------------------------------------------------
def test_3_overlap_detects_ranks_launching_in_different_orders(cluster):
    results = run(cluster, "data_dependent_order", ALL)
    refused(results["overlap"], "ours", 0, "different orders", "rank 0: b.", "rank 1: a.",
            "BucketedDDP")
    for s in ("manual", "manual_flat", ONE_BUCKET, PER_PARAM):  # fixed order: exact
        trains_like_torch(results[s], 4, what=s)


# 4 -------------------------------------------------------------------------------------------
def test_4_reentrant_checkpoint_around_the_last_layers_equals_torch(cluster):
    results = run(cluster, "checkpointed_tail", ALL)
    for s in ALL:
        trains_like_torch(results[s], 4, what=s)


# 5 -------------------------------------------------------------------------------------------
def test_5_two_forwards_before_one_backward_keep_the_buffers_valid(cluster):
    results = run(cluster, "batchnorm", WRAPPERS)
    for s in WRAPPERS:  # vs torch also compares the buffers
        trains_like_torch(results[s], 4, what=s)


# 6 -------------------------------------------------------------------------------------------
def test_6_ranks_evaluating_different_numbers_of_batches_under_no_grad_go_on(cluster):
    results = run(cluster, "batchnorm_eval", WRAPPERS)
    for s in WRAPPERS:
        trains_like_torch(results[s], 4, what=s)
        for r in results[s]:  # the evaluation itself also saw torch's buffers
            assert max(r["eval_diff"]) < TOL


# 7 -------------------------------------------------------------------------------------------
def test_7_find_unused_parameters_finds_tensors_in_a_dataclass_output(cluster):
    opt = {"find_unused_parameters": True}
    strategies = [ONE_BUCKET, PER_PARAM]
    results = run(cluster, "dataclass_out", strategies, ours_kw=opt, torch_kw=opt)
    for s in strategies:
        trains_like_torch(results[s], 4, what=s)


def _output_not_in_the_loss():
    import torch
    from torch import nn

    from ddplab.sync import BucketedDDP

    torch.manual_seed(0)
    ddp = BucketedDDP(C.DataclassOut().double(), bucket_cap_mb=1 / MB, find_unused_parameters=True)
    x, y = C.batch("dataclass_out", 0, 8, 2)
    try:
        nn.functional.mse_loss(ddp(x).value, y).backward()  # aux is in the graph, not the loss
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_7_an_output_left_out_of_the_loss_is_explained_without_the_wrong_advice(cluster2):
    for message in cluster2.run(_output_not_in_the_loss):
        assert "aux_head.weight" in message and "got no gradient" in message
        assert "find_unused_parameters=True is set" in message
        assert "every output of forward take part in the loss" in message


# 8 -------------------------------------------------------------------------------------------
def test_8_sparse_embedding_gradients_are_reduced_like_torch(cluster):
    results = run(cluster, "sparse", ALL)
    for s in ALL:
        trains_like_torch(results[s], 4, what=s)
