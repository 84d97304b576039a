"""What each rank holds: memory per rank, drawn from what was measured.

Teaches: under DDP every rank holds the whole model three times over and
more (parameters, gradients, and for Adam two state tensors per
parameter); under ZeRO-1 the optimizer state falls with each rank added,
while parameters and gradients stay whole. One bar per row and world size,
stacked: parameters, gradients, optimizer state; a marker for the peak
during the step (everything alive at once, activations and buffers too).

Input is plain data: the list ``ddplab.measure.memory.measure`` returns
(this module never trains). Where ranks differ (an uneven share), the bar
is the rank that holds the most.
Leaves out: a breakdown of the peak (what else was alive at that moment).
References: ZeRO (Rajbhandari et al., SC 2020), figure 1's per-device
memory of P_os against the baseline.
"""
from __future__ import annotations

import plotly.graph_objects as go

PARTS = (("params", "parameters", "#2b6cb0"), ("grads", "gradients", "#ed8936"),
         ("optimizer_state", "optimizer state", "#2ca02c"))
MB = 2 ** 20


def largest_rank(results) -> dict:
    """{(row, world_size): the measurement of the rank holding the most}."""
    out = {}
    for r in results:
        key = (r["row"], r["world_size"])
        total = sum(r[p] for p, _, _ in PARTS)
        if key not in out or total > sum(out[key][p] for p, _, _ in PARTS):
            out[key] = r
    return out


def memory_figure(results, title="Memory per rank, measured", height=420) -> go.Figure:
    """Stacked bars per (row, world size) in MiB, with the step's peak as a marker."""
    if not results:
        raise ValueError("no measurements to draw: pass what ddplab.measure.memory.measure() "
                         "returned")
    most = largest_rank(results)
    keys = sorted(most, key=lambda k: (k[1], list(dict.fromkeys(r["row"] for r in results))
                                       .index(k[0])))
    x = [[f"{ws} rank{'s' if ws > 1 else ''}" for _, ws in keys], [row for row, _ in keys]]
    fig = go.Figure()
    for field, label, color in PARTS:
        fig.add_bar(x=x, y=[most[k][field] / MB for k in keys], name=label, marker_color=color,
                    hovertemplate="%{x}: %{y:.2f} MiB " + label + "<extra></extra>")
    fig.add_scatter(x=x, y=[most[k]["peak"] / MB for k in keys], mode="markers",
                    name="peak during the step", marker=dict(symbol="line-ew-open", size=28,
                                                             color="#c53030", line_width=3),
                    hovertemplate="%{x}: peak %{y:.2f} MiB<extra></extra>")
    fig.update_layout(barmode="stack", title=title, height=height, yaxis_title="MiB per rank",
                      legend=dict(orientation="h", y=-0.25))
    return fig


def memory_table(results) -> str:
    """The same numbers as text: one line per (row, world size), in MiB."""
    most = largest_rank(results)
    lines = [f"{'row':<12}{'ranks':>6}{'params':>9}{'grads':>9}{'state':>9}{'peak':>9}  (MiB)"]
    for (row, ws), r in sorted(most.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"{row:<12}{ws:>6}" + "".join(
            f"{r[f] / MB:>9.2f}" for f in ("params", "grads", "optimizer_state", "peak")))
    return "\n".join(lines)


ROW_COLOURS = {"ddp": "#2b6cb0", "zero1": "#ed8936", "zero2": "#2ca02c", "fsdp": "#9f7aea"}
ROW_NAMES = {"ddp": "DDP", "zero1": "ZeRO-1 (whole parameters dealt)", "zero2": "ZeRO-2 (even slices)",
             "fsdp": "ZeRO-3 / FSDP"}


def memory_vs_ranks_figure(curve: dict, measured: dict | None = None,
                           title="Memory per rank against the number of ranks", height=460):
    """``curve`` (``ddplab.measure.memory_vs_ranks.curve``): per row, fits' prediction (solid,
    the largest rank) and ZeRO's formula (dotted); ``measured`` (``largest_held``): the
    measured points, ``{(row, world size): bytes}``. Parameters + gradients + optimizer state."""
    fig = go.Figure()
    ns = curve["world_sizes"]
    for row, values in curve["predicted"].items():
        colour = ROW_COLOURS.get(row, "#555")
        fig.add_trace(go.Scatter(x=ns, y=[v / MB for v in values], mode="lines+markers",
                                 name=f"{ROW_NAMES.get(row, row)}: predicted", legendgroup=row,
                                 line=dict(color=colour)))
        fig.add_trace(go.Scatter(x=ns, y=[v / MB for v in curve["formula"][row]], mode="lines",
                                 name="formula", legendgroup=row, showlegend=row == "ddp",
                                 line=dict(color=colour, dash="dot")))
        points = sorted((n, b) for (r, n), b in (measured or {}).items() if r == row)
        if points:
            fig.add_trace(go.Scatter(x=[n for n, _ in points], y=[b / MB for _, b in points],
                                     mode="markers", name=f"{row}: measured", legendgroup=row,
                                     marker=dict(color=colour, size=13, symbol="circle-open",
                                                 line=dict(width=2))))
    fig.update_layout(title=title, height=height, xaxis_title="ranks N",
                      yaxis_title="parameters + gradients + optimizer state per rank (MiB)",
                      xaxis=dict(dtick=1), legend=dict(groupclick="toggleitem"))
    return fig
