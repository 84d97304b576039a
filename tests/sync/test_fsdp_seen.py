"""FSDP seen from the observing process group: what travels when, and how many bytes.

The GroupRecorder watches the group while one training step runs under the
registry's ``fsdp``, ``torch_fsdp2`` and ``ddp`` strategies, and reports every
collective (op, forward or backward, payload bytes) with each rank's ring
bytes. Every weight's size divides by 2 and 3, so no shard is padded and the
ratio is exact: FSDP's all-gather + all-gather + reduce-scatter send 1.5x
what DDP's all-reduce sends.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddplab.sync.registry import build_strategy, strategy_names
from ddplab.timeline.on_group import GroupRecorder
from ddplab.timeline.recorder import Recorder

# Live ranks, several runs each: make check (test-unit-more), not make test-fast or test-unit.
pytestmark = [pytest.mark.slow, pytest.mark.more]
FLOATS = 2 * (12 * 12 + 12) + 12 * 6 + 6  # every weight and bias divides by 2 and 3


def _one_step(name):
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                          nn.Linear(12, 6))
    built = build_strategy(name, model)
    rec = Recorder(name, rank, ws)
    watch = GroupRecorder(rec, model.parameters())
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(rank))
    rec.begin_iteration(0)
    with watch.watching():
        built.model(x).square().mean().backward()
        if built.after_backward is not None:
            built.after_backward()
        end = watch.end_iteration()
    rec.end_iteration()
    drawn = [(b.params, b.launch is not None, b.comm_end is not None)
             for b in rec.result().buckets]
    return end["calls"], end["ring_bytes"], end["nbytes"], drawn


@pytest.mark.parametrize("world", ["cluster2", "cluster3"])
def test_fsdp_sends_one_and_a_half_times_ddps_bytes_counted_at_the_group(world, request):
    cluster = request.getfixturevalue(world)
    ws = cluster.world_size
    ours = cluster.run(_one_step, "fsdp")
    ddp = cluster.run(_one_step, "ddp")
    theirs = cluster.run(_one_step, "torch_fsdp2")
    for rank in range(ws):
        calls, ring, _, drawn = ours[rank]
        # per layer: an all-gather in forward, another before its backward, a reduce-scatter;
        # the first layer's input needs no gradient, so (as in fully_shard) its reduce-scatter
        # waits for backward's final callback
        assert [c[:2] for c in calls] == (
            [("all_gather_into_tensor", "forward")] * 3
            + [("all_gather_into_tensor", "backward"), ("reduce_scatter_tensor", "backward")] * 2
            + [("all_gather_into_tensor", "backward"), ("reduce_scatter_tensor", "after backward")])
        assert sum(c[2] for c in calls if c[0] == "reduce_scatter_tensor") == 4 * FLOATS
        assert sum(c[2] for c in calls if c[0] == "all_gather_into_tensor") == 2 * 4 * FLOATS // ws
        ddp_calls, ddp_ring, ddp_handed, _ = ddp[rank]
        assert [c[0] for c in ddp_calls] == ["all_reduce"] and ddp_handed == 4 * FLOATS
        assert ddp_ring == pytest.approx(2 * (ws - 1) / ws * 4 * FLOATS)
        assert ring == pytest.approx(1.5 * ddp_ring)  # the counted claim
        # every collective is drawn as a bar with its op and pass, launched and done
        assert drawn == [(c[:2], True, True) for c in calls]
        # torch's fully_shard makes the same calls with the same bytes, in its own order:
        # it prefetches the next layer's all-gather before reduce-scattering this one's,
        # and reduce-scatters the first layer in backward's final callback
        t_calls, t_ring, _, _ = theirs[rank]
        assert sorted((c[0], c[2]) for c in t_calls) == sorted((c[0], c[2]) for c in calls)
        assert t_calls[-1][:2] == ("reduce_scatter_tensor", "after backward")
        assert t_ring == pytest.approx(ring)


def test_the_sharded_strategies_are_registered_with_a_line_each():
    from ddplab.sync.registry import get_strategy

    assert {"fsdp", "torch_fsdp2"} <= set(strategy_names())
    assert get_strategy("fsdp").accepts("compute_dtype")
    assert "all-gather" in get_strategy("fsdp").description
    assert "fully_shard" in get_strategy("torch_fsdp2").description


def test_compare_times_and_draws_fsdp_beside_torch_fully_shard_and_ddp(cluster2):
    from ddplab.measure import RunSpec, compare

    r = compare(cluster2, spec=RunSpec("ddp,fsdp,torch_fsdp2", steps=2, warmup=1, n_params=2e4,
                                       depth=3, batch_size=8, world_size=2))
    m = r.metrics
    for name in ("fsdp", "torch_fsdp2"):
        assert m[name]["ranks_agree"], name  # the full weights, gathered, agree on both ranks
        assert m[name]["step_ms"] > 0
        # no exposed/overlap figure for them: it would measure only the tail after backward
        assert m[name]["exposed_comm_ms"] is None and m[name]["overlap_pct"] is None
        ops = {b.params[0] for b in r.timelines[name].buckets}
        assert ops == {"all_gather_into_tensor", "reduce_scatter_tensor"}
    assert m["fsdp"]["comm_bytes_per_step"] == m["torch_fsdp2"]["comm_bytes_per_step"]
    assert m["ddp"]["exposed_comm_ms"] is not None
    from ddplab.measure.report import table

    assert "fsdp, torch_fsdp2: all-gathers in the forward too" in table(r)


def _reduce_scatter_future():
    out, inp = torch.empty(2), torch.ones(2 * dist.get_world_size())
    work = dist.reduce_scatter_single(out, inp, async_op=True)
    try:
        work.get_future()
        has_future = True
    except RuntimeError:
        has_future = False
    work.wait()
    return has_future, out.tolist()


def test_gloos_reduce_scatter_has_no_future_so_its_end_is_stamped_at_its_wait(cluster2):
    for has_future, out in cluster2.run(_reduce_scatter_future):
        assert not has_future and out == [2.0, 2.0]
