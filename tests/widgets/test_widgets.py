"""Figures are built from timelines whose contents are known; the panel is driven by a fake runner.

Nothing here trains: the timelines are written by hand (or by
ddplab.widgets.demo), which is the point of the widgets' contract.
"""
import json
import subprocess
import sys
from pathlib import Path

import plotly.graph_objects as go
import pytest
from _timelines import hand_timeline

from ddplab.timeline import add_saved_ms, summarize
from ddplab.widgets import (
    ControlPanel,
    bucket_color,
    compare_figures,
    compare_page,
    compare_report,
    efficiency,
    scaling_figure,
    sweep_figure,
    timeline_figure,
    to_html,
    write_html,
)
from ddplab.widgets.demo import DemoRunner, expected_buckets
from ddplab.widgets.gantt import COMM_LABEL, COMM_LABEL_SIMULATED, select_iterations
from ddplab.widgets.panel import normalize_result

ROOT = Path(__file__).resolve().parents[2]


def bars(fig):
    return [t for t in fig.data if t.type == "bar"]


def is_comm(trace):
    return trace.name.startswith("all-reduce")


def comm_trace(fig):
    return next(t for t in fig.data if is_comm(t))


def texts(fig):
    return " | ".join(a.text or "" for a in fig.layout.annotations) + " | " + str(fig.layout.title.text)


# -- Gantt -------------------------------------------------------------------------------

def test_gantt_draws_one_bar_per_phase_and_per_bucket_all_reduce():
    fig = timeline_figure(hand_timeline(ranks=2, iterations=3, buckets=2))
    assert sum(len(t.x) for t in bars(fig)) == 2 * 3 * 3 + 2 * 3 * 2
    assert [t.name for t in fig.data] == ["forward", "backward", "optimizer step", COMM_LABEL]
    assert timeline_figure(hand_timeline(simulated=True)).data[-1].name == COMM_LABEL_SIMULATED
    assert set(comm_trace(fig).y) == {"rank 0 comm", "rank 1 comm"}
    assert list(fig.layout.yaxis.categoryarray) == ["rank 0 compute", "rank 0 comm",
                                                    "rank 1 compute", "rank 1 comm"]
    backward = next(t for t in fig.data if t.name == "backward")
    assert backward.base[0] == pytest.approx(20) and backward.x[0] == pytest.approx(60)  # ms


def test_a_bucket_has_one_colour_on_every_rank_and_in_every_figure():
    tl = hand_timeline(ranks=3, buckets=4)
    fig = timeline_figure(tl)
    comm = comm_trace(fig)
    assert [c for c in comm.marker.color] == [bucket_color(k) for k in comm.customdata]
    assert len(set(comm.marker.color)) == 4
    side, _ = compare_figures({"bucketed": tl, "ddp": hand_timeline("ddp", buckets=3)},
                              {"bucketed": summarize(tl), "ddp": summarize(tl)})
    for t in side.data:
        if is_comm(t):
            assert list(t.marker.color) == [bucket_color(k) for k in t.customdata]


def test_hover_names_the_bucket_its_parameters_bytes_duration_and_stamp_source():
    fig = timeline_figure(hand_timeline(iterations=1, buckets=2))
    hover = comm_trace(fig).hovertext[1]
    assert "bucket 1" in hover and "rank 0" in hover
    assert "layer1.weight, layer1.bias" in hover and "2,000 bytes" in hover
    assert "= <b>10.0 ms</b>" in hover and "comm_end=cpu" in hover
    phase_hover = next(t for t in fig.data if t.name == "backward").hovertext[0]
    assert "60.0 ms" in phase_hover and "stamp source: cpu" in phase_hover


def test_simulated_link_and_oversubscription_are_written_on_the_figure():
    fig = timeline_figure(hand_timeline(simulated=True, oversubscribed=True, ranks=3))
    assert "SIMULATED link: 10 Gb Ethernet" in texts(fig)
    assert "OVERSUBSCRIBED: 3 ranks on 2 CPUs" in texts(fig)
    assert set(comm_trace(fig).marker.pattern.shape) == {"/"}  # hatched transfers
    plain = timeline_figure(hand_timeline())
    assert "SIMULATED" not in texts(plain) and "OVERSUBSCRIBED" not in texts(plain)


def test_torch_ddp_one_bucket_and_rebuild_iterations_are_labelled():
    tl = hand_timeline("ddp", iterations=4, flags={0: {"ddp_one_bucket"}, 1: {"ddp_rebuild"}})
    fig = timeline_figure(tl)
    assert "it 0: DDP: 1 bucket" in texts(fig) and "it 1: DDP: rebuild" in texts(fig)
    assert len([s for s in fig.layout.shapes if s.type == "rect"]) == 2
    assert "not averaged" in fig.layout.xaxis.title.text
    assert select_iterations(tl, 1) == [3] and select_iterations(tl) == [0, 1, 2, 3]


def test_host_stamps_of_gpu_all_reduces_are_not_drawn_as_execution():
    fig = timeline_figure(hand_timeline(backend="nccl", buckets=2, iterations=1))
    assert not any(is_comm(t) for t in fig.data)
    assert "4 all-reduce(s) have only host stamps" in texts(fig)


# -- side by side ------------------------------------------------------------------------

def test_compare_stacks_strategies_on_one_time_scale_starting_at_zero():
    runs = DemoRunner()(strategies=["manual", "overlap", "bucketed", "ddp"], link="10gbe")
    side, metrics = compare_figures(runs["timelines"], runs["metrics"])
    assert {side.layout[f"xaxis{k}"].matches for k in ("", 2, 3, 4)} == {"x4", None}  # one scale
    for axis in ("x", "x2", "x3", "x4"):
        mine = [t for t in bars(side) if t.xaxis == axis]
        assert min(min(t.base) for t in mine) == pytest.approx(0.0)
    titles = texts(side)
    assert all(s in titles for s in ("<b>manual</b>", "<b>ddp</b>"))
    assert "SIMULATED link: 10 Gb Ethernet" in titles and "DEMO" in titles
    assert "SIMULATED link" in texts(metrics)


def test_metrics_chart_shows_step_exposed_saved_and_bytes_per_strategy():
    tls = {"manual": hand_timeline("manual"), "bucketed": hand_timeline("bucketed", buckets=3)}
    m = add_saved_ms({k: summarize(v) for k, v in tls.items()})
    m["bucketed"]["step_ms"] = 80.0
    add_saved_ms(m)
    _, fig = compare_figures(tls, m)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["step time"].x) == ["manual", "bucketed"]
    assert list(by_name["step time"].y) == pytest.approx([100.0, 80.0])
    assert list(by_name["saved vs manual"].y) == pytest.approx([0.0, 20.0])
    assert list(by_name["exposed comm (after backward)"].y) == pytest.approx([0.0, 0.0])
    assert list(by_name["MiB per step"].y) == pytest.approx([3000 / 2**20, 6000 / 2**20])


# -- sweep and scaling ---------------------------------------------------------------------

def test_sweep_puts_measured_next_to_predicted_on_a_log_axis():
    fig = sweep_figure([25, 1, 5], {"step_ms": [30, 50, 20], "exposed_comm_ms": [9, 8, 4]},
                       predicted={"step_ms": [28, 45, 22], "exposed_comm_ms": [8, 7, 5]})
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis2.type == "log"
    names = [t.name for t in fig.data]
    assert names.count("measured") == 2 and names.count("predicted (cost model)") == 2
    assert list(fig.data[0].x) == [1, 5, 25] and list(fig.data[0].y) == [50, 20, 30]  # sorted by cap
    assert "fastest measured: 5 MB" in texts(fig) and "torch default 25 MB" in texts(fig)
    rows = [{"bucket_cap_mb": 1, "step_ms": 5, "exposed_comm_ms": 1},
            {"bucket_cap_mb": 4, "step_ms": 4, "exposed_comm_ms": 2}]
    assert list(sweep_figure(rows).data[0].x) == [1, 4]
    swept = {"rows": [dict(r, predicted_step_ms=3.0, predicted_exposed_ms=1.0) for r in rows],
             "simulated_link": {"label": "1 Gb Ethernet"}}  # as bucket_sweep() returns
    fig = sweep_figure(swept)
    assert [t.name for t in fig.data].count("predicted (cost model)") == 2
    assert "SIMULATED link: 1 Gb Ethernet" in texts(fig)
    with pytest.raises(ValueError, match="> 0"):
        sweep_figure([0, 1], {"step_ms": [1, 2]})
    with pytest.raises(ValueError, match="2 bucket sizes"):
        sweep_figure([1, 2], {"step_ms": [1, 2, 3]})


def test_scaling_efficiency_and_the_oversubscription_line():
    assert efficiency({1: 100, 2: 50, 4: 40}, "strong") == pytest.approx({1: 100, 2: 100, 4: 62.5})
    assert efficiency({1: 100, 2: 125}, "weak") == pytest.approx({1: 100, 2: 80})
    assert efficiency([(2, 60), (4, 40)], "strong")[4] == pytest.approx(75)  # against 2 ranks
    fig = scaling_figure(strong={1: 100, 2: 55, 4: 40}, weak={1: 100, 2: 110, 4: 300}, usable_cpus=2)
    assert [t.name.split()[0] for t in fig.data] == ["strong", "weak"]
    line = [s for s in fig.layout.shapes if s.type == "line" and s.x0 == s.x1]
    assert [s.x0 for s in line] == [2.5]
    assert "more ranks than the 2 usable CPUs" in texts(fig)
    with pytest.raises(ValueError):
        efficiency({1: 1}, "medium")
    result = {"rows": [{"world_size": 1, "strong_step_ms": 10, "weak_step_ms": 10},
                       {"world_size": 4, "strong_step_ms": 5, "weak_step_ms": 20}], "usable_cpus": 2}
    fig = scaling_figure(result)  # as ddplab.measure.sweep.scaling returns
    assert list(fig.data[0].y) == pytest.approx([100, 50]) and list(fig.data[1].y) == pytest.approx([100, 50])


# -- standalone HTML -----------------------------------------------------------------------

def test_every_figure_becomes_a_standalone_page_with_plotly_inlined_once(tmp_path):
    tl = hand_timeline(simulated=True)
    figs = [timeline_figure(tl), go.FigureWidget(timeline_figure(hand_timeline()))]
    page = to_html(figs, title="two <figures>", captions=["first"])
    assert page.startswith("<!DOCTYPE html>") and "two &lt;figures&gt;" in page
    assert page.count("Plotly.newPlot(") == 2 and page.count("plotly.js v") == 1  # inlined once
    assert "<script src=" not in page  # nothing fetched from the network
    path = write_html(tmp_path / "t.html", figs[0])
    assert Path(path).read_text(encoding="utf-8").count("Plotly.newPlot(") == 1
    runs = DemoRunner()(strategies=["manual", "ddp"])
    report = compare_report(runs["timelines"], runs["metrics"])
    assert report.count("Plotly.newPlot(") == 4 and "DEMO data" in report
    page = compare_page(runs, tmp_path / "compare.html")  # what compare --html calls
    assert "torch DDP before its bucket rebuild: one bucket" in Path(page).read_text(encoding="utf-8")


# -- control panel -------------------------------------------------------------------------

def test_run_calls_the_runner_with_the_panels_settings_and_updates_the_figures_in_place():
    runner = DemoRunner()
    panel = ControlPanel(runner=runner, strategies=("manual", "bucketed"), usable_cpus=2)
    fig, metrics = panel.timeline_fig, panel.metrics_fig
    panel.controls["bucket_cap_mb"].value = 1.0
    panel.controls["world_size"].value = 3
    panel.controls["straggler_rank"].value = 2
    panel.controls["straggler_factor"].value = 3.0
    panel.controls["link"].value = "1gbe"
    panel.button.click()
    assert runner.configs == [dict(strategies=["manual", "bucketed"], world_size=3, steps=5,
                                   link="1gbe", straggler=(2, 3.0), bucket_cap_mb=1.0,
                                   n_params=5_000_000, batch_size=32)]
    assert panel.timeline_fig is fig and panel.metrics_fig is metrics  # the same widgets
    comm = [t for t in fig.data if is_comm(t)]
    assert len(comm) == 2
    assert set(comm[1].customdata) == set(range(expected_buckets(5e6, 1.0)))
    assert "Run #1 done" in panel.status.value and panel.error.layout.display == "none"
    assert not panel.button.disabled and panel.progress.value == panel.progress.max

    before = json.dumps(fig.to_plotly_json()["data"], default=str)
    panel.controls["bucket_cap_mb"].value = 25.0
    panel.run()
    assert json.dumps(fig.to_plotly_json()["data"], default=str) != before
    assert runner.calls == 2 and panel.result["config"]["bucket_cap_mb"] == 25.0


def test_a_failing_run_shows_its_error_keeps_the_figures_and_the_panel_works_again(caplog):
    runner = DemoRunner()
    panel = ControlPanel(runner=runner, usable_cpus=2)
    panel.run()
    before = json.dumps(panel.timeline_fig.to_plotly_json(), default=str)
    runner.fail_with = RuntimeError("rank 1 raised ZeroDivisionError: division by zero")
    with caplog.at_level("ERROR", logger="ddplab.widgets"):
        assert panel.run() is None
    assert "rank 1 raised ZeroDivisionError" in panel.error.value and "traceback" in panel.error.value
    assert panel.error.layout.display is None and "Run #2 failed" in panel.status.value
    assert "run #2 failed" in caplog.text
    assert json.dumps(panel.timeline_fig.to_plotly_json(), default=str) == before
    assert not panel.button.disabled
    runner.fail_with = None
    panel.button.click()
    assert "Run #3 done" in panel.status.value and panel.error.layout.display == "none"


def test_panel_asks_for_a_strategy_and_follows_world_size():
    runner = DemoRunner()
    panel = ControlPanel(runner=runner, usable_cpus=2)
    for box in panel.strategy_boxes.values():
        box.value = False
    panel.run()
    assert runner.calls == 0 and "pick at least one strategy" in panel.error.value
    panel.controls["world_size"].value = 4
    assert [label for label, _ in panel.controls["straggler_rank"].options] == [
        "none", "rank 0", "rank 1", "rank 2", "rank 3"]
    assert panel.controls["straggler_rank"].label == "none" and panel.config()["straggler"] is None
    assert "oversubscribed: 4 ranks on 2 CPUs" in panel.world_note.value
    panel.controls["straggler_rank"].value = 3
    panel.controls["world_size"].value = 2
    assert panel.controls["straggler_rank"].label == "none" and panel.controls["straggler_factor"].disabled
    assert panel.world_note.value == ""


def test_runners_without_progress_and_results_as_plain_dicts_work():
    seen = []

    def runner(**config):  # no progress parameter: none is passed
        seen.append(config)
        tl = hand_timeline("manual")
        metrics = add_saved_ms({"manual": summarize(tl)})
        return {"timelines": {"manual": tl.to_dict()}, "metrics": metrics}

    panel = ControlPanel(runner=runner, strategies=("manual",), usable_cpus=2,
                         extra_config={"model": "mlp"})
    assert panel.run() is not None
    assert "progress" not in seen[0] and seen[0]["model"] == "mlp"
    assert panel.result["metrics"]["manual"]["step_ms"] == pytest.approx(100)
    assert panel.result["metrics"]["manual"]["saved_ms"] == pytest.approx(0)
    # widgets only read: the straggler label comes from the timeline the runner labelled
    tl = hand_timeline("manual")
    tl.meta["straggler"] = [1, 2.0]
    result = {"timelines": {"manual": tl}, "metrics": {"manual": summarize(tl)}}
    assert "straggler: rank 1 slowed ×2" in texts(compare_figures(*normalize_result(result))[0])
    with pytest.raises(TypeError, match="must return"):
        normalize_result({"nothing": 1})
    with pytest.raises(TypeError, match="no metrics for manual"):
        normalize_result({"timelines": {"manual": tl}, "metrics": {}})


def test_a_bad_setting_is_reported_by_the_panel_before_the_runner_runs():
    runner = DemoRunner()
    panel = ControlPanel(runner=runner, strategies=("manual",), usable_cpus=2,
                         extra_config={"model": "resnet"})
    assert panel.run() is None and runner.calls == 0
    assert "unknown model" in panel.error.value


def test_default_runner_uses_the_live_cluster_when_its_size_matches(monkeypatch):
    import importlib

    # the module, not the function ddplab.measure re-exports under the same name
    engine = importlib.import_module("ddplab.measure.compare")

    calls = []

    def fake_compare(**kwargs):
        calls.append(kwargs)
        return DemoRunner()(**{k: v for k, v in kwargs.items() if k != "cluster"})

    monkeypatch.setattr(engine, "compare", fake_compare)
    cluster = type("FakeCluster", (), {"world_size": 2})()
    panel = ControlPanel(cluster=cluster, strategies=("manual",), usable_cpus=2)
    assert panel.controls["world_size"].value == 2
    panel.run()
    assert calls[-1]["cluster"] is cluster and "progress" not in calls[-1]
    panel.controls["world_size"].value = 3  # another size: compare() starts its own ranks
    panel.run()
    assert "cluster" not in calls[-1] and calls[-1]["world_size"] == 3
    assert "Run #2 done" in panel.status.value


# -- layering ------------------------------------------------------------------------------

def test_widgets_import_neither_torch_nor_torch_distributed():
    code = ("import sys, ddplab.widgets, ddplab.widgets.demo; "
            "print('torch' in sys.modules, 'torch.distributed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_torch_modules_import_neither_plotly_nor_ipywidgets():
    def imports(text, names):
        return any(line.lstrip().startswith(tuple(f"{kw} {n}" for kw in ("import", "from") for n in names))
                   for line in text.splitlines())

    offenders = []
    for path in (ROOT / "ddplab").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if imports(text, ("torch",)) and imports(text, ("plotly", "ipywidgets")):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


# -- a saved run's page: what it has, nothing it has not -------------------------------------

def legend_names(fig):
    return [t.name for t in fig.data if t.showlegend is not False]


def test_a_legend_entry_with_nothing_behind_it_goes():
    """One saved run has no manual row, so no saved_ms: no "saved vs manual" bars or legend.
    With manual beside it, the entry comes back (the same code, so the test can fail)."""
    tl = hand_timeline("ddp")
    _, alone = compare_figures({"myrun": tl}, {"myrun": summarize(tl)})
    assert "saved vs manual" not in legend_names(alone)
    assert {"step time", "exposed comm (after backward)"} <= set(legend_names(alone))
    tls = {"manual": hand_timeline("manual"), "myrun": tl}
    _, both = compare_figures(tls, add_saved_ms({k: summarize(v) for k, v in tls.items()}))
    assert "saved vs manual" in legend_names(both)


def test_side_by_side_each_kind_of_bar_is_in_the_legend_once_even_when_only_the_second_run_has_it():
    first, second = hand_timeline("a", buckets=0), hand_timeline("b", buckets=2)
    side, _ = compare_figures({"a": first, "b": second}, {"a": summarize(first), "b": summarize(second)})
    shown = legend_names(side)
    assert len(shown) == len(set(shown))
    assert any(is_comm(t) for t in side.data if t.showlegend is not False)  # b's all-reduces
    assert side.layout.xaxis.matches == "x2" or side.layout.xaxis2.matches == "x"  # one time scale


def test_the_page_states_the_stamp_sources_it_shows(tmp_path):
    from ddplab.cli.view import load_runs, runs_page

    recorded = hand_timeline("ddp")
    for it in recorded.iterations:  # as ddplab.record stamps them
        it.sources["backward"] = "derived"
    on_gpu = hand_timeline("ddp")
    for b in on_gpu.buckets:
        b.sources = {"launch": "cpu", "comm_end": "cuda_event"}
    runs_page(tmp_path / "one.html", {"myrun": recorded})
    page = (tmp_path / "one.html").read_text()
    assert "Stamp sources on this page" in page
    assert "<code>cpu</code>" in page and "<code>derived</code>" in page
    assert "<code>cuda_event</code>" not in page and "saved_ms is manual" not in page
    runs_page(tmp_path / "two.html", {"myrun": recorded, "gpu": on_gpu})
    page = (tmp_path / "two.html").read_text()
    assert "<code>cuda_event</code>: a CUDA event recorded on the stream" in page
    assert "saved vs manual" not in page
    # what `python -m ddplab view` reads back from a saved file says the same
    (tmp_path / "gpu.json").write_text(json.dumps(on_gpu.to_dict()))
    runs_page(tmp_path / "back.html", load_runs([tmp_path / "gpu.json"]))
    assert "<code>cuda_event</code>" in (tmp_path / "back.html").read_text()


def test_each_kind_of_run_gets_a_caption_true_for_its_gaps():
    import re

    from ddplab.widgets.html import full_caption

    compared, other = hand_timeline("bucketed"), hand_timeline("ddp")
    recorded = hand_timeline("ddp")
    recorded.meta["recorded"] = "your run (ddplab.record)"
    predicted = hand_timeline("predicted: ddp", iterations=1)
    predicted.meta["predicted"] = True
    page = compare_report({"bucketed": compared, "ddp": other, "run (torch DDP)": recorded,
                           "what-if": predicted}, {n: summarize(t) for n, t in
                                                   {"bucketed": compared, "ddp": other,
                                                    "run (torch DDP)": recorded, "what-if": predicted}.items()})
    caps = dict(re.findall(r"<figcaption>([^:<]+): ([^<]*)</figcaption>", page))
    assert "compare() interleaves" in caps["bucketed"] and "compare() interleaves" in caps["ddp"]
    assert "compare() interleaves" not in caps["run (torch DDP)"]
    assert "your loop&#x27;s own time" in caps["run (torch DDP)"] and "loading data" in caps["run (torch DDP)"]
    assert "PREDICTED" in caps["what-if"] and "interleaves" not in caps["what-if"]
    # one recorded run alone says what its gaps are too; one compared strategy has no others
    assert "loading data" in full_caption(recorded, 1)
    assert "interleaves" not in full_caption(compared, 1)
