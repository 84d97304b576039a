"""Bucket-size sweep: step time and exposed communication against bucket_cap_mb.

Teaches: bucket size is a trade-off, not "bigger is better". Tiny buckets pay
the per-all-reduce latency (alpha) many times; huge buckets cannot launch
until most of backward is over, so little communication hides behind it.
Measured points sit next to the alpha-beta cost model's prediction
(``ddplab.netsim.costmodel.predict_step``): where they part, something the
model ignores is happening (on 2 CPU cores, communication threads slowing
backward down, for one). The x axis is logarithmic because interesting caps
span 0.1 MB to hundreds of MB; torch's default (25 MB) is marked.

Input is plain data, so a learner can plot their own numbers:
``sweep_figure([1, 5, 25], {"step_ms": [...], "exposed_comm_ms": [...]},
predicted={...})``, or a list of per-point dicts that carry
``bucket_cap_mb`` (and optionally ``predicted_step_ms``,
``predicted_exposed_ms``), or what ``ddplab.measure.sweep.bucket_sweep``
returns.

Leaves out: error bars, first-bucket caps (torch's small first bucket).
References: torch DDP's ``bucket_cap_mb``; Li et al., "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training" (VLDB 2020), section on
bucket size.
"""
from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ddplab.widgets.gantt import with_link_label

KEYS = (("step_ms", "step time (ms)"), ("exposed_comm_ms", "exposed communication (ms)"))
MEASURED_COLOR, PREDICTED_COLOR = "#2b6cb0", "#f28e2b"


def columns(points, n=None) -> dict:
    """{"step_ms": [...], ...} from a dict of lists or a list of per-point dicts."""
    if points is None:
        return {}
    if isinstance(points, dict):
        out = {k: list(v) for k, v in points.items()}
    else:
        points = list(points)
        keys = {k for p in points for k in p}
        out = {k: [p.get(k) for p in points] for k in keys}
    for k, v in out.items():
        if n is not None and len(v) != n:
            raise ValueError(f"{k!r} has {len(v)} values for {n} bucket sizes")
    return out


def sweep_figure(bucket_cap_mb, measured=None, predicted=None, simulated_link=None,
                 torch_default_mb: float | None = 25.0, title=None, height=420) -> go.Figure:
    """Two panels (step time, exposed comm) vs bucket_cap_mb on a log axis."""
    if isinstance(bucket_cap_mb, dict) and "rows" in bucket_cap_mb:  # a bucket_sweep() result
        simulated_link = simulated_link or bucket_cap_mb.get("simulated_link")
        bucket_cap_mb = bucket_cap_mb["rows"]
    if measured is None:  # a list of per-point dicts, each with its bucket_cap_mb
        measured = columns(bucket_cap_mb)
        bucket_cap_mb = measured.pop("bucket_cap_mb")
        if predicted is None:
            pred = {k: measured.get(f"predicted_{k}") or measured.get(f"predicted_{k.replace('_comm', '')}")
                    for k, _ in KEYS}
            predicted = {k: v for k, v in pred.items() if v and any(x is not None for x in v)} or None
    caps = [float(c) for c in bucket_cap_mb]
    if any(c <= 0 for c in caps):
        raise ValueError("bucket_cap_mb values must be > 0 for a log axis")
    m, p = columns(measured, len(caps)), columns(predicted, len(caps))
    order = sorted(range(len(caps)), key=caps.__getitem__)
    xs = [caps[i] for i in order]
    fig = make_subplots(rows=1, cols=2, shared_xaxes=True, horizontal_spacing=0.1,
                        subplot_titles=[label for _, label in KEYS])
    nb = m.get("n_buckets")
    for col, (key, _label) in enumerate(KEYS, start=1):
        if key in m:
            ys = [m[key][i] for i in order]
            extra = [nb[i] for i in order] if nb else ["?"] * len(xs)
            fig.add_trace(go.Scatter(
                x=xs, y=ys, mode="lines+markers", name="measured", legendgroup="measured",
                showlegend=(col == 1), line=dict(color=MEASURED_COLOR, width=2),
                marker=dict(size=9), customdata=extra,
                hovertemplate="bucket_cap_mb %{x}<br>measured %{y:.1f} ms"
                              "<br>%{customdata} bucket(s)<extra></extra>"), row=1, col=col)
            finite = [(y, x) for x, y in zip(xs, ys) if y is not None]
            if finite and key == "step_ms":
                best_y, best_x = min(finite)
                # annotations on a log axis take log10 of the position
                # the arrow points up from below the curve, clear of the torch-default label
                fig.add_annotation(x=math.log10(best_x), y=best_y, showarrow=True, arrowhead=2,
                                   ay=35, text=f"fastest measured: {best_x:g} MB", row=1, col=col)
        if key in p:
            fig.add_trace(go.Scatter(
                x=xs, y=[p[key][i] for i in order], mode="lines+markers", name="predicted (cost model)",
                legendgroup="predicted", showlegend=(col == 1),
                line=dict(color=PREDICTED_COLOR, dash="dash", width=2), marker=dict(symbol="x", size=9),
                hovertemplate="bucket_cap_mb %{x}<br>predicted %{y:.1f} ms<extra></extra>"),
                row=1, col=col)
    fig.update_xaxes(type="log", title_text="bucket_cap_mb (MB = 2**20 bytes, log scale)",
                     tickvals=xs, ticktext=[f"{x:g}" for x in xs])
    fig.update_yaxes(rangemode="tozero", title_text="ms")
    if torch_default_mb:
        for col in (1, 2):  # shapes take data values, annotations log10 of them
            fig.add_vline(x=torch_default_mb, line_dash="dot", line_color="#888", row=1, col=col)
            axis = "" if col == 1 else "2"
            fig.add_annotation(x=math.log10(torch_default_mb), xref=f"x{axis}", y=1,
                               yref=f"y{axis} domain", text=f"torch default {torch_default_mb:g} MB",
                               showarrow=False, xanchor="left", yanchor="top",
                               font=dict(size=10, color="#666"))
    text = with_link_label(title or "Bucket size: step time and exposed communication", simulated_link)
    fig.update_layout(template="plotly_white", height=height, title=dict(text=text, x=0.01),
                      legend=dict(orientation="h", y=-0.22, x=0), margin=dict(l=10, r=10, t=70))
    return fig
