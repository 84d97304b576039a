"""The what-if predictor on synthetic recordings whose answers are worked out by hand.

The recording: 2 ranks, four 1 MiB gradients ready after 1, 2, 3 and 4 ms of backward
work (parameters 3, 2, 1, 0: a stack of layers), two 2 MiB buckets, a link on which
2 MiB takes exactly 1 ms at 2 ranks (no latency), and compute running 2x slower while
an all-reduce is in flight (c = 1). So the first bucket's all-reduce (4..5 ms) stretches
the rest of backward by 0.5 ms, and the wall-clock stamps are 3, 4, 5.5, 6.5 ms.
"""
import pytest

from ddplab.measure.profile import read_profile
from ddplab.measure.whatif import choose_cap, exposed_buckets, predict, wall_after
from ddplab.netsim.link import LinkModel
from ddplab.timeline.metrics import summarize
from ddplab.timeline.records import BucketRecord, GradRecord, IterationRecord, Timeline
from ddplab.widgets.gantt import run_labels

MiB = 2 ** 20
MS = 1e-3
# 2 MiB in 1 ms at 2 ranks: 2(p-1)/p * n / bandwidth = n / bandwidth
LINK = LinkModel(2 * MiB / MS * 8 / 1e9, 0.0, "test link")


def recording(world_size=2, grads=True, names=False, iterations=(1, 2, 3)):
    tl = Timeline("ddp", world_size, meta={"simulated_link": LINK.describe()})
    ready = {3: 3.0, 2: 4.0, 1: 5.5, 0: 6.5}  # ms from the step's start
    comm = [(4.0, 5.0), (6.5, 7.5)] if world_size > 1 else [(4.0, 4.0), (6.5, 6.5)]
    for i in iterations:
        t = 100.0 * i
        for r in range(world_size):
            phases = {"forward": (t, t + 2), "backward": (t + 2, t + 6.5),
                      "wait": (t + 6.5, t + comm[1][1]), "step": (t + comm[1][1], t + comm[1][1] + 1)}
            tl.iterations.append(IterationRecord(r, i, t * MS, (t + comm[1][1] + 1) * MS,
                                                 {k: (a * MS, b * MS) for k, (a, b) in phases.items()}))
            for k, params in enumerate(((3, 2), (1, 0))):
                last = max(ready[p] for p in params)
                tl.buckets.append(BucketRecord(
                    r, i, k, 2 * MiB, tuple(f"layer{p}" for p in params) if names else params,
                    (t + min(ready[p] for p in params)) * MS, (t + last) * MS, (t + last) * MS,
                    (t + comm[k][0]) * MS, (t + comm[k][1]) * MS))
            if grads:
                tl.grads += [GradRecord(r, i, p, MiB, (t + at) * MS) for p, at in ready.items()]
    return tl


def baseline(backward_ms=4.0):
    """A compute-only run: the same backward with nothing in flight."""
    return Timeline("none", 2, iterations=[IterationRecord(0, 1, 0.0, 7 * MS, {
        "forward": (0.0, 2 * MS), "backward": (2 * MS, (2 + backward_ms) * MS)})])


def ms(tl):
    return summarize(tl)


def test_wall_after_runs_slower_only_while_communication_is_in_flight():
    assert wall_after(1.0, 0.0, [], 1.0) == 1.0
    assert wall_after(2.0, 0.0, [(1.0, 2.0)], 1.0) == pytest.approx(2.5)  # 1 + 0.5 in flight + 1
    assert wall_after(0.25, 1.0, [(1.0, 2.0)], 3.0) == pytest.approx(2.0)


def test_contention_is_measured_against_the_compute_only_baseline():
    prof = read_profile(recording(), baseline())
    assert prof.contention == pytest.approx(1.0)
    assert "2.00x slower" in prof.contention_note
    work = prof.ranks[0].grad_work_s
    assert [work[p] / MS for p in (3, 2, 1, 0)] == pytest.approx([1, 2, 3, 4])
    assert prof.ready_order == [3, 2, 1, 0]
    assert prof.ranks[1].backward_work_s == pytest.approx(4 * MS)


def test_without_a_baseline_contention_is_said_to_be_unmeasured():
    prof = read_profile(recording())
    assert prof.contention == 0.0 and "not measured" in prof.contention_note


def test_replaying_the_recorded_buckets_gives_back_the_recorded_step():
    tl = predict(recording(), baseline=baseline())
    assert ms(tl)["step_ms"] == pytest.approx(8.5)
    assert ms(tl)["exposed_comm_ms"] == pytest.approx(1.0)
    assert [b.comm_end / MS for b in tl.buckets_of(0, 0)] == pytest.approx([5.0, 7.5])


def test_one_bucket_waits_for_all_of_backward():
    tl = predict(recording(), bucket_cap_mb=float("inf"), baseline=baseline())
    (b,) = tl.buckets_of(1, 0)
    assert (b.grads_ready / MS, b.comm_start / MS, b.comm_end / MS) == pytest.approx((6, 6, 8))
    assert ms(tl)["step_ms"] == pytest.approx(9.0)
    # taking wall time as work (contention ignored) books the recorded slowdown twice
    assert ms(predict(recording(), bucket_cap_mb=float("inf"), contention=0))["step_ms"] \
        == pytest.approx(9.5)


def test_small_buckets_overlap_and_slow_backward_while_in_flight():
    tl = predict(recording(), bucket_cap_mb=1, baseline=baseline())
    bs = tl.buckets_of(0, 0)
    assert [len(b.params) for b in bs] == [1, 1, 1, 1]
    assert [b.comm_start / MS for b in bs] == pytest.approx([3, 4.25, 5.5, 6.75])
    assert tl.iteration(0, 0).phases["backward"][1] / MS == pytest.approx(6.75)
    assert ms(tl)["step_ms"] == pytest.approx(8.25)
    assert ms(tl)["exposed_comm_ms"] == pytest.approx(0.5)


def test_more_ranks_cost_the_ring_share_of_the_bytes():
    tl = predict(recording(), world_size=4, baseline=baseline())
    assert tl.world_size == 4 and len(tl.iterations) == 4
    b0, b1 = tl.buckets_of(3, 0)
    assert (b0.comm_end - b0.comm_start) / MS == pytest.approx(1.5)  # 2*3/4 of 2 MiB
    assert b1.comm_start / MS == pytest.approx(6.75)
    assert ms(tl)["step_ms"] == pytest.approx(9.25)


def test_a_straggler_makes_the_other_ranks_wait():
    tl = predict(recording(), straggler=(1, 2.0), contention=0)
    m = ms(tl)
    assert m["step_ms"] == pytest.approx(16.0)
    assert m["wait_ms_by_rank"] == pytest.approx({0: 7.5, 1: 1.0})
    exposed = exposed_buckets(tl)
    assert [e["rank"] for e in exposed] == [0, 0]
    assert all(e["why"] == "waited for rank 1 to launch it" for e in exposed)
    assert any("straggler: rank 1" in s for s in run_labels(tl))


def test_a_one_rank_recording_predicts_two_ranks_on_a_given_link():
    one = recording(world_size=1)
    one.meta.clear()  # a real link at 1 rank: nothing to learn alpha or bandwidth from
    with pytest.raises(ValueError, match="link="):
        predict(one, world_size=2)
    tl = predict(one, world_size=2, link=LINK, bucket_cap_mb=float("inf"))
    assert ms(tl)["step_ms"] == pytest.approx(9.5)  # ready at 6.5 ms, 4 MiB in 2 ms, 1 ms step
    assert "not measured" in tl.meta["contention_note"]


def test_without_per_parameter_times_buckets_merge_but_never_split():
    tl = predict(recording(grads=False), bucket_cap_mb=float("inf"), baseline=baseline())
    assert ms(tl)["step_ms"] == pytest.approx(9.0)
    small = predict(recording(grads=False), bucket_cap_mb=1, baseline=baseline())
    assert ms(small)["n_buckets"] == 2
    assert "re-bucketed from whole recorded buckets" in small.meta["labels"][0]


def test_choose_cap_names_the_exposed_bucket_and_why():
    answer = choose_cap(recording(), caps_mb=(1, 2, float("inf")), baseline=baseline())
    assert [r["step_ms"] for r in answer["rows"]] == pytest.approx([8.25, 8.5, 9.0])
    assert answer["best"] == 1
    assert "bucket 3 (1.00 MiB) is exposed for 0.50 ms: its last gradient is ready only when " \
           "backward ends" in answer["reason"]
    assert "inf MiB is slower" in answer["reason"]


def test_every_picture_of_a_prediction_says_predicted_and_it_survives_json():
    tl = predict(recording(), link="100gb-ib")
    labels = run_labels(tl)
    assert labels[-1].startswith("PREDICTED from a recording, not measured")
    assert any("SIMULATED link: 100 Gb InfiniBand" in s for s in labels)
    back = Timeline.from_dict(tl.to_dict())
    assert summarize(back)["step_ms"] == pytest.approx(summarize(tl)["step_ms"])


def test_bad_questions_get_errors_that_say_what_to_pass():
    rec = recording()
    with pytest.raises(ValueError, match="straggler must be"):
        predict(rec, straggler=(2, 2.0))
    with pytest.raises(ValueError, match="world_size must be"):
        predict(rec, world_size=0)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive"):
        predict(rec, bucket_cap_mb=-1)
    odd = recording(names=True)
    odd.grads = [g for g in odd.grads if g.param != 0]  # the bytes no longer add up
    with pytest.raises(ValueError, match="give bucket_cap_mb"):
        predict(odd)
    with pytest.raises(ValueError, match="unknown link preset"):
        predict(rec, link="carrier-pigeon")
    with pytest.raises(ValueError, match="no iterations"):
        predict(Timeline("ddp", 2))


def test_over_a_simulated_link_the_slower_of_link_and_real_transfer_sets_the_pace():
    from ddplab.measure.whatif import SlowerOf

    fast, slow = LinkModel(100.0, 0.0), LinkModel(1.0, 1000.0)
    both = SlowerOf(fast, slow)
    assert both.allreduce_seconds(MiB, 2) == slow.allreduce_seconds(MiB, 2)
    assert SlowerOf(slow, fast).allreduce_seconds(8, 4) == slow.allreduce_seconds(8, 4)
    assert both.describe()["simulated"] and both.describe()["fitted"]["bandwidth_gbps"] == 1.0


def test_a_slowdown_the_overlap_cannot_explain_is_capped_and_said():
    prof = read_profile(recording(), baseline(backward_ms=1.0))  # 3.5 ms slower, 1 ms overlapped
    assert prof.contention == pytest.approx(19.0)
    assert "other load on the machine" in prof.contention_note


def test_the_labs_timeline_figure_draws_a_prediction_and_says_predicted():
    from ddplab.widgets.gantt import timeline_figure

    fig = timeline_figure(predict(recording(), bucket_cap_mb=1, baseline=baseline()))
    texts = [a.text for a in fig.layout.annotations]
    assert any("PREDICTED from a recording" in t for t in texts)
    assert fig.layout.title.text.startswith("predicted: ddp")
    assert sum(len(t.x) for t in fig.data if t.x is not None) >= 4 + 2 * 3  # buckets and phases


def test_buckets_that_name_their_parameters_are_matched_to_gradients_by_bytes():
    tl = predict(recording(names=True), baseline=baseline())
    assert [b.params for b in tl.buckets_of(0, 0)] == [("parameter 3", "parameter 2"),
                                                         ("parameter 1", "parameter 0")]
    assert summarize(tl)["step_ms"] == pytest.approx(8.5)


# -- when the what-if says it cannot be trusted (ddplab.measure.whatif.untrusted_reasons) -------

def on_machine(tl, load, cores=2, ranks=2):
    tl.meta["machine"] = {"cores": cores, "load_1m": load, "local_ranks": ranks}
    return tl


def test_a_steady_recording_on_a_machine_with_a_core_per_rank_is_trusted():
    tl = predict(on_machine(recording(iterations=(1, 2, 3, 4, 5)), load=2.0), bucket_cap_mb=4)
    assert tl.meta["whatif"]["trusted"] is True and tl.meta["whatif"]["untrusted"] == []
    assert not any("NOT TRUSTED" in lab for lab in run_labels(tl))
    # no load figure at all (a recording made by compare()): the rule cannot apply
    assert predict(recording(iterations=(1, 2, 3, 4, 5)), bucket_cap_mb=4).meta["whatif"]["trusted"]


def test_fewer_free_cores_than_ranks_while_recording_is_refused_with_the_figures():
    rec = on_machine(recording(), load=3.5)  # 1.5 runnable besides our 2 ranks: 0.5 cores free
    tl = predict(rec, bucket_cap_mb=4)
    why = tl.meta["whatif"]["untrusted"]
    assert tl.meta["whatif"]["trusted"] is False and len(why) == 1
    assert "recorded on a loaded machine: load average 3.5 on 2 cores with 2 ranks of yours, " \
           "about 0.5 cores free for 2 ranks" in why[0]
    assert any("NOT TRUSTED to 10 %" in lab for lab in run_labels(tl))
    picked = choose_cap(rec, caps_mb=(1, 4))
    assert picked["trusted"] is False and picked["untrusted"] == why
    assert all(r["trusted"] is False for r in picked["rows"])
    assert picked["reason"].startswith("NOT TRUSTED to 10 %")
    # the rule is "free cores < ranks - 0.5": half a core of other work is allowed
    assert predict(on_machine(recording(), load=2.5), bucket_cap_mb=4).meta["whatif"]["trusted"]
    assert not predict(on_machine(recording(), load=2.51), bucket_cap_mb=4).meta["whatif"]["trusted"]
    assert predict(on_machine(recording(), load=16.4, cores=16), bucket_cap_mb=4).meta["whatif"]["trusted"]


def test_a_recording_whose_own_steps_vary_more_than_ten_percent_is_refused():
    rec = on_machine(recording(iterations=(1, 2, 3, 4, 5)), load=1.0)
    for it in rec.iterations:
        if it.iteration in (4, 5):  # two steps 3 ms longer at the end (the optimizer waited)
            it.end += 3 * MS
    why = predict(rec, bucket_cap_mb=4).meta["whatif"]["untrusted"]
    assert len(why) == 1 and why[0].startswith("the recording's own steps varied by")
    assert "more than the 10 % a prediction is held to" in why[0]


def test_a_slowdown_the_overlap_cannot_explain_makes_the_prediction_untrusted():
    tl = predict(recording(), baseline=baseline(backward_ms=1.0), bucket_cap_mb=4)
    assert tl.meta["whatif"]["trusted"] is False
    assert "other load on the machine" in tl.meta["whatif"]["untrusted"][0]


def test_under_a_compressing_comm_hook_each_bucket_costs_what_went_on_the_wire():
    # the same recording, with fp16_compress_hook's wire bytes: every bucket half its held bytes
    half = recording()
    for b in half.buckets:
        b.wire_nbytes = b.nbytes // 2
    full = predict(recording(), bucket_cap_mb=float("inf"), link=LINK, baseline=baseline())
    tl = predict(half, bucket_cap_mb=float("inf"), link=LINK, baseline=baseline())
    (b,), (f,) = tl.buckets_of(0, 0), full.buckets_of(0, 0)
    assert (f.comm_end - f.comm_start) / MS == pytest.approx(2.0)  # 4 MiB held, all of it sent
    assert (b.comm_end - b.comm_start) / MS == pytest.approx(1.0)  # half of it on the wire
    assert b.nbytes == f.nbytes == 4 * MiB  # the bucket still holds what it held
    label = " ".join(run_labels(tl))
    assert "wire/held ratio 0.500" in label and "wire/held" not in " ".join(run_labels(full))
