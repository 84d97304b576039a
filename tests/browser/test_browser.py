"""The control panel in a real JupyterLab, in a real browser: drawn, clicked, redrawn.

A notebook builds the panel on demo timelines (no ranks, no engine), the
browser runs every cell like a learner would, and the test checks what
plotly actually drew: one SVG bar per bar in the figure's data, as many as
the same code gives in this process. Then it clicks Run and waits for the
timeline figure to change in place. Screenshots land in test-artifacts/.

Skipped without Playwright or Chromium, except with CI=true, where that fails.
One JupyterLab and one Chromium serve every browser test of the session (``browsing``).
"""
import shutil

import nbformat
import pytest
from _browser import (
    ROOT,
    notebook_errors,
    open_notebook,
    run_all_cells,
    save_screenshots,
    wait_for_bars,
    wait_for_change,
)

pytestmark = pytest.mark.timeout(120)

PANEL_CODE = """\
from ddplab.widgets import ControlPanel
from ddplab.widgets.demo import DemoRunner

panel = ControlPanel(runner=DemoRunner(), strategies=("manual", "overlap", "bucketed", "ddp"),
                     bucket_cap_mb=5.0, n_params=20_000_000, link="10gbe", usable_cpus=2)
panel.run()
assert panel.last_error is None, panel.last_error
panel
"""
TIMELINE = ".ddplab-panel .js-plotly-plot.ddplab-timeline"  # the FigureWidget's own element
METRICS = ".ddplab-panel .js-plotly-plot.ddplab-metrics"


def expected_bars():
    """Bars the notebook's first run draws, computed by running the same code here."""
    scope = {}
    exec(PANEL_CODE, scope)
    return sum(len(t.x) for t in scope["panel"].timeline_fig.data if t.type == "bar")


def write_notebook(path):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell("# Browser test: the control panel on demo timelines"),
                nbformat.v4.new_code_cell(PANEL_CODE),
                nbformat.v4.new_code_cell('print("all cells ran")')]
    nbformat.write(nb, str(path))


def test_panel_renders_in_jupyterlab_and_run_redraws_the_timeline(browsing):
    lab = browsing.lab
    write_notebook(browsing.root / "panel.ipynb")
    want = expected_bars()
    # tall enough that the whole panel is on screen for the screenshot
    with browsing.page(height=2300) as page:
        try:
            open_notebook(page, lab, "panel.ipynb")
            run_all_cells(page, timeout_s=60)
            assert notebook_errors(page) == []
            assert page.locator(".jp-OutputArea-output", has_text="all cells ran").count() == 1

            first = wait_for_bars(page, TIMELINE)
            assert first["drawn"] == first["in_data"] == want
            assert any("SIMULATED link" in n for n in first["notes"])
            assert wait_for_bars(page, METRICS)["drawn"] > 0
            assert "Run #1 done" in page.locator(".ddplab-panel").inner_text()

            page.locator(".ddplab-panel button.ddplab-run").click()
            second = wait_for_change(page, TIMELINE, first["fingerprint"])
            page.get_by_text("Run #2 done").first.wait_for(timeout=30_000)
            assert second["drawn"] == second["in_data"] == want  # same layout, new timings
            assert page.errors == []
        finally:
            shots = save_screenshots(page, "browser-panel", ".ddplab-panel")
            shutil.copy(lab.log_path, shots[0].parent / "browser-jupyterlab.log")


def test_the_tour_runs_in_jupyterlab_and_its_panel_reruns_on_live_ranks(browsing):
    """labs/tour.ipynb as a learner runs it: real ranks, real engine, real clicks."""
    lab, root = browsing.lab, browsing.root
    tour = nbformat.read(str(ROOT / "labs" / "tour.ipynb"), as_version=4)
    # Keep the ranks alive after Run All (the tour's last cell shuts them down) so
    # that the click below re-runs on them, as a learner's click before that cell would.
    assert "cluster.shutdown()" in tour.cells[-1].source
    tour.cells = tour.cells[:-1]
    nbformat.write(tour, str(root / "tour.ipynb"))
    with browsing.page(height=2600) as page:
        try:
            open_notebook(page, lab, "tour.ipynb")
            run_all_cells(page, timeout_s=75)
            assert notebook_errors(page) == []
            first = wait_for_bars(page, TIMELINE)
            assert first["drawn"] == first["in_data"] > 0
            assert any("SIMULATED link" in n for n in first["notes"])
            # the cells above the panel drew the side-by-side timelines and metrics too
            assert page.locator(".jp-OutputArea-output .js-plotly-plot").count() >= 2
            page.locator(".ddplab-panel button.ddplab-run").click()
            second = wait_for_change(page, TIMELINE, first["fingerprint"], timeout_s=45)
            page.get_by_text("Run #2 done").first.wait_for(timeout=30_000)
            assert second["drawn"] == second["in_data"] > 0
            assert page.errors == []
        finally:
            shots = save_screenshots(page, "browser-tour", ".ddplab-panel")
            shutil.copy(lab.log_path, shots[0].parent / "browser-tour-jupyterlab.log")


RANK_FIGURE_CELLS = [
    "%load_ext ddplab\n%ddp_start 2",
    "%%ddp\nimport plotly.graph_objects as go\n"
    "fig = go.Figure(go.Bar(x=['a', 'b', 'c'], y=[rank + 1, rank + 2, rank + 3]))\n"
    "if rank == 1:\n    fig.show()\nrank * 10",
    "%ddp_stop\nprint('all cells ran')",
]


def test_a_figure_made_on_rank_1_renders_in_jupyterlab_labelled_by_rank(browsing):
    """A %%ddp cell as a learner sees it: rank 1's plotly figure drawn under its label,
    and each rank's last value in its own section."""
    lab, root = browsing.lab, browsing.root
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in RANK_FIGURE_CELLS]
    nbformat.write(nb, str(root / "ranks.ipynb"))
    with browsing.page(height=1400) as page:
        try:
            open_notebook(page, lab, "ranks.ipynb")
            run_all_cells(page, timeout_s=60)
            assert notebook_errors(page) == []
            assert page.locator(".jp-OutputArea-output", has_text="all cells ran").count() == 1
            # plotly's JupyterLab renderer makes the output element itself the plot
            drawn = wait_for_bars(page, ".jp-OutputArea-output.js-plotly-plot")
            assert drawn["drawn"] == drawn["in_data"] == 3
            assert page.locator(".jp-OutputArea-output.js-plotly-plot").count() == 1  # rank 1's only
            # the output just above the figure is its label
            label = page.evaluate("""() => {
                const plot = document.querySelector('.jp-OutputArea-output.js-plotly-plot');
                const child = plot.closest('.jp-OutputArea-child');
                return child.previousElementSibling.innerText.trim(); }""")
            assert label == "rank 1"
            sections = page.locator(".jp-OutputArea-output details summary").all_inner_texts()
            assert sections == ["rank 0", "rank 1"]
            text = page.locator(".jp-OutputArea-output details").all_inner_texts()
            assert [t.split()[-1] for t in text] == ["0", "10"]
            assert page.errors == []
        finally:
            shots = save_screenshots(page, "browser-rank-figure", ".jp-Notebook")
            shutil.copy(lab.log_path, shots[0].parent / "browser-rank-figure-jupyterlab.log")


def test_a_saved_runs_page_in_chromium_shows_only_what_the_runs_have(tmp_path, browsing):
    """The page `python -m ddplab view` and `ddplab.record(..., out=)` write, opened as a user
    opens it (a file in Chromium, no kernel): the legends plotly drew have no entry without
    bars ("saved vs manual" for runs without a manual one), the stamp sources are listed,
    and the two runs' panels share one time axis."""
    from _timelines import hand_timeline

    from ddplab.cli.view import runs_page

    small, big = hand_timeline("ddp", buckets=3), hand_timeline("ddp", buckets=1)
    for it in small.iterations:
        it.sources["backward"] = "derived"
    page_path = tmp_path / "both.view.html"
    runs_page(page_path, {"small": small, "big": big})
    # the session's Chromium: a second Playwright in this thread would find the first one's loop
    with browsing.page() as page:
        page.goto(page_path.as_uri())
        page.wait_for_selector(".js-plotly-plot .legendtext", timeout=60_000)
        legends = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].map(
            p => [...p.querySelectorAll('.legendtext')].map(t => t.textContent))""")
        side = page.evaluate("""() => { const l = document.querySelectorAll('.js-plotly-plot')[0]._fullLayout;
            return [l.xaxis.range, l.xaxis2.range]; }""")
        sources = page.locator(".sources").inner_text()
        assert page.errors == []
    assert all("saved vs manual" not in names for names in legends), legends
    assert "step time" in legends[1] and "exposed comm (after backward)" in legends[1]
    assert len(legends[0]) == len(set(legends[0]))  # each kind of bar once
    assert side[0] == side[1]  # one time scale for both runs
    assert "Stamp sources on this page" in sources and "cpu:" in sources and "derived:" in sources
