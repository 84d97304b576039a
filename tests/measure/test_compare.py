"""compare() on real ranks: recorded timelines obey causality, links and stragglers behave."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddplab.measure.compare import compare
from ddplab.netsim import LinkModel


@pytest.fixture
def cluster(cluster2):
    return cluster2  # shared for the session (conftest.py)


@pytest.fixture(scope="module")
def every_strategy(session_cluster2):
    session_cluster2.ensure_ready()
    return compare(session_cluster2, "none,manual,manual_flat,overlap,bucketed,ddp", steps=4,
                   n_params=1e6, bucket_cap_mb=0.5)


@pytest.mark.slow
def test_recorded_stamps_respect_causality(every_strategy):
    for name, tl in every_strategy.timelines.items():
        if name == "none":
            assert not tl.buckets
            continue
        assert tl.buckets, name
        for b in tl.buckets:
            assert b.launch is not None and b.comm_end is not None, (name, b)
            assert b.grads_ready <= b.launch + 1e-6, f"{name}: launched before its grads were ready"
            assert b.comm_end >= b.launch, f"{name}: finished before it was launched"


@pytest.mark.slow
def test_buckets_launch_in_index_order(every_strategy):
    for name in ("bucketed", "ddp"):
        tl = every_strategy.timelines[name]
        for rank in range(2):
            for i in tl.iteration_numbers():
                launches = [b.launch for b in tl.buckets_of(rank, i)]
                assert len(launches) > 1, f"{name}: a 0.5 MB cap must give several buckets"
                assert launches == sorted(launches), f"{name} rank {rank} iteration {i}"


@pytest.mark.slow
def test_clocks_aligned_within_the_reported_bound(every_strategy):
    clock = every_strategy.meta["clock"]
    assert clock["offsets_s"][0] == 0.0
    # one host shares CLOCK_MONOTONIC: the estimate must find ~0 within its bound
    assert abs(clock["offsets_s"][1]) <= clock["bound_s"] + 1e-3
    tl = every_strategy.timelines["bucketed"]
    for i in tl.iteration_numbers():
        ends = [max(b.comm_end for b in tl.buckets_of(r, i)) for r in range(2)]
        # the last all-reduce of a step finishes on both ranks at about the same moment
        assert abs(ends[0] - ends[1]) < 0.05


@pytest.mark.slow
def test_every_strategy_keeps_ranks_in_agreement_and_counts_the_same_bytes(every_strategy):
    m = every_strategy.metrics
    assert all(v["ranks_agree"] for v in m.values())
    payload = {m[n]["comm_bytes_per_step"] for n in ("manual", "manual_flat", "overlap", "bucketed", "ddp")}
    assert len(payload) == 1 and payload.pop() > 0
    assert m["none"]["comm_bytes_per_step"] == 0
    assert m["manual"]["saved_ms"] == 0.0


@pytest.mark.slow
def test_torch_ddp_early_iterations_are_flagged_and_excluded(every_strategy):
    tl = every_strategy.timelines["ddp"]
    assert "ddp_one_bucket" in tl.iteration(0, 0).flags
    assert "ddp_rebuild" in tl.iteration(0, 1).flags
    assert len(tl.buckets_of(0, 0)) == 1 and len(tl.buckets_of(0, 2)) > 1
    assert {0, 1} <= set(every_strategy.metrics["ddp"]["iterations_excluded"])
    assert tl.meta["bucket_layout"], "DDP's rebuilt layout comes from its logging data"


@pytest.mark.slow
def test_simulated_1gbe_link_matches_the_model_and_bucketing_hides_it(cluster):
    link = LinkModel.preset("1gbe")
    # 4M parameters = 16 MB: ~128 ms on 1 GbE, far longer than the real transfer,
    # so completion is the simulated end and the durations can be checked.
    r = compare(cluster, "manual_flat,bucketed", steps=3, n_params=4e6, depth=6,
                bucket_cap_mb=2.0, link=link)
    assert r.meta["simulated_link"]["simulated"] is True
    assert all(m["simulated"] for m in r.metrics.values())
    assert r.metrics["bucketed"]["exposed_comm_ms"] < r.metrics["manual_flat"]["exposed_comm_ms"]
    flat = r.timelines["manual_flat"]
    durations, predicted, real_decided = [], set(), 0
    for i in flat.iteration_numbers():
        for rank in range(2):
            (b,) = flat.buckets_of(rank, i)
            predicted.add(link.allreduce_seconds(b.nbytes, 2))
            if b.sources["comm_end"] == "cpu":  # the real transfer was slower (a loaded machine)
                real_decided += 1
                assert b.comm_end - b.launch >= link.allreduce_seconds(b.nbytes, 2) - 1e-3
                continue
            assert b.sources["comm_end"] == "simulated"
            durations.append(b.comm_end - b.launch)
    (predicted,) = predicted
    assert durations, f"the real transfer decided all {real_decided} ends: the model was never tested"
    assert sorted(durations)[len(durations) // 2] == pytest.approx(predicted, rel=0.10)


@pytest.mark.slow
@pytest.mark.parametrize("link, n_params", [(LinkModel.preset("1gbe"), 2e6),
                                             (LinkModel(0.1, 50.0, "100 Mbit/s"), 5e5)])
def test_on_a_simulated_link_every_row_pays_the_link_ddp_included(cluster, link, n_params):
    # Before: torch DDP's timed copy all-reduced around the link, so its row was
    # measured on the real (fast) network: 16 ms against ~64 ms of 1 GbE. Now the
    # link sits on the process group, under torch's C++ reducer with no comm hook.
    # The 100 Mbit/s case makes the link ~10x the compute, so load cannot hide it.
    r = compare(cluster, "none,manual,manual_flat,overlap,bucketed,ddp", steps=2, link=link,
                n_params=n_params)
    for name, m in r.metrics.items():
        if name == "none":
            continue
        assert m["comm_bytes_per_step"] > 0, name
        floor_ms = 1000 * link.allreduce_seconds(m["comm_bytes_per_step"], 2)
        assert m["step_ms"] >= floor_ms, f"{name}: {m['step_ms']:.1f} ms < link's {floor_ms:.1f} ms"
    assert r.metrics["ddp"]["comm_path"] == "observing process group"
    assert r.metrics["bucketed"]["comm_path"] == "ddplab.sync.comm"


@pytest.mark.slow
def test_the_default_comparison_shows_several_buckets_and_says_which_cap(cluster):
    r = compare(cluster, "bucketed,ddp", steps=1)
    for name in ("bucketed", "ddp"):
        assert r.metrics[name]["n_buckets"] >= 3, (name, r.metrics[name]["n_buckets"])
        assert any(lab.startswith("bucket_cap_mb=2 ") and "ONE bucket" in lab
                   for lab in r.timelines[name].meta["labels"]), r.timelines[name].meta
    assert r.to_json()["labels"]["bucket_cap_note"].startswith("bucket_cap_mb=2")


@pytest.mark.slow
def test_a_straggler_makes_the_fast_rank_wait_and_drops_nothing(cluster):
    r = compare(cluster, "manual,bucketed", steps=3, n_params=5e5, straggler="1:4")
    for name in ("manual", "bucketed"):
        wait = r.metrics[name]["wait_ms_by_rank"]
        assert wait[0] > wait[1], f"{name}: rank 0 should wait for the straggler: {wait}"
        assert r.metrics[name]["ranks_agree"]


def test_bad_arguments_say_what_to_do(cluster):
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        compare(cluster, "manual,fast")
    with pytest.raises(ValueError, match="steps must be"):
        compare(cluster, "manual", steps=0)
    with pytest.raises(ValueError, match="RANK:FACTOR"):
        compare(cluster, "manual", straggler="slow")
    with pytest.raises(ValueError, match="not a rank"):
        compare(cluster, "manual", straggler="5:2")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        compare(cluster, "bucketed", bucket_cap_mb=-1)


@pytest.mark.slow
@pytest.mark.more
def test_command_line_writes_json_trace_and_html(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "ddplab", "compare", "--world-size", "2", "--strategies",
         "none,manual,bucketed,ddp", "--steps", "2", "--params", "3e5", "--link", "10gbe",
         "--json", str(tmp_path / "m.json"), "--trace", str(tmp_path / "t.json"),
         "--html", str(tmp_path / "p.html")], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "SIMULATED link" in out.stdout and "bucketed" in out.stdout
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["world_size"] == 2 and m["simulated_link"]["bandwidth_gbps"] == 10.0
    assert set(m["strategies"]) == {"none", "manual", "bucketed", "ddp"}
    for key in ("step_ms", "exposed_comm_ms", "overlap_pct", "saved_ms", "comm_bytes_per_step", "n_buckets"):
        assert key in m["strategies"]["bucketed"]
    trace = json.loads((tmp_path / "t.json").read_text())
    assert any(e.get("cat") == "communication" for e in trace["traceEvents"])
    assert "plotly" in (tmp_path / "p.html").read_text()[:2_000_000].lower()


def _layout(v, key=None):
    """Keys and value kinds of compare's JSON, ranks collapsed to "<rank>"."""
    if isinstance(v, dict):
        if key in ("offsets_s", "wait_ms_by_rank"):
            return {"<rank>": "number"}
        return {k: _layout(x, k) for k, x in v.items()}
    if isinstance(v, bool):
        return "bool"
    return {int: "number", float: "number", str: "string", list: "list", type(None): "null"}[type(v)]


@pytest.mark.slow
def test_the_json_layout_is_the_one_design_md_documents(cluster):
    golden = json.loads((Path(__file__).parents[1] / "golden" / "compare_layout.json").read_text())["layout"]
    r = compare(cluster, "none,manual,bucketed,ddp", steps=1, n_params=2e5, link="10gbe",
                straggler="1:1.5")
    got = _layout(json.loads(json.dumps(r.to_json(), default=str)))
    rows = got.pop("strategies")
    expected_rows = golden.pop("strategies")
    assert got == golden
    every, extra = expected_rows["<strategy>"], expected_rows["<timed unrecorded (ddp) adds>"]
    assert list(rows) == ["none", "manual", "bucketed", "ddp"]
    for name, row in rows.items():
        expected = dict(every, **extra) if name == "ddp" else every
        if name == "none":  # no communication: no bandwidth to report
            expected = dict(expected, algbw_GBps="null", busbw_GBps="null")
        assert row == expected, name


@pytest.mark.slow
def test_simulated_links_leave_no_threads_behind(cluster):
    import threading

    def link_threads():
        return sum(t.name == "ddplab-simulated-link" for t in threading.enumerate())

    for _ in range(2):  # before: one more thread per rank for every compare() with a link
        compare(cluster, "manual", steps=1, n_params=1e5, link="10gbe")
    assert cluster.run(link_threads) == [0, 0]


@pytest.mark.slow
def test_the_rank_side_runs_under_torchrun_without_waiting_for_a_cluster(tmp_path):
    # Before: the ranks waited up to 120 s for a Cluster worker's start-up event,
    # which never fires in a process torchrun started.
    code = f"""
import os, threading, time
import torch.distributed as dist
from ddplab.pg.group import register
register()  # what ddplab.init_from_env() joins: the observing group torch DDP is drawn from
dist.init_process_group("ddplab_gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
from ddplab.measure import RunSpec
from ddplab.measure.compare import run_on_rank
t0 = time.perf_counter()
out = run_on_rank(RunSpec("manual,ddp", steps=1, n_params=1e5, world_size=1, link="1gbe"))
links = sum(t.name == "ddplab-simulated-link" for t in threading.enumerate())
print(round(time.perf_counter() - t0, 1), sorted(out["runs"]), links, flush=True)
os._exit(0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    seconds, rest = out.stdout.split(" ", 1)
    assert float(seconds) < 60 and rest.strip() == "['ddp', 'ddp_traced', 'manual'] 0"


def test_progress_counts_strategies_apart_from_the_traced_copies_it_draws():
    from types import SimpleNamespace as NS

    from ddplab.measure.compare import _counted

    entries = ["none", "manual", "ddp"]
    runners = [NS(name=n) for n in entries] + [NS(name="ddp_traced")]
    assert _counted(entries, runners) == "3 strategies, and a traced copy of ddp to draw"
    assert _counted(["manual"], [NS(name="manual")]) == "1 strategy"
