"""Scaling: how much of each added rank turns into speed.

Teaches the two questions people mean by "does it scale?":
- strong scaling: the GLOBAL batch stays fixed and is split over p ranks.
  Ideal: p times faster. Efficiency = T(p0) * p0 / (T(p) * p).
- weak scaling: each rank keeps its OWN batch, so the global batch grows
  with p. Ideal: the step time stays flat. Efficiency = T(p0) / T(p).
(p0 is the smallest world size measured, usually 1.) Communication is why
both fall below 100 %: the all-reduce grows with p while the compute per rank
shrinks (strong) or stays (weak). On a laptop a second cause dominates once
there are more ranks than CPUs: ranks take turns on the cores. The figure
draws that line and shades what lies beyond it, so a collapse there is read
as oversubscription, not as DDP's fault.

Input is plain data: ``{world_size: step_ms}`` (or a list of pairs), or the
result of ``ddplab.measure.sweep.scaling``.
Leaves out: throughput in samples/s (same information), multi-node effects.
References: Amdahl (1967) and Gustafson (1988) for strong and weak scaling.
"""
from __future__ import annotations

import plotly.graph_objects as go

from ddplab.timeline.metrics import scaling_efficiency, world_size_pairs
from ddplab.widgets.gantt import with_link_label

COLORS = {"strong": "#2b6cb0", "weak": "#2ca02c"}
LABELS = {"strong": "strong scaling (fixed global batch)", "weak": "weak scaling (fixed batch per rank)"}


def efficiency(points, mode: str) -> dict[int, float]:
    """Efficiency in % per world size (``ddplab.timeline.metrics.scaling_efficiency`` x 100)."""
    return {p: 100.0 * e for p, e in scaling_efficiency(points, mode).items()}


def scaling_figure(strong=None, weak=None, usable_cpus: int | None = None, title=None,
                   simulated_link=None, height=420) -> go.Figure:
    """Efficiency (%) vs world size, with the oversubscription line at usable_cpus.

    ``strong`` may also be what ``ddplab.measure.sweep.scaling`` returns
    (rows with world_size, strong_step_ms, weak_step_ms).
    """
    if isinstance(strong, dict) and "rows" in strong:
        result, rows = strong, strong["rows"]
        strong = {r["world_size"]: r["strong_step_ms"] for r in rows}
        weak = weak or {r["world_size"]: r["weak_step_ms"] for r in rows}
        usable_cpus = usable_cpus or result.get("usable_cpus")
    if usable_cpus is None:
        from ddplab.placement.resources import usable_cpus as _usable  # no torch imported

        usable_cpus = _usable()
    fig = go.Figure()
    sizes = []
    for mode, points in (("strong", strong), ("weak", weak)):
        if not points:
            continue
        eff = efficiency(points, mode)
        step = dict(world_size_pairs(points))
        sizes += list(eff)
        fig.add_trace(go.Scatter(
            x=list(eff), y=list(eff.values()), mode="lines+markers", name=LABELS[mode],
            line=dict(color=COLORS[mode], width=2), marker=dict(size=9),
            customdata=[step[p] for p in eff],
            hovertemplate=f"{mode}: %{{x}} ranks<br>efficiency %{{y:.0f}} %"
                          "<br>step %{customdata:.1f} ms<extra></extra>"))
    top = max(sizes + [usable_cpus + 1, 2])
    fig.add_hline(y=100, line_dash="dot", line_color="#888", annotation_text="ideal",
                  annotation_position="top left")
    line_x = usable_cpus + 0.5
    fig.add_vrect(x0=line_x, x1=top + 0.5, fillcolor="#f8d7da", opacity=0.35, line_width=0,
                  layer="below")
    fig.add_vline(x=line_x, line_color="#b02a37", line_width=2)
    fig.add_annotation(x=line_x, y=1, yref="paper", xanchor="left", yanchor="top", showarrow=False,
                       text=f"<b>oversubscribed</b>: more ranks than the {usable_cpus} usable CPUs",
                       font=dict(color="#b02a37", size=11), xshift=4)
    text = with_link_label(title or "Scaling efficiency vs world size", simulated_link)
    fig.update_layout(template="plotly_white", height=height, title=dict(text=text, x=0.01),
                      legend=dict(orientation="h", y=-0.2, x=0), margin=dict(l=10, r=10, t=60))
    fig.update_xaxes(title_text="world size (ranks)", dtick=1, range=[0.5, top + 0.5])
    fig.update_yaxes(title_text="efficiency (%)", rangemode="tozero")
    return fig
