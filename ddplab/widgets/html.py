"""Every figure as a standalone HTML page: the same picture without widgets or a kernel.

Teaches nothing new; it makes the pictures portable. A page opens in any
browser offline (plotly.js is inlined once, ~4.7 MB, however many figures the
page holds), so CI artifacts, ``python -m ddplab compare --html FILE`` (via
``compare_page``) and a learner without a live kernel all see the figures the
notebook shows.

Leaves out: interactivity that needs Python (the control panel); plotly's own
zoom, pan and hover work.
References: plotly.io.to_html (``include_plotlyjs``, ``full_html``).
"""
from __future__ import annotations

import html as _html
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio

from ddplab.widgets.compare import compare_figures, normalize_result
from ddplab.widgets.gantt import timeline_figure

_PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:system-ui,sans-serif;margin:1.5em;max-width:1300px}}
figure{{margin:0 0 2em 0}} figcaption{{color:#444;margin:.3em 0 .6em}}</style>
</head><body><h1>{title}</h1>{intro}{notes}
{body}
</body></html>
"""


# What each stamp source (ddplab.timeline.records.SOURCES) means, said on every report page
SOURCE_MEANINGS = {
    "cpu": "the host's clock when a hook or callback ran (on a GPU: when the host asked for "
           "the work, not when the GPU ran it)",
    "cuda_event": "a CUDA event recorded on the stream the work ran on, placed on the host clock",
    "cuda_event_queued": "a CUDA event recorded when the work was queued on its stream",
    "nccl_timing": "NCCL's own timing of the work (TORCH_NCCL_ENABLE_TIMING=1)",
    "profiler": "torch.profiler",
    "derived": "computed from other stamps, not read from a clock (e.g. backward starts where "
               "forward ends)",
    "simulated": "the simulated link's or the what-if's model, not a measurement",
}


def stamp_sources(timelines: dict) -> list:
    """The stamp sources the timelines use, in ddplab.timeline.records.SOURCES order
    (a stamp without a source of its own is a host stamp, ``cpu``, as the figures say)."""
    used = set()
    for tl in timelines.values():
        for it in tl.iterations:
            used.update(it.sources.get(p, "cpu") for p in it.phases)
        for b in tl.buckets:
            used.update(b.sources.values() or ["cpu"])
        used.update(g.source for g in tl.grads)
    order = list(SOURCE_MEANINGS)
    return sorted(used, key=lambda s: (order.index(s) if s in order else len(order), s))


def sources_html(timelines: dict) -> str:
    """One line per source label the page's stamps carry, with what it means."""
    items = "".join(f"<li><code>{_html.escape(s)}</code>: "
                    f"{_html.escape(SOURCE_MEANINGS.get(s, 'a source ddplab does not describe'))}</li>"
                    for s in stamp_sources(timelines))
    return (f"<div class='sources'><b>Stamp sources on this page</b> (each bar's hover says "
            f"its own):<ul>{items}</ul></div>") if items else ""


def _static(fig) -> go.Figure:
    # A FigureWidget carries widget state; a plain Figure is what to_html expects.
    return go.Figure(fig) if isinstance(fig, go.FigureWidget) else fig


def to_html(figures, title: str = "ddplab", captions=None, intro: str = "", notes_html: str = "") -> str:
    """One standalone page holding ``figures`` (a figure or a list), plotly.js inlined once.
    ``notes_html``: markup made by this module (already escaped), put under the intro."""
    if isinstance(figures, (go.Figure, go.FigureWidget)):
        figures = [figures]
    captions = list(captions or [])
    parts = []
    for k, fig in enumerate(figures):
        div = pio.to_html(_static(fig), include_plotlyjs=(k == 0), full_html=False,
                          config={"displaylogo": False, "responsive": True})
        cap = f"<figcaption>{_html.escape(captions[k])}</figcaption>" if k < len(captions) else ""
        parts.append(f"<figure>{cap}{div}</figure>")
    return _PAGE.format(title=_html.escape(title), body="\n".join(parts), notes=notes_html,
                        intro=f"<p>{_html.escape(intro)}</p>" if intro else "")


def write_html(path, figures, title: str = "ddplab", captions=None, intro: str = "") -> str:
    """Write ``to_html(...)`` to ``path``; returns the path as a string."""
    Path(path).write_text(to_html(figures, title, captions, intro), encoding="utf-8")
    return str(path)


def full_caption(tl, n_timelines: int) -> str:
    """The caption of one timeline drawn in full, true for its kind: what the gaps between its
    iterations are depends on where the iterations came from."""
    if tl.meta.get("predicted"):  # ddplab.measure.whatif: one step, laid out from a recording
        return ("one PREDICTED step, worked out from a recording's times, not measured; "
                "no gaps: the prediction has no time outside the step.")
    if tl.meta.get("recorded"):  # ddplab.record: the user's own loop, recorded as it ran
        return ("every recorded optimizer step; shaded ones are not averaged. Gaps between steps "
                "are your loop's own time outside a step: from the end of one optimizer step to "
                "the next forward (loading data, logging, evaluation, checkpoints).")
    gaps = (" Gaps between iterations are the other strategies' steps: compare() interleaves them."
            if n_timelines > 1 else "")
    return f"every measured iteration; shaded ones are not averaged.{gaps}"


def compare_report(timelines: dict, metrics: dict, title: str = "ddplab compare") -> str:
    """The page ``compare --html`` writes: side by side, metrics, then each strategy in full."""
    side, bars = compare_figures(timelines, metrics)
    figs = [side, bars] + [timeline_figure(tl) for tl in timelines.values()]
    saved = any(m.get("saved_ms") is not None for m in metrics.values())
    captions = ["The last counted iteration of every strategy, on one time scale.",
                "Medians over counted iterations" + ("; saved_ms is manual's step time minus "
                                                     "each one's." if saved else ".")]
    captions += [f"{name}: {full_caption(tl, len(timelines))}" for name, tl in timelines.items()]
    link = next((tl.meta.get("simulated_link") for tl in timelines.values()
                 if tl.meta.get("simulated_link")), None)
    intro = (f"Communication on a SIMULATED link ({link.get('label', 'custom')}); compute is real. "
             if link else "")
    if any(tl.meta.get("demo") for tl in timelines.values()):
        intro = "DEMO data: every number on this page is invented. " + intro
    return to_html(figs, title, captions, intro, sources_html(timelines))


def compare_page(result, path, title: str = "ddplab compare") -> str:
    """Write the report for one ``compare()`` result (what ``compare --html FILE`` does)."""
    timelines, metrics = normalize_result(result)
    Path(path).write_text(compare_report(timelines, metrics, title), encoding="utf-8")
    return str(path)
