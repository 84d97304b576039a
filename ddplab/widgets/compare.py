"""Side by side: the same training step done by several strategies, on one time scale.

Teaches: where each strategy's communication sits relative to backward, and
what that costs. Every strategy gets its own Gantt panel (rank x
{compute, comm}); all panels share one time axis and each panel's iteration
starts at 0 ms, so longer bars and later ends read directly as "slower". By
default each panel shows the last counted iteration (warm-up and torch DDP's
rebuild iterations are not the typical step; ``timeline_figure`` shows them,
labelled). The metrics chart beside it puts numbers on the picture: step
time, exposed communication (last all-reduce end minus backward end),
``saved_ms`` (manual's step time minus this one's) and bytes all-reduced per
step.

Leaves out: error bars (metrics are medians over the counted iterations),
per-rank breakdowns (``wait_ms_by_rank`` is in the metrics dict).
References: ddplab.timeline.metrics for the definitions.
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ddplab.timeline import Timeline
from ddplab.widgets.gantt import (
    comm_rows,
    flagged_spans,
    gantt_traces,
    mark_flagged,
    origin_of,
    run_labels,
    select_iterations,
    style_rows,
)

METRICS = (("step_ms", "step time", "#4a4a4a"),
           ("exposed_comm_ms", "exposed comm<br>(after backward)", "#d95f02"),
           ("saved_ms", "saved vs manual", "#1b9e77"))
LABEL_COLOR = "#b02a37"


def titled(text: str, labels=()) -> dict:
    """A figure title with one red line per label (simulated link, oversubscribed, demo)."""
    lines = "".join(f"<br><span style='font-size:12px;color:{LABEL_COLOR}'><b>{lab}</b></span>"
                    for lab in labels)
    return dict(text=text + lines, x=0.01, xanchor="left", yref="container", y=1, yanchor="top",
                pad=dict(t=12))


def _subtitle(name, tl, shown, own_labels):
    every = tl.iteration_numbers(include_flagged=True)
    which = "iteration" if len(shown) == 1 else "iterations"
    text = (f"<b>{name}</b> — {which} {', '.join(map(str, shown)) or 'none'} "
            f"(of {len(every)} recorded)")
    if own_labels:
        text += f"  <span style='color:{LABEL_COLOR}'>[" + "; ".join(own_labels) + "]</span>"
    return text


def compare_timelines_figure(timelines: dict, iterations=1, height=None,
                             by_op=False) -> go.Figure:
    """Stacked Gantt panels, one per strategy, on one shared time axis.

    ``iterations`` as in ``gantt.select_iterations``: by default the last
    counted iteration of each strategy, each starting at 0 ms. ``by_op``: colour the
    collectives recorded from the group by operation, not by bucket.
    """
    names = list(timelines)
    n = max(1, len(names))
    ranks_of = {s: sorted({it.rank for it in tl.iterations} | {b.rank for b in tl.buckets})
                for s, tl in timelines.items()}
    # a panel's height: its rows (a recorded fully_shard run has 3 per rank, DDP 2)
    weights = [max(1, len(ranks_of[s])) * (1 + len(comm_rows(timelines[s]))) / 2 for s in names] or [1]
    shown_of = {s: select_iterations(tl, iterations) for s, tl in timelines.items()}
    labels_of = {s: run_labels(tl) for s, tl in timelines.items()}
    common = [lab for lab in (labels_of[names[0]] if names else [])
              if all(lab in labels_of[s] for s in names)]
    fig = make_subplots(rows=n, cols=1, shared_xaxes=True, vertical_spacing=0.25 / n + 0.02,
                        row_heights=[w / sum(weights) for w in weights],
                        subplot_titles=[_subtitle(s, timelines[s], shown_of[s],
                                                  [lab for lab in labels_of[s] if lab not in common])
                                        for s in names] or ["(nothing run yet)"])
    for a in fig.layout.annotations:  # subplot titles: left-aligned, smaller
        a.update(x=0, xanchor="left", font=dict(size=12))
    hidden, any_flagged, in_legend = 0, False, set()
    for k, s in enumerate(names):
        tl, shown = timelines[s], shown_of[s]
        origin = origin_of(tl, shown)
        traces, h = gantt_traces(tl, shown, origin, by_op=by_op)
        hidden += h
        for t in traces:  # one legend entry per kind of bar, from the first panel that has it
            t.showlegend = t.legendgroup not in in_legend
            in_legend.add(t.legendgroup)
            fig.add_trace(t, row=k + 1, col=1)
        style_rows(fig, ranks_of[s], row=k + 1, col=1, tl=tl)
        spans = flagged_spans(tl, shown, origin)
        any_flagged |= bool(spans)
        axis = "" if k == 0 else str(k + 1)
        mark_flagged(fig, spans, xref=f"x{axis}", yref=f"y{axis}")
    fig.update_xaxes(showticklabels=True)
    fig.update_xaxes(title_text="time since the iteration started (ms) — the same scale in every panel"
                     + (" · shaded iterations are not averaged" if any_flagged else ""), row=n, col=1)
    fig.update_layout(
        barmode="overlay", bargap=0.25, template="plotly_white",
        title=titled("One training step, strategy by strategy", common),
        height=height or 200 + 18 * len(common) + sum(90 + 45 * w for w in weights),
        legend=dict(orientation="h", yref="container", y=0, yanchor="bottom", x=0),
        uniformtext=dict(minsize=8, mode="hide"),
        margin=dict(l=10, r=10, t=90 + 18 * len(common), b=110), hoverlabel=dict(align="left"))
    if hidden:
        fig.add_annotation(text=f"{hidden} GPU all-reduce(s) with only host stamps not drawn",
                           xref="paper", yref="paper", x=1, y=0, yshift=-45, showarrow=False,
                           xanchor="right", font=dict(color=LABEL_COLOR))
    return fig


def metrics_figure(metrics: dict, labels=(), height=380) -> go.Figure:
    """Bars per strategy: step, exposed comm, saved_ms (ms, left); MiB all-reduced (right).
    A metric no strategy has (saved_ms when manual did not run) gets no bars and no legend."""
    names = list(metrics)
    # a sharded run (FSDP: exposed comm is None there) all-gathers and reduce-scatters instead
    sharded = any(m.get("exposed_comm_ms") is None and m.get("n_buckets") for m in metrics.values())
    fig = make_subplots(rows=1, cols=2, column_widths=[0.72, 0.28], horizontal_spacing=0.1,
                        subplot_titles=["time per step (ms, median of counted iterations)",
                                        "collectives' buffer sizes per step (MiB)" if sharded else
                                        "all-reduced per step (MiB)"])
    for key, label, color in METRICS:
        ys = [metrics[s].get(key) for s in names]
        if all(v is None for v in ys):  # e.g. saved_ms without a manual run: no legend entry
            continue
        fig.add_trace(go.Bar(
            name=label.replace("<br>", " "), x=names, y=ys, marker_color=color,
            text=["–" if v is None else f"{v:.1f}" for v in ys], textposition="outside",
            cliponaxis=False, hovertemplate=f"<b>%{{x}}</b><br>{label.replace('<br>', ' ')}: "
                                            "%{y:.2f} ms<extra></extra>"), row=1, col=1)
    mib = [(metrics[s].get("comm_bytes_per_step") or 0) / 2**20 for s in names]
    # beside a sharded run: what each rank sends on a ring (an all-gather or a reduce-scatter
    # (p-1)/p of its buffer, an all-reduce twice that), not the buffers' sizes summed
    ring = sharded and all(metrics[s].get("ring_bytes_per_step") is not None for s in names)
    if ring:
        fig.layout.annotations[1].text = "sent per rank on a ring, per step (MiB)"
    shown = [metrics[s]["ring_bytes_per_step"] / 2**20 for s in names] if ring else mib
    fig.add_trace(go.Bar(
        name="MiB per step", x=names, y=shown, showlegend=False, marker_color="#8c8c8c",
        text=[f"{v:.3g}" for v in shown], textposition="outside", cliponaxis=False,
        customdata=[metrics[s].get("n_buckets", 0) for s in names],
        hovertext=[f"buffer sizes: {m:.4f} MiB in " for m in mib] if ring else None,
        hovertemplate="<b>%{x}</b><br>%{y:.4f} MiB "
                      + ("sent per rank on a ring ((p-1)/p of each all-gather's and reduce-scatter's "
                         "buffer, 2(p-1)/p of each all-reduce's)<br>%{hovertext}" if ring else "in ")
                      + "%{customdata} " + ("collective(s)" if sharded else "all-reduce(s)")
                      + "<extra></extra>"),
        row=1, col=2)
    fig.update_layout(barmode="group", template="plotly_white", height=height + 18 * len(labels),
                      title=titled("Metrics", labels),
                      legend=dict(orientation="h", yref="container", y=0, yanchor="bottom", x=0),
                      margin=dict(l=10, r=10, t=90 + 18 * len(labels), b=70))
    fig.update_yaxes(title_text="ms", row=1, col=1, zeroline=True, zerolinecolor="#888")
    fig.update_yaxes(rangemode="tozero")
    return fig


def normalize_result(result):
    """(timelines, metrics) from a runner's result, read as they are: the runner
    (compare(), DemoRunner) computed the metrics and labelled the timelines."""
    get = (result.get if isinstance(result, dict) else lambda k, d=None: getattr(result, k, d))
    timelines, metrics = get("timelines"), get("metrics")
    if not isinstance(timelines, dict) or not timelines or not isinstance(metrics, dict):
        raise TypeError("the runner must return {'timelines': {name: Timeline}, 'metrics': {name: "
                        "dict}} (ddplab.timeline.summarize and add_saved_ms compute metrics); "
                        f"got {type(result).__name__}")
    missing = [k for k in timelines if k not in metrics]
    if missing:
        raise TypeError(f"the runner returned no metrics for {', '.join(missing)}")
    timelines = {k: v if isinstance(v, Timeline) else Timeline.from_dict(v) for k, v in timelines.items()}
    return timelines, {k: dict(v) for k, v in metrics.items()}


def compare_figures(timelines: dict, metrics: dict, iterations=1):
    """(timelines figure, metrics figure) for one compare() result."""
    labels = [run_labels(tl) for tl in timelines.values()]
    common = [lab for lab in labels[0] if all(lab in other for other in labels)] if labels else []
    return compare_timelines_figure(timelines, iterations), metrics_figure(metrics, common)


def one_axis_figure(runs: dict):
    """``{name: what ddplab.lessons.sharding.traffic_on_rank returned on each rank}`` drawn as
    one figure: a panel per strategy, every rank's compute and collectives, one time axis."""
    from ddplab.timeline.records import Timeline

    timelines = {name: Timeline.merge([Timeline.from_dict(r["timeline"]) for r in per_rank])
                 for name, per_rank in runs.items()}
    fig = compare_timelines_figure(timelines, iterations=[0], by_op=True)
    fig.update_layout(title_text="One step per strategy, every collective drawn from the group")
    return fig
