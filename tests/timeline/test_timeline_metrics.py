"""Metrics on hand-built timelines whose answers are known; the link model's arithmetic."""
import json
import math

import pytest

from ddplab.netsim import LinkModel, LinkQueue
from ddplab.timeline import BucketRecord, IterationRecord, Timeline, add_saved_ms, summarize, to_chrome_trace
from ddplab.timeline.metrics import intersection_length, union


def synthetic(strategy="bucketed", straggler_delay=0.0, flags_first=True):
    """2 ranks, 3 iterations of 100 ms: backward 20..80 ms; two buckets.

    bucket 0 in flight 50..70 ms (inside backward), bucket 1 70..90 ms
    (10 ms after backward). Rank 1 may be a straggler: its backward ends later
    and every all-reduce ends when the straggler joins.
    """
    tl = Timeline(strategy, 2)
    for i in range(3):
        t0 = i * 0.1
        for r in range(2):
            d = straggler_delay if r == 1 else 0.0
            it = IterationRecord(r, i, start=t0, end=t0 + 0.1 + straggler_delay,
                                 phases={"forward": (t0, t0 + 0.02),
                                         "backward": (t0 + 0.02, t0 + 0.08 + d),
                                         "step": (t0 + 0.09 + straggler_delay, t0 + 0.1 + straggler_delay)})
            if i == 0 and flags_first:
                it.flags.add("warmup")
            tl.iterations.append(it)
            tl.buckets.append(BucketRecord(r, i, 0, 1000, ("fc2.weight",), grads_ready=t0 + 0.05,
                                           launch=t0 + 0.05, comm_end=t0 + 0.07 + straggler_delay))
            tl.buckets.append(BucketRecord(r, i, 1, 3000, ("fc1.weight",), grads_ready=t0 + 0.07,
                                           launch=t0 + 0.07, comm_end=t0 + 0.09 + straggler_delay))
    return tl


def test_interval_arithmetic():
    assert union([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]
    assert intersection_length([(0, 3), (2, 4)], [(1, 2.5)]) == pytest.approx(1.5)


def test_exposed_comm_overlap_bytes_and_bandwidth():
    m = summarize(synthetic())
    assert m["iterations_counted"] == 2 and m["iterations_excluded"] == [0]
    assert m["step_ms"] == pytest.approx(100)
    assert m["exposed_comm_ms"] == pytest.approx(10)  # 90 ms end - 80 ms backward end
    assert m["comm_ms"] == pytest.approx(40)
    assert m["overlap_pct"] == pytest.approx(75)  # 30 of 40 ms in flight during backward
    assert m["comm_bytes_per_step"] == 4000 and m["n_buckets"] == 2
    assert m["algbw_GBps"] == pytest.approx(4000 / 0.04 / 1e9)
    assert m["busbw_GBps"] == pytest.approx(m["algbw_GBps"])  # 2(p-1)/p = 1 for p = 2


def test_a_straggler_costs_the_other_rank_waiting_time():
    m = summarize(synthetic(straggler_delay=0.03))
    # rank 0 finished backward at 80 ms but the last all-reduce ends at 120 ms
    assert m["wait_ms_by_rank"][0] == pytest.approx(40)
    assert m["wait_ms_by_rank"][1] == pytest.approx(10)
    assert m["wait_ms_by_rank"][0] > m["wait_ms_by_rank"][1]


def test_saved_ms_is_against_manual():
    s = {"manual": {"step_ms": 150.0}, "bucketed": {"step_ms": 120.0}}
    add_saved_ms(s)
    assert s["bucketed"]["saved_ms"] == 30.0 and s["manual"]["saved_ms"] == 0.0


def test_timeline_round_trips_through_json_and_alignment():
    tl = synthetic()
    back = Timeline.from_dict(json.loads(json.dumps(tl.to_dict())))
    assert summarize(back) == summarize(tl)
    moved = tl.shifted({1: 0.5})
    assert moved.iteration(1, 1).start == pytest.approx(tl.iteration(1, 1).start - 0.5)
    assert moved.buckets_of(1, 1)[0].comm_end == pytest.approx(tl.buckets_of(1, 1)[0].comm_end - 0.5)


def test_chrome_trace_has_a_process_per_rank_and_bucket_args():
    trace = to_chrome_trace(synthetic())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"bucketed rank 0", "bucketed rank 1"}
    comm = [e for e in trace["traceEvents"] if e.get("cat") == "communication"]
    assert len(comm) == 2 * 3 * 2
    first = min(comm, key=lambda e: e["ts"])
    assert first["args"]["bytes"] == 1000 and first["args"]["params"] == ["fc2.weight"]
    assert first["dur"] == pytest.approx(20000)  # microseconds
    json.dumps(trace)


def test_ring_allreduce_model():
    link = LinkModel.preset("10gbe")
    n = 25 * 2**20
    expected = 2 * 20e-6 + n / (10e9 / 8)  # p = 2: 2(p-1)/p = 1
    assert link.allreduce_seconds(n, 2) == pytest.approx(expected)
    four = 6 * 20e-6 + 1.5 * n / (10e9 / 8)
    assert link.allreduce_seconds(n, 4) == pytest.approx(four)
    assert link.allreduce_seconds(n, 1) == 0.0


def test_link_queue_serialises_transfers():
    q = LinkQueue(LinkModel(8.0, 0.0), world_size=2)  # 1 GB/s, no latency
    assert q.schedule(0.0, 10**6) == pytest.approx((0.0, 0.001))
    assert q.schedule(0.0005, 10**6) == pytest.approx((0.001, 0.002))  # waits for the link
    assert q.schedule(0.005, 10**6) == pytest.approx((0.005, 0.006))


@pytest.mark.parametrize("kwargs", [dict(bandwidth_gbps=0, latency_us=1),
                                    dict(bandwidth_gbps=1, latency_us=-1),
                                    dict(bandwidth_gbps=math.nan, latency_us=1)])
def test_bad_link_values(kwargs):
    with pytest.raises(ValueError):
        LinkModel(**kwargs)
    with pytest.raises(ValueError, match="unknown link preset"):
        LinkModel.preset("carrier-pigeon")


def test_grad_records_survive_json_shift_and_merge():
    import json

    from ddplab.timeline import GradRecord, Timeline
    part0 = Timeline("ddp", 2, grads=[GradRecord(0, 1, 3, 16, 1.5)])
    part1 = Timeline("ddp", 2, grads=[GradRecord(1, 1, 3, 16, 2.5, "cuda_event")])
    merged = Timeline.merge([part0, part1])
    back = Timeline.from_dict(json.loads(json.dumps(merged.to_dict())))
    assert back.grads == merged.grads
    moved = back.shifted({0: 1.0, 1: 0.5})
    assert [g.ready for g in moved.grads] == [0.5, 2.0]
    assert [g.source for g in moved.grads] == ["cpu", "cuda_event"]
    # a timeline saved before per-parameter records existed still loads
    old = merged.to_dict()
    del old["grads"]
    assert Timeline.from_dict(old).grads == []
