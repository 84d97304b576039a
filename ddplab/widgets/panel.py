"""A control panel: pick strategies and knobs, press Run, watch the figures change in place.

Teaches by letting a learner ask "what if?" quickly: smaller buckets, a
bigger model, a straggler, a 1 GbE link. The panel only reads widget values
into a plain config dict (the model), checks it by building the run's
``ddplab.measure.RunSpec`` (the same object the CLI and the ranks use),
hands it to a runner, and draws what comes back (the view); it never trains
and never touches torch.distributed. Its strategy boxes list the registry
(``ddplab.sync.registry``), so a strategy registered in a notebook cell shows up
in a panel made after it, and runs on the ranks.
The runner is ``ddplab.measure.compare`` on the live Cluster by default,
or anything with its calling convention:

    runner(**config) -> {"timelines": {name: Timeline}, "metrics": {name: dict}}

where config has strategies, bucket_cap_mb, n_params, batch_size,
world_size, straggler (None or (rank, factor)), link (None or a
``ddplab.netsim`` preset name) and steps: compare()'s own keyword names. A
runner whose ``progress`` parameter defaults to None also gets
``progress(done, total, message)`` calls. ``model=``, ``batch=`` and ``loss=``
(your own functions, see ddplab.measure.workload) go into every config as they
are, checked by RunSpec before a rank starts.

Figures are ``plotly.graph_objects.FigureWidget`` objects updated in place
inside ``batch_update()`` (one message to the browser, no flicker). A
failing run shows its error in the panel and in the log ("ddplab.widgets");
the previous figures stay, and Run works again at once. The kernel is busy
while a run lasts (the ranks are driven from it): the status line says so.

Leaves out: running in a background thread (the Cluster is not shared between
threads), cancelling a run (use the kernel's Interrupt).
References: ipywidgets "Widget Events"; plotly FigureWidget and batch_update.
"""
from __future__ import annotations

import html
import inspect
import logging
import time
import traceback

import ipywidgets as W

from ddplab.netsim import PRESETS
from ddplab.sync.registry import strategy_names
from ddplab.widgets.compare import compare_figures, normalize_result
from ddplab.widgets.live import FitWidth, live_figure, placeholder, refresh

log = logging.getLogger("ddplab.widgets")

BUCKET_CAPS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0)
MODEL_SIZES = (("1M parameters", 1_000_000), ("5M parameters", 5_000_000),
               ("20M parameters", 20_000_000), ("50M parameters", 50_000_000))
BATCH_SIZES = (8, 16, 32, 64, 128, 256)
LINKS = (("real (no simulation)", None),) + tuple(
    (f"{p['label']} (simulated)", name) for name, p in PRESETS.items())
_WIDE = {"description_width": "110px"}
_ITEM = {"style": _WIDE, "layout": {"width": "330px"}}
NO_STRAGGLER = -1  # a Dropdown whose value is None shows nothing selected


def default_runner(cluster=None):
    """``ddplab.measure.compare`` on the live ``cluster``, imported when first run.

    When the panel asks for another world size than the cluster has, compare
    starts (and stops) a temporary cluster of that size, which costs seconds.
    """
    def run(**config):
        try:
            from ddplab.measure.compare import compare
        except ImportError as e:
            raise RuntimeError("ddplab.measure.compare is not available here; "
                               "give ControlPanel a runner=...") from e
        if cluster is not None and config.get("world_size") == cluster.world_size:
            return compare(cluster=cluster, **config)
        return compare(**config)
    return run


class ControlPanel:
    """Widgets for one compare() configuration, a Run button, and two live figures."""

    def __init__(self, runner=None, *, cluster=None, strategies=("manual", "overlap", "bucketed", "ddp"),
                 bucket_cap_mb=2.0, n_params=5_000_000, batch_size=32, world_size=None, straggler=None,
                 link="10gbe", steps=5, iterations=1, max_world_size=8, usable_cpus=None,
                 extra_config=None, model=None, batch=None, loss=None):
        if usable_cpus is None:
            from ddplab.placement.resources import usable_cpus as _usable  # no torch imported

            usable_cpus = _usable()
        if world_size is None:
            world_size = getattr(cluster, "world_size", 2)
        self.runner = runner if runner is not None else default_runner(cluster)
        self.usable_cpus = usable_cpus
        self.iterations = iterations
        self.extra_config = dict(extra_config or {})
        # your own model (functions, see ddplab.measure.workload) or a built-in name
        self.extra_config.update({k: v for k, v in (("model", model), ("batch", batch),
                                                    ("loss", loss)) if v is not None})
        self.result = None  # the last successful run: {"config", "timelines", "metrics"}
        self.runs = 0
        self.last_error = None

        self.strategy_boxes = {s: W.Checkbox(value=s in strategies, description=s, indent=False,
                                             layout=W.Layout(width="115px")) for s in strategy_names()}
        caps = tuple(sorted(set(BUCKET_CAPS) | {float(bucket_cap_mb)}))
        sizes = MODEL_SIZES if n_params in dict(MODEL_SIZES).values() else \
            MODEL_SIZES + ((f"{n_params / 1e6:g}M parameters", n_params),)
        self.controls = {
            "bucket_cap_mb": W.SelectionSlider(options=caps, value=float(bucket_cap_mb),
                                               description="bucket_cap_mb",
                                               continuous_update=False, **_ITEM),
            "n_params": W.Dropdown(options=sizes, value=n_params, description="model (MLP)",
                                   **_ITEM),
            "batch_size": W.Dropdown(options=sorted(set(BATCH_SIZES) | {batch_size}), value=batch_size,
                                     description="batch per rank", **_ITEM),
            "steps": W.IntSlider(value=steps, min=1, max=50, description="measured steps",
                                 continuous_update=False, **_ITEM),
            "world_size": W.IntSlider(value=world_size, min=1, max=max_world_size, description="world_size",
                                      continuous_update=False, **_ITEM),
            "straggler_rank": W.Dropdown(description="straggler", **_ITEM),
            "straggler_factor": W.FloatSlider(value=2.0, min=1.0, max=5.0, step=0.5,
                                              description="slowed ×", continuous_update=False,
                                              **_ITEM),
            "link": W.Dropdown(options=LINKS, value=link, description="link", **_ITEM),
        }
        own = self.extra_config.get("model", "mlp")
        if own != "mlp":  # the size dropdown sizes the built-in MLP only
            self.controls["n_params"].disabled = True
            self.controls["n_params"].description = "model"
            self.controls["n_params"].options = ((getattr(own, "__name__", str(own)), n_params),)
        self._update_straggler_options(straggler)
        self.world_note = W.HTML()
        self.controls["world_size"].observe(self._on_world_size, names="value")
        self.controls["straggler_rank"].observe(self._on_straggler, names="value")
        self._on_world_size()
        self._on_straggler()

        self.button = W.Button(description="Run", icon="play", button_style="primary",
                               tooltip="run the selected strategies with these settings")
        self.button.add_class("ddplab-run")
        self.button.on_click(self.run)
        self.progress = W.IntProgress(value=0, min=0, max=1, layout=W.Layout(width="180px",
                                                                            visibility="hidden"))
        self.status = W.HTML("Pick strategies and settings, then press <b>Run</b>.")
        self.error = W.HTML(layout=W.Layout(display="none"))
        self.timeline_fig = live_figure(placeholder("Timelines appear here after Run."), "ddplab-timeline")
        self.metrics_fig = live_figure(placeholder("Metrics appear here after Run.", 200), "ddplab-metrics")
        self._fit = FitWidth()
        c = self.controls
        self.widget = W.VBox([
            W.HTML("<b>Strategies</b> (each runs on the same ranks, steps interleaved):"),
            W.HBox(list(self.strategy_boxes.values()), layout=W.Layout(flex_flow="row wrap")),
            W.HBox([W.VBox([c["bucket_cap_mb"], c["n_params"], c["batch_size"], c["steps"]]),
                    W.VBox([c["world_size"], self.world_note, c["straggler_rank"],
                            c["straggler_factor"], c["link"]])],
                   layout=W.Layout(flex_flow="row wrap")),  # one column on narrow screens
            W.HBox([self.button, self.progress, self.status], layout=W.Layout(align_items="center")),
            self.error, self.timeline_fig, self.metrics_fig, self._fit])
        self.widget.add_class("ddplab-panel")

    # -- the model: plain values read from the widgets ------------------------------
    def config(self) -> dict:
        c = self.controls
        rank = c["straggler_rank"].value
        rank = None if rank == NO_STRAGGLER else rank
        cfg = {"strategies": [s for s, box in self.strategy_boxes.items() if box.value],
               "bucket_cap_mb": float(c["bucket_cap_mb"].value), "n_params": int(c["n_params"].value),
               "batch_size": int(c["batch_size"].value), "world_size": int(c["world_size"].value),
               "straggler": None if rank is None else (rank, float(c["straggler_factor"].value)),
               "link": c["link"].value, "steps": int(c["steps"].value)}
        return dict(cfg, **self.extra_config)

    def spec(self, config=None):
        """The RunSpec for ``config`` (default: the widgets' values); raises on a bad value."""
        import dataclasses

        from ddplab.measure.spec import RunSpec  # imports torch: only when a run is asked for

        config = self.config() if config is None else config
        fields = {f.name for f in dataclasses.fields(RunSpec)}
        return RunSpec(**{k: v for k, v in config.items() if k in fields})

    # -- view bookkeeping: widgets observe state, they compute nothing ----------------
    def _update_straggler_options(self, keep=None):
        w = self.controls["world_size"].value
        box = self.controls["straggler_rank"]
        current = keep[0] if isinstance(keep, (tuple, list)) else box.value
        box.options = [("none", NO_STRAGGLER)] + [(f"rank {r}", r) for r in range(w)]
        box.value = current if current is not None and 0 <= current < w else NO_STRAGGLER
        if isinstance(keep, (tuple, list)):
            self.controls["straggler_factor"].value = float(keep[1])

    def _on_world_size(self, _change=None):
        self._update_straggler_options()
        w = self.controls["world_size"].value
        self.world_note.value = (f"<span style='color:#b02a37;margin-left:115px'>oversubscribed: {w} "
                                 f"ranks on {self.usable_cpus} CPUs</span>" if w > self.usable_cpus else "")

    def _on_straggler(self, _change=None):
        self.controls["straggler_factor"].disabled = self.controls["straggler_rank"].value == NO_STRAGGLER

    # -- running ----------------------------------------------------------------------
    def _report_progress(self, done, total, message=""):
        self.progress.max = max(1, int(total))
        self.progress.value = min(int(done), self.progress.max)
        self.status.value = f"Running… {html.escape(str(message))} ({done}/{total})"

    def _takes_progress(self) -> bool:
        try:
            params = inspect.signature(self.runner).parameters
        except (TypeError, ValueError):
            return False
        # compare()'s own progress is a bool (print lines); only a None default means a callback
        return "progress" in params and params["progress"].default is None

    def _call_runner(self, config):
        if self._takes_progress():
            return self.runner(progress=self._report_progress, **config)
        return self.runner(**config)

    def run(self, _button=None):
        """Run once with the current settings (what the Run button does). Returns the result or None."""
        config = self.config()
        self.runs += 1
        n = self.runs
        started = time.perf_counter()
        self.button.disabled = True
        # a bar that never moves would mislead: shown only when the runner reports progress
        self.progress.layout.visibility = "visible" if self._takes_progress() else "hidden"
        self.progress.value, self.progress.max = 0, max(1, len(config["strategies"]))
        self.status.value = (f"Running #{n}: {', '.join(config['strategies']) or 'nothing'} on "
                             f"{config['world_size']} rank(s)… the kernel is busy until it finishes.")
        try:
            if not config["strategies"]:
                raise ValueError("pick at least one strategy")
            self.spec(config)  # a bad setting is reported here, before any rank is busy
            timelines, metrics = normalize_result(self._call_runner(config))
            new_timeline, new_metrics = compare_figures(timelines, metrics, self.iterations)
            refresh(self.timeline_fig, new_timeline)
            refresh(self.metrics_fig, new_metrics)
        except Exception as e:  # shown, logged, survived: the panel stays usable
            log.exception("ddplab panel run #%d failed with config %r", n, config)
            self.last_error = e
            self._show_error(n, e)
            self.status.value = f"Run #{n} failed: see below."
            return None
        finally:
            self.button.disabled = False
            self.progress.layout.visibility = "hidden"
        self._fit.runs += 1
        self.result = {"config": config, "timelines": timelines, "metrics": metrics}
        self.last_error = None
        self.error.layout.display = "none"
        link = next((tl.meta["simulated_link"] for tl in timelines.values()
                     if tl.meta.get("simulated_link")), None)
        where = f" · SIMULATED link: {html.escape(link.get('label', ''))}" if link else ""
        self.status.value = (f"Run #{n} done in {time.perf_counter() - started:.1f} s: "
                             f"{', '.join(timelines)} · {config['world_size']} rank(s){where}")
        return self.result

    def _show_error(self, n, e):
        tb = html.escape("".join(traceback.format_exception(e)))
        self.error.value = (
            "<div style='border-left:4px solid #b02a37;background:#fdecea;padding:6px 10px'>"
            f"<b>Run #{n} failed: {html.escape(type(e).__name__)}</b>: "
            f"<span style='white-space:pre-wrap'>{html.escape(str(e))}</span><br>"
            "The figures still show the last good run. Change a setting and press Run again."
            f"<details><summary>traceback</summary><pre style='font-size:11px'>{tb}</pre></details></div>")
        self.error.layout.display = None

    # -- display -----------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
