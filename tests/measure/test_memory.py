"""Memory per rank is read from the tensors a rank holds (ddplab.measure.memory), and the
picture draws exactly those numbers (ddplab.widgets.memory)."""
from __future__ import annotations

import pytest
import torch

from ddplab.measure.memory import LiveBytes, measure_rank, storage_bytes
from ddplab.widgets.memory import memory_figure, memory_table

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test


def test_live_bytes_counts_what_ops_make_and_forgets_what_is_freed():
    with LiveBytes() as live:
        a = torch.ones(1000)  # 4000 bytes
        b = a.view(10, 100)  # a view: the same storage, counted once
        c = a * 2  # 4000 more
        assert live.now == 8000 and live.peak == 8000
        del a, b
        assert live.now == 4000  # a's storage is freed with its last view; c is alive
        live.reset_peak()
        del c
        d = torch.ones(10, dtype=torch.float64)
        assert live.now == 80 and live.peak == 4000  # the peak since the reset: c alone
    assert d.numel() == 10


def test_a_shared_storage_counts_once():
    t = torch.zeros(100)
    assert storage_bytes([t, t[:10], t.view(10, 10), None]) == 400


def _both():
    return {row: measure_rank(row, steps=1) for row in ("ddp", "zero1", "torch_zero")}


def test_zero1_shares_the_optimizer_state_and_keeps_parameters_and_gradients_whole(cluster2):
    ranks = cluster2.run(_both)
    ddp = ranks[0]["ddp"]
    assert ranks[1]["ddp"] == ddp  # every DDP rank holds the same
    for row in ("zero1", "torch_zero"):
        # together the ranks hold the state one DDP rank holds alone
        assert sum(r[row]["optimizer_state"] for r in ranks) == ddp["optimizer_state"]
        for r in ranks:
            assert r[row]["params"] == ddp["params"] and r[row]["grads"] == ddp["grads"]
            assert r[row]["optimizer_state"] < ddp["optimizer_state"]
            assert r[row]["peak"] < ddp["peak"]  # the state is part of the peak
    # Adam: two state tensors as large as the parameters (plus a 4-byte step per parameter)
    assert ddp["optimizer_state"] == 2 * ddp["params"] + 4 * 8
    assert ddp["peak"] > ddp["params"] + ddp["grads"] + ddp["optimizer_state"]


def test_the_picture_draws_the_largest_rank_of_each_row():
    results = [{"row": "ddp", "world_size": 2, "rank": r, "params": 100, "grads": 100,
                "optimizer_state": 200, "peak": 500} for r in (0, 1)]
    results += [{"row": "zero1", "world_size": 2, "rank": r, "params": 100, "grads": 100,
                 "optimizer_state": s, "peak": 400} for r, s in ((0, 120), (1, 80))]
    fig = memory_figure(results)
    state = next(t for t in fig.data if t.name == "optimizer state")
    assert [v * 2 ** 20 for v in state.y] == [200, 120]
    assert "zero1" in memory_table(results)


def _sent(steps):
    return measure_rank("ddp", steps=steps)["sent_by_op"]


def test_ddp_broadcasts_its_rebuilt_bucket_layout_in_step_two_only(cluster2):
    """Why measure_rank counts the third step: the second carries DDP's one-off broadcast."""
    second, third = cluster2.run(_sent, 2)[0], cluster2.run(_sent, 3)[0]
    assert 0 < second.get("broadcast", 0) < 1000 and "broadcast" not in third
    assert second["all_reduce"] == third["all_reduce"]


def _sharded(rows=("ddp", "fsdp", "torch_fsdp2")):
    return {row: measure_rank(row, steps=1) for row in rows}


def _full_sizes():
    """The default model's parameters, numel and first dim each, from a fresh copy."""
    from ddplab.measure.memory import default_model

    return [(p.numel(), p.shape[0]) for p in default_model().parameters()]


def _shard_bytes(sizes, ws, rank, row):
    """Bytes of ``rank``'s shard, worked out here from the model's sizes: ddplab's FSDP keeps
    ceil(numel / ws) elements of each flattened weight (the last piece padded); fully_shard
    keeps ceil(rows / ws) rows on dim 0 (padded to that in its storage)."""
    if row == "fsdp":
        return sum(-(-n // ws) * 4 for n, _ in sizes)
    return sum(-(-rows // ws) * (n // rows) * 4 for n, rows in sizes)


def test_fsdp_holds_its_shard_of_parameters_gradients_and_state(cluster2):
    ranks, sizes = cluster2.run(_sharded), _full_sizes()
    full = sum(n for n, _ in sizes) * 4
    assert ranks[0]["ddp"]["params"] == full
    layer = sizes[0][0] * 4 + sizes[1][0] * 4  # one Linear's weight and bias, gathered
    for rank, got in enumerate(ranks):
        for row in ("fsdp", "torch_fsdp2"):
            m = got[row]
            assert m["params"] == m["grads"] == _shard_bytes(sizes, 2, rank, row) == full // 2
            assert m["optimizer_state"] == 2 * m["params"] + 4 * len(sizes)  # Adam, per shard
            # the peak holds the shards, their gradients and state, and a layer gathered whole
            assert m["peak"] > m["params"] + m["grads"] + m["optimizer_state"] + layer
            assert m["peak"] < got["ddp"]["peak"]
            assert m["sent_by_op"]["all_gather_into_tensor"] == full  # forward + backward
            assert m["sent_by_op"]["reduce_scatter_tensor"] == full


def test_live_bytes_follows_a_storage_resized_in_place():
    """FSDP frees a gathered weight with ``untyped_storage().resize_(0)``: the count follows."""
    with LiveBytes() as live:
        a = torch.ones(1000)
        a.untyped_storage().resize_(0)
        b = torch.ones(10)
        # counted at its size when first seen, b's op would have made 4040 bytes the peak
        assert live.now == 40 and live.peak == 4000
    assert b.numel() == 10


def test_n_ranks_of_a_larger_cluster_hold_and_send_what_a_cluster_of_n_does(cluster1, cluster2, cluster3):
    """measure_sizes measures a world size N below the cluster's on a group of its first N
    ranks: every row's held and sent bytes equal to N ranks of their own."""
    from ddplab.measure.memory import ROWS, measure_on, measure_sizes

    rows = tuple(ROWS)  # ddp, zero1, torch_zero, zero2, fsdp, torch_fsdp2
    got = measure_sizes(cluster3, rows, (1, 2, 3))
    assert {(m["world_size"], m["row"]) for m in got} == {(n, r) for n in (1, 2, 3) for r in rows}
    assert sorted(m["rank"] for m in got if m["world_size"] == 2 and m["row"] == "ddp") == [0, 1]
    for alone in (cluster1, cluster2):
        n = alone.world_size
        want = {(m["row"], m["rank"]): m for m in measure_on(alone, rows)}
        grouped = {(m["row"], m["rank"]): m for m in got if m["world_size"] == n}
        assert grouped.keys() == want.keys()
        for key, m in want.items():
            for field in ("params", "grads", "optimizer_state", "sent_by_op"):
                assert grouped[key][field] == m[field], (n, key, field, grouped[key][field], m[field])
            # not the peak: it varies from run to run by up to a layer (a gloo work may keep
            # its input alive past the next op: 257 KiB of 3.3 MB seen under FSDP, 14 % under
            # ZeRO-2 on a tiny model), in a group and alone alike
            assert grouped[key]["peak"] >= grouped[key]["params"], (n, key)
    with pytest.raises(ValueError, match="start a Cluster of 4"):
        measure_sizes(cluster3, rows, (2, 4))
