"""Gantt timelines: what every rank computed and communicated, and when.

Teaches: to read one DDP step. Each rank gets two rows, "compute" (forward,
backward, waiting, optimizer step) and "comm" (one bar per bucket
all-reduce, from the moment it was in flight to the moment its result was
there; buckets in flight at the same time get lanes of their own in the row).
A bucket has the same colour on every rank and in every figure (its index
picks the colour), so bucket 2 on rank 0 is easy to match with bucket
2 on rank 1, and with bucket 2 of another strategy. Hovering a bar shows the
bucket's parameters, bytes, when its gradients were ready, when it launched,
how long it was in flight, and where each stamp came from (cpu clock, CUDA
event, NCCL timing, derived, simulated).

A recorded ``fully_shard`` run (ddplab.measure.recording_fsdp) has no buckets: each rank gets
an "all-gather" and a "reduce-scatter" row instead of "comm" (in backward the two overlap), one
colour per operation, and the hover names the FSDP unit and its padded bytes.

Honest labels: a simulated link is named on the figure and its transfers are
hatched; runs with more ranks than CPUs say "oversubscribed"; torch DDP's
first iterations (one bucket, then the rebuild), warm-up and ``no_sync``
iterations are shaded and named, since they are not averaged in. On GPUs a
CPU-clock communication stamp is when the host asked for the all-reduce, not
when NCCL ran it: such bars are not drawn, and the figure says how many.

Leaves out: kernel-level detail, flows between ranks, memory. Perfetto shows
the same data (``ddplab.timeline.write_chrome_trace``) with more zooming.
References: plotly horizontal bars with ``base``; torch's Reducer
(bucket order, rebuild after the first iteration).
"""
from __future__ import annotations

import plotly.graph_objects as go

from ddplab.timeline import Timeline

# "no_sync": a recorded step's gradient-accumulation micro-steps, before its synchronizing one
PHASE_COLORS = {"no_sync": "#c6dbef", "forward": "#9ecae1", "backward": "#2b6cb0", "wait": "#e2e2e2",
                "step": "#41ab5d"}
PHASE_LABELS = {"no_sync": "no_sync micro-steps (forward + backward, no all-reduce)", "forward": "forward",
                "backward": "backward", "wait": "waiting for all-reduce", "step": "optimizer step"}
# Warm colours, away from the blues and greens of compute.
BUCKET_PALETTE = ("#f28e2b", "#9467bd", "#e15759", "#8c564b", "#e377c2", "#bcbd22",
                  "#17becf", "#b07aa1", "#ff9da7", "#c49c94")
FLAG_LABELS = {"warmup": "warm-up (not averaged)",
               "ddp_one_bucket": "torch DDP before its bucket rebuild: one bucket (not averaged)",
               "ddp_rebuild": "torch DDP: buckets rebuilt (not averaged)",
               "no_sync": "no_sync: gradients accumulate, no all-reduce"}
FLAG_SHORT = {"warmup": "warm-up", "ddp_one_bucket": "DDP: 1 bucket", "ddp_rebuild": "DDP: rebuild",
              "no_sync": "no_sync"}
COMM_LABEL = "all-reduce (colour = bucket)"
COMM_LABEL_SIMULATED = "all-reduce (colour = bucket, hatched = simulated link)"


# Collectives recorded from the process group (FSDP, ZeRO): coloured by what they do, each with
# a line saying it, instead of by DDP's bucket index.
OP_STYLE = {
    "all_reduce": ("all-reduce", "#d9480f", "every rank ends with the sum over ranks of the whole "
                   "tensor (DDP: the gradients)"),
    "all_gather_into_tensor": ("all-gather", "#7048e8", "every rank ends with every rank's piece, "
                               "concatenated (FSDP: a layer's full weights)"),
    "reduce_scatter_tensor": ("reduce-scatter", "#c2255c", "rank r ends with the sum over ranks "
                              "of piece r only (FSDP: its shard of the gradient)"),
    "broadcast": ("broadcast", "#e8a317", "every rank ends with the source rank's tensor "
                  "(ZeRO-1: the owner's updated parameters)"),
}


def op_of(b):
    """The collective a bar recorded from the group stands for (its params are (op, phase), or
    (op, phase, unit) from ``ddplab.record`` of a fully_shard-ed model), or None for a DDP bucket."""
    return b.params[0] if len(b.params) in (2, 3) and b.params[0] in OP_STYLE else None


def own_rows(tl: Timeline) -> bool:
    """Whether ``tl``'s collectives get a row per operation on each rank (a recorded
    fully_shard run, ddplab.measure.recording_fsdp: its all-gathers and reduce-scatters
    overlap in backward), instead of one "comm" row."""
    return tl.strategy == "fully_shard"


def comm_rows(tl: Timeline | None) -> tuple:
    """The communication rows each rank of ``tl`` gets under its compute row."""
    if tl is not None and own_rows(tl):
        return tuple(OP_STYLE[op][0] for op in ("all_gather_into_tensor", "reduce_scatter_tensor"))
    return ("comm",)


def bucket_color(index: int) -> str:
    """The colour of bucket ``index``, the same in every figure."""
    return BUCKET_PALETTE[index % len(BUCKET_PALETTE)]


def in_flight_lanes(tl: Timeline, shown) -> dict:
    """(rank, iteration, index) -> (lanes that rank needs, this bucket's lane): a bucket takes
    the first lane free when it launches, so two buckets in flight at once never share one."""
    out, by_rank = {}, {}
    for b in tl.buckets:
        span = b.comm_interval()
        if b.iteration in shown and span is not None:
            by_rank.setdefault(b.rank, []).append((span, b))
    for items in by_rank.values():
        ends, placed = [], []
        for (a, e), b in sorted(items, key=lambda item: item[0]):
            k = next((k for k, end in enumerate(ends) if end <= a), len(ends))
            ends[k:k + 1] = [e]
            placed.append(((b.rank, b.iteration, b.index), k))
        out.update({key: (len(ends), k) for key, k in placed})
    return out


def row_names(ranks, comm=("comm",)) -> list[str]:
    return [f"rank {r} {kind}" for r in ranks for kind in ("compute", *comm)]


def select_iterations(tl: Timeline, iterations=None) -> list[int]:
    """None: every iteration (flagged ones too); n: the last n counted ones; a list: those."""
    every = tl.iteration_numbers(include_flagged=True)
    if iterations is None:
        return every
    if isinstance(iterations, int):
        counted = tl.iteration_numbers() or every
        return counted[-iterations:] if iterations > 0 else []
    return [i for i in every if i in set(iterations)]


def origin_of(tl: Timeline, shown) -> float:
    starts = [it.start for it in tl.iterations if it.iteration in shown and it.start is not None]
    starts += [a for it in tl.iterations if it.iteration in shown for a, _ in it.phases.values()
               if a is not None]
    return min(starts) if starts else 0.0


def run_labels(tl: Timeline) -> list[str]:
    """Labels a picture of ``tl`` must carry: demo data, simulated link, oversubscription,
    and a straggler when ``meta["straggler"]`` is (rank, factor)."""
    out = ["DEMO: invented numbers, not measured"] if tl.meta.get("demo") else []
    link = tl.meta.get("simulated_link")
    if link:
        out.append(f"SIMULATED link: {link.get('label', 'custom')} "
                   f"({link.get('bandwidth_gbps', '?')} Gbit/s, {link.get('latency_us', '?')} µs)")
    if tl.meta.get("oversubscribed"):
        cpus = tl.meta.get("usable_cpus")
        out.append(f"OVERSUBSCRIBED: {tl.world_size} ranks on {cpus if cpus else 'fewer'} CPUs "
                   "(compute slowed down)")
    straggler = tl.meta.get("straggler")
    if straggler:
        rank, factor = straggler
        out.append(f"straggler: rank {rank} slowed ×{factor:g}")
    return out + list(tl.meta.get("labels", ()))


def with_link_label(text: str, simulated_link) -> str:
    """A figure title, with a red "SIMULATED link" part when the run had one."""
    if not simulated_link:
        return text
    return (f"{text} — <span style='color:#b02a37'>SIMULATED link: "
            f"{simulated_link.get('label', 'custom')}</span>")


def _ms(t, origin):
    return 1000.0 * (t - origin)


def _params_text(params, limit=6):
    params = list(params)
    shown = ", ".join(params[:limit])
    return shown + (f", … and {len(params) - limit} more" if len(params) > limit else "")


def _drawable(tl: Timeline, b) -> bool:
    # A CPU stamp on a GPU run is when the host asked, not when NCCL finished.
    return not (tl.backend == "nccl" and b.sources.get("comm_end", "cpu") == "cpu")


def gantt_traces(tl: Timeline, iterations=None, origin=None, legend=True, name_suffix="",
                 by_op=False):
    """Bar traces for ``tl``: one per compute phase, one for all bucket all-reduces (with
    ``by_op``, where the bars were recorded from the group: one per collective operation).

    Returns (traces, hidden): ``hidden`` counts communication bars not drawn
    because only a host-side stamp exists.
    """
    shown = select_iterations(tl, iterations)
    if origin is None:
        origin = origin_of(tl, shown)
    traces, hidden = [], 0
    for phase in PHASE_COLORS:
        y, x, base, hover = [], [], [], []
        for it in sorted(tl.iterations, key=lambda i: (i.iteration, i.rank)):
            span = it.phases.get(phase)
            if it.iteration not in shown or span is None or None in span:
                continue
            a, b = _ms(span[0], origin), _ms(span[1], origin)
            y.append(f"rank {it.rank} compute")
            base.append(a)
            x.append(b - a)
            flags = "".join(f"<br>{FLAG_LABELS.get(f, f)}" for f in sorted(it.flags))
            hover.append(f"<b>{PHASE_LABELS[phase]}</b> · rank {it.rank} · iteration {it.iteration}"
                         f"<br>{a:.1f} → {b:.1f} ms = <b>{b - a:.1f} ms</b>"
                         f"<br>stamp source: {it.sources.get(phase, 'cpu')}{flags}")
        if x:
            traces.append(go.Bar(
                name=PHASE_LABELS[phase] + name_suffix, orientation="h", y=y, x=x, base=base,
                marker=dict(color=PHASE_COLORS[phase], line=dict(width=0.5, color="white")),
                hovertext=hover, hovertemplate="%{hovertext}<extra></extra>",
                legendgroup=phase, showlegend=legend))
    drawn = []
    for b in sorted(tl.buckets, key=lambda b: (b.iteration, b.rank, b.index)):
        if b.iteration not in shown or b.comm_interval() is None:
            continue
        if not _drawable(tl, b):
            hidden += 1
            continue
        drawn.append(b)
    if (by_op or own_rows(tl)) and any(op_of(b) for b in drawn):  # recorded from the group: one trace per op
        for op, (label, color, what) in OP_STYLE.items():
            traces += _op_trace(tl, [b for b in drawn if op_of(b) == op], origin, label, color,
                                what, legend, name_suffix)
        return traces, hidden
    y, x, base, hover, colors, patterns, labels, index = [], [], [], [], [], [], [], []
    lanes = in_flight_lanes(tl, shown)
    lane, n_lanes = [], max((n for n, _ in lanes.values()), default=1)
    for b in drawn:
        span = b.comm_interval()
        a, e = _ms(span[0], origin), _ms(span[1], origin)
        ready = "?" if b.grads_ready is None else f"{_ms(b.grads_ready, origin):.1f}"
        launch = "?" if b.launch is None else f"{_ms(b.launch, origin):.1f}"
        held = ("" if b.grads_ready is None or b.launch is None else
                f" (held {1000 * (b.launch - b.grads_ready):.1f} ms for earlier buckets)"
                if b.launch - b.grads_ready > 5e-4 else "")
        sources = ", ".join(f"{k}={v}" for k, v in sorted(b.sources.items())) or "cpu"
        y.append(f"rank {b.rank} comm")
        lane.append(lanes[(b.rank, b.iteration, b.index)][1])
        base.append(a)
        x.append(e - a)
        colors.append(bucket_color(b.index))
        patterns.append("/" if b.simulated else "")
        labels.append(f"b{b.index}")
        index.append(b.index)
        hover.append(f"<b>bucket {b.index}</b> · rank {b.rank} · iteration {b.iteration}"
                     f"<br>{b.nbytes:,} bytes ({b.nbytes / 2**20:.2f} MiB), {len(b.params)} parameter(s)"
                     + (f"<br>{b.wire_nbytes:,} bytes on the wire (the comm hook's compressed size)"
                        if b.wire_nbytes is not None and b.wire_nbytes != b.nbytes else "")
                     + f"<br>params: {_params_text(b.params)}"
                     f"<br>grads ready {ready} ms → launched {launch} ms{held}"
                     f"<br>in flight {a:.1f} → {e:.1f} ms = <b>{e - a:.1f} ms</b>"
                     f"<br>stamp sources: {sources}"
                     + ("<br><b>SIMULATED link</b>" if b.simulated else ""))
    if x:
        # buckets in flight at once: each on a lane of its own within its rank's row
        stack = ({} if n_lanes == 1 else
                 dict(width=[0.8 / n_lanes] * len(x), offset=[-0.4 + k * 0.8 / n_lanes for k in lane]))
        traces.append(go.Bar(
            **stack,
            name=(COMM_LABEL_SIMULATED if "/" in patterns else COMM_LABEL) + name_suffix,
            orientation="h", y=y, x=x, base=base,
            marker=dict(color=colors, pattern=dict(shape=patterns, fillmode="overlay", size=6),
                        line=dict(width=0.5, color="white")),
            text=labels, textposition="inside", insidetextanchor="middle", customdata=index,
            hovertext=hover, hovertemplate="%{hovertext}<extra></extra>",
            legendgroup="comm", showlegend=legend))
    return traces, hidden


def _op_trace(tl, buckets, origin, label, color, what, legend, name_suffix) -> list:
    """One trace for every call of one collective: its colour, and hover text that says what it
    does, in which phase, how many bytes the rank handed the group, and when."""
    y, x, base, hover = [], [], [], []
    row = label if own_rows(tl) else "comm"
    for b in buckets:
        a, e = (_ms(t, origin) for t in b.comm_interval())
        y.append(f"rank {b.rank} {row}")
        base.append(a)
        x.append(e - a)
        size = (f"{b.nbytes:,} bytes handed to the group ({b.nbytes / 2**20:.2f} MiB)" if len(b.params) == 2 else
                f"unit <b>{b.params[2]}</b>: {b.nbytes:,} bytes of padded flat parameters "
                f"({b.nbytes / 2**20:.2f} MiB; the all-gather's output, the reduce-scatter's input)")
        hover.append(f"<b>{label}</b> · rank {b.rank} · iteration {b.iteration} · {b.params[1]}"
                     f"<br>{what}<br>{size}"
                     f"<br>params: {', '.join(b.params)}<br>in flight {a:.1f} → {e:.1f} ms"
                     f" = <b>{e - a:.1f} ms</b>")
    if not x:
        return []
    return [go.Bar(name=label + name_suffix, orientation="h", y=y, x=x, base=base,
                   marker=dict(color=color, line=dict(width=0.5, color="white")),
                   hovertext=hover, hovertemplate="%{hovertext}<extra></extra>",
                   legendgroup=f"comm {label}", showlegend=legend)]


def flagged_spans(tl: Timeline, iterations=None, origin=None):
    """(x0_ms, x1_ms, short label, long label) for every shown iteration that carries flags."""
    shown = select_iterations(tl, iterations)
    if origin is None:
        origin = origin_of(tl, shown)
    out = []
    for i in shown:
        its = [it for it in tl.iterations if it.iteration == i]
        flags = sorted(set().union(*(it.flags for it in its))) if its else []
        starts = [it.start for it in its if it.start is not None]
        ends = [it.end for it in its if it.end is not None]
        if flags and starts and ends:
            out.append((_ms(min(starts), origin), _ms(max(ends), origin),
                        f"it {i}: " + ", ".join(FLAG_SHORT.get(f, f) for f in flags),
                        f"iteration {i}: " + "; ".join(FLAG_LABELS.get(f, f) for f in flags)))
    return out


def mark_flagged(fig, spans, xref="x", yref="y"):
    """Shade flagged iterations and name them just above the plot (alternating heights)."""
    for k, (x0, x1, short, long) in enumerate(spans):
        fig.add_shape(type="rect", x0=x0, x1=x1, xref=xref, y0=0, y1=1, yref=f"{yref} domain",
                      fillcolor="#fff3bf", opacity=0.7, layer="below", line_width=0)
        fig.add_annotation(x=(x0 + x1) / 2, xref=xref, y=1, yref=f"{yref} domain", yanchor="bottom",
                           yshift=1 + 13 * (k % 2), showarrow=False, text=short, hovertext=long,
                           font=dict(size=10, color="#7a5b00"))


def style_rows(fig, ranks, row=None, col=None, tl=None):
    """Rank 0 on top, compute above comm (above all-gather and reduce-scatter for ``tl``, a
    recorded fully_shard run)."""
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=row_names(ranks, comm_rows(tl)),
                     autorange="reversed", row=row, col=col)


def timeline_figure(tl: Timeline, iterations=None, title=None, height=None) -> go.Figure:
    """One strategy's Gantt chart: rows rank x {compute, comm}, time in ms."""
    shown = select_iterations(tl, iterations)
    origin = origin_of(tl, shown)
    traces, hidden = gantt_traces(tl, shown, origin)
    ranks = sorted({it.rank for it in tl.iterations} | {b.rank for b in tl.buckets})
    labels = run_labels(tl)
    fig = go.Figure(traces)
    spans = flagged_spans(tl, shown, origin)
    fig.update_layout(
        barmode="overlay", bargap=0.25, template="plotly_white",
        title=dict(text=title or f"{tl.strategy}: {tl.world_size} ranks, {tl.backend}"
                   + (" — simulated link" if tl.meta.get("simulated_link") else ""), x=0.01),
        xaxis_title="time since the first shown iteration started (ms)"
                    + (" · shaded iterations are not averaged" if spans else ""),
        height=height or 230 + 30 * (1 + len(comm_rows(tl))) * len(ranks) + 16 * len(labels),
        legend=dict(orientation="h", yref="container", y=0, yanchor="bottom", x=0),
        uniformtext=dict(minsize=8, mode="hide"),
        margin=dict(l=10, r=10, t=70 + 16 * len(labels), b=110),
        hoverlabel=dict(align="left"))
    style_rows(fig, ranks, tl=tl)
    mark_flagged(fig, spans)
    notes = labels + ([f"{hidden} all-reduce(s) have only host stamps on GPU: not drawn"]
                      if hidden else [])
    for k, text in enumerate(notes):
        fig.add_annotation(text=f"<b>{text}</b>", xref="paper", yref="paper", x=1.0, y=1.0,
                           yshift=30 + 16 * k, showarrow=False, xanchor="right",
                           font=dict(color="#b02a37", size=12))
    return fig
