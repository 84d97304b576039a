"""torch DDP, the reference reducers and a learner's code, drawn from the observing process group.

compare() draws ddplab's full strategies from their own stamps, and everything
else from outside: a GroupRecorder on the rank's process group turns each
iteration's all-reduces into buckets, and the simulated link sits on the same
group. These tests check that what is drawn that way is what ran: the same bytes
as ddplab's own counting, torch's own bucket sizes, the link paid by every row, the
order of launches against backward, and a clear error where the group is not observed.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
from _exercise_solutions import MyBucketedDDP, MyOverlapDDP, my_average_gradients

import ddplab
from ddplab.measure import compare
from ddplab.netsim import LinkModel
from ddplab.sync import core

DRAWN = "observing process group"


class WaitsInBackwardAndAfter(core.OverlapDDP):
    """Waits in a callback queued inside backward, and has an (empty) finish too: the
    grader allows either, and the drawn wait must begin inside loss.backward()."""

    def finish_gradient_synchronization(self):
        pass


@pytest.fixture(scope="module")
def drawn(session_cluster2):
    session_cluster2.ensure_ready()
    yours = [ddplab.as_strategy("yours_manual", my_average_gradients),
             ddplab.as_strategy("yours_overlap", MyOverlapDDP, shape="per_parameter"),
             ddplab.as_strategy("yours_bucketed", MyBucketedDDP, 0.5, shape="buckets"),
             ddplab.as_strategy("yours_both", WaitsInBackwardAndAfter, shape="per_parameter")]
    return compare(session_cluster2, ["manual", "core_manual", yours[0].name, "core_overlap",
                                      yours[1].name, "bucketed", "core_bucketed", yours[2].name,
                                      "ddp", yours[3].name],
                   steps=3, n_params=1e6, bucket_cap_mb=0.5, link="10gbe")


@pytest.mark.slow
def test_each_row_says_where_it_was_drawn_and_all_send_the_same_bytes(drawn):
    m = drawn.metrics
    for name, row in m.items():
        assert row["comm_path"] == ("ddplab.sync.comm" if name in ("manual", "bucketed") else DRAWN)
        assert row["ranks_agree"], name
    # counted at the group (torch DDP: on its timed copy, which records nothing) and at
    # ddplab's choke point: one gradient's worth of bytes per step, everywhere
    assert len({row["comm_bytes_per_step"] for row in m.values()}) == 1, \
        {n: row["comm_bytes_per_step"] for n, row in m.items()}
    assert m["ddp"]["comm_bytes_per_step"] > 0
    assert "observing process group: core_manual" in ddplab.measure.report.table(drawn)


@pytest.mark.slow
def test_per_parameter_rows_launch_one_all_reduce_per_parameter_and_buckets_match_torch(drawn):
    m = drawn.metrics
    per_param = {m[n]["n_buckets"] for n in ("manual", "core_manual", "yours_manual",
                                              "core_overlap", "yours_overlap")}
    assert len(per_param) == 1 and per_param.pop() > 3
    # the same cap gives the same buckets: torch's rule in the full and reference
    # reducers, assign_buckets in the learner's class
    assert m["core_bucketed"]["n_buckets"] == m["ddp"]["n_buckets"] == m["bucketed"]["n_buckets"] \
        == m["yours_bucketed"]["n_buckets"] > 1
    last = max(b.iteration for b in drawn.timelines["ddp"].buckets)

    def sizes(name):
        return [b.nbytes for b in drawn.timelines[name].buckets if b.iteration == last and b.rank == 0]

    # what the group was handed by torch's C++ reducer is torch's own rebuilt layout
    layout = [b["nbytes"] for b in drawn.timelines["ddp"].meta["bucket_layout"]]
    assert sizes("ddp") == layout == sizes("core_bucketed") == sizes("bucketed")
    flags = {it.iteration: it.flags for it in drawn.timelines["ddp"].iterations if it.rank == 0}
    assert "ddp_one_bucket" in flags[0]


@pytest.mark.slow
def test_launches_seen_at_the_group_are_ordered_against_backward(drawn):
    for name in ("core_manual", "yours_manual", "core_overlap", "yours_overlap", "core_bucketed",
                 "yours_bucketed", "ddp"):
        tl = drawn.timelines[name]
        for it in tl.iterations:
            if it.flags:
                continue
            ours = [b for b in tl.buckets if b.rank == it.rank and b.iteration == it.iteration]
            assert ours, (name, it.iteration)
            back_start = it.phases["backward"][0]
            ends_backward = max(b.grads_ready for b in ours if b.grads_ready is not None)
            for b in ours:
                assert back_start <= b.launch <= b.comm_end, (name, b)
            if name.endswith("manual"):  # after backward: nothing launches during it
                assert min(b.launch for b in ours) >= it.phases["backward"][1] - 1e-4, name
            else:  # from the hooks: the first bucket leaves before the last gradient is ready
                assert min(b.launch for b in ours) < ends_backward, name


@pytest.mark.slow
def test_a_wait_inside_backward_is_drawn_as_wait_whatever_follows_it(drawn):
    # Both rows wait for their all-reduces in a callback queued inside loss.backward();
    # yours_both also has a finish_gradient_synchronization, called after it. The drawn
    # wait starts where backward's compute ended (the last gradient ready), before the
    # all-reduces end, in both; drawn otherwise, backward would swallow the wait.
    for name in ("core_overlap", "yours_both"):
        tl = drawn.timelines[name]
        for it in tl.iterations:
            if it.flags:
                continue
            ours = [b for b in tl.buckets if b.rank == it.rank and b.iteration == it.iteration]
            wait, back = it.phases["wait"], it.phases["backward"]
            # a "done" stamp is taken by a callback that runs after the work completed, so on
            # a loaded machine it may trail the end of the wait by a few milliseconds
            assert back[1] == wait[0] < max(b.comm_end for b in ours) <= wait[1] + 0.05, name
        assert drawn.metrics[name]["exposed_comm_ms"] > 0, name


@pytest.mark.slow
def test_the_link_on_the_group_delays_every_row(drawn):
    link = LinkModel.preset("10gbe")
    for name, tl in drawn.timelines.items():
        ends = [b for b in tl.buckets if b.sources.get("comm_end") == "simulated"]
        for b in ends:  # the model decided the end: no earlier than its transfer time
            assert b.comm_end - b.comm_start >= link.allreduce_seconds(b.nbytes, 2) - 1e-4, name
        floor = 1000 * link.allreduce_seconds(drawn.metrics[name]["comm_bytes_per_step"], 2)
        assert drawn.metrics[name]["step_ms"] >= floor, name


def _imported_name_over_a_link(nbytes):
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed import all_reduce  # bound before the link exists

    from ddplab.netsim.simulated import OnGroup, SimulatedLink
    from ddplab.pg.group import observing_group
    from ddplab.sync import comm

    t = torch.ones(nbytes // 4)
    sub = dist.new_group([0, 1])  # a subgroup made before the link: an observing group too
    link = SimulatedLink(LinkModel(0.1, 50.0, "100 Mbit/s"), 2)
    with link, comm.using_link(link):
        inside = sum(isinstance(o, OnGroup) for o in observing_group().observers)
        t0 = time.perf_counter()
        all_reduce(t)
        linked = time.perf_counter() - t0
        t0 = time.perf_counter()
        all_reduce(t, group=sub)
        on_sub = time.perf_counter() - t0
    after = sum(isinstance(o, OnGroup) for g in (observing_group(), sub) for o in g.observers)
    dist.destroy_process_group(sub)
    return {"linked": linked, "on_sub": on_sub, "model": link.model.allreduce_seconds(nbytes, 2),
            "inside": inside, "after": after, "sum": float(t[0])}


@pytest.mark.slow
def test_a_name_imported_before_the_link_still_pays_it(cluster2):
    for r in cluster2.run(_imported_name_over_a_link, 2**20):
        assert r["inside"] == 1 and r["after"] == 0
        assert r["sum"] == 4.0  # the real all-reduces ran, twice
        assert r["linked"] >= r["model"] - 1e-3 and r["on_sub"] >= r["model"] - 1e-3, r


def test_as_strategy_says_what_it_takes():
    from ddplab.sync.registry import get_strategy, unregister_strategy

    with pytest.raises(TypeError, match="a function of the model or a wrapper class"):
        ddplab.as_strategy("mine", 3)
    with pytest.raises(ValueError, match="already a strategy"):
        ddplab.as_strategy("ddp", my_average_gradients)
    with pytest.raises(ValueError, match="records itself: compare it by its registered name"):
        ddplab.as_strategy("mine", ddplab.OverlapDDP)  # it also all-reduces bookkeeping
    try:
        ddplab.as_strategy("mine", my_average_gradients)
        s = ddplab.as_strategy("mine", MyOverlapDDP, shape="per_parameter")  # the cell run again
        assert get_strategy("mine") is s and s.shape == "per_parameter"
        assert not s.accepts("recorder")
    finally:
        unregister_strategy("mine")


@pytest.mark.slow
@pytest.mark.more
def test_a_plain_process_group_is_refused_saying_what_to_do(tmp_path):
    code = f"""
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
from ddplab.measure import RunSpec
from ddplab.measure.compare import run_on_rank
try:
    run_on_rank(RunSpec("manual,ddp", steps=1, n_params=1e4, world_size=1))
except RuntimeError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "ddp is drawn from the observing process group" in out.stdout
    assert "ddplab.init_from_env()" in out.stdout
