"""Live figures: plotly FigureWidgets that change in place, at the width of their cell.

Teaches the jupyter-widgets way of updating a picture: keep one widget and
change its data and layout inside ``fig.batch_update()``, so the browser gets
one message and redraws once, instead of displaying a new figure per run
(outputs pile up, the page jumps, memory grows).

Leaves out: animations (``fig.frames``) and keeping a learner's zoom across
runs (``layout.uirevision``): a new run usually has another time range.
References: plotly "FigureWidget" and ``batch_update`` docs; ipywidgets
"Widget Events"; anywidget (the ESM module behind ``FitWidth``).
"""
from __future__ import annotations

import anywidget
import plotly.graph_objects as go
import traitlets


def refresh(target: go.FigureWidget, source: go.Figure) -> None:
    """Make ``target`` show ``source``, in place, in one batched update."""
    with target.batch_update():
        if [t.type for t in target.data] == [t.type for t in source.data]:
            for old, new in zip(target.data, source.data):
                props = new.to_plotly_json()
                props.pop("uid", None)
                for stale in set(old.to_plotly_json()) - set(props) - {"uid", "type"}:
                    old[stale] = None
                old.update(props, overwrite=True)
        else:  # the set of traces changed (other strategies, other ranks)
            target.data = ()
            target.add_traces(list(source.data))
        layout = source.layout.to_plotly_json()
        for stale in set(target.layout.to_plotly_json()) - set(layout):
            target.layout[stale] = None
        target.layout.update(layout, overwrite=True)


class FitWidth(anywidget.AnyWidget):
    """Makes the panel's figures as wide as their cell.

    A FigureWidget is first drawn before it is attached to the page, so plotly
    falls back to 700 px (too wide on a laptop, narrow on a big screen). With
    plotly's ``responsive`` config a figure refits on a window resize event;
    this invisible widget sends one when it is shown and after every run.
    """
    _esm = """
    function render({ model, el }) {
      const fit = () => [100, 600, 1500].forEach(
          ms => setTimeout(() => window.dispatchEvent(new Event('resize')), ms));
      fit();
      model.on('change:runs', fit);
    }
    export default { render };
    """
    runs = traitlets.Int(0).tag(sync=True)


def live_figure(fig: go.Figure, css_class: str) -> go.FigureWidget:
    widget = go.FigureWidget(fig)
    widget._config = {"responsive": True, "displaylogo": False}  # plotly.js config; no public setter
    widget.add_class(css_class)
    return widget


def placeholder(text: str, height=300) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=text, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       font=dict(size=15, color="#666"))
    fig.update_layout(template="plotly_white", height=height, xaxis_visible=False,
                      yaxis_visible=False)
    return fig
