"""Pictures and widgets: plotly figures and ipywidgets panels that READ timelines.

- ``timeline_figure(tl)``: one strategy's Gantt chart (rank x {compute, comm}).
- ``compare_figures(timelines, metrics)``: every strategy on one time scale,
  and a metrics bar chart.
- ``sweep_figure(...)``: step time and exposed communication vs bucket_cap_mb.
- ``scaling_figure(...)``: strong and weak scaling efficiency vs world size.
- ``ControlPanel(runner=...)``: knobs, a Run button, figures updated in place.
- ``to_html`` / ``write_html`` / ``compare_report``: the same figures as
  standalone pages.
- ``demo``: invented timelines of the right shape, for pictures without ranks.

Nothing here trains or imports torch.distributed; torch code never imports
this package.
"""
from ddplab.widgets.compare import compare_figures, compare_timelines_figure, metrics_figure
from ddplab.widgets.gantt import bucket_color, timeline_figure
from ddplab.widgets.html import compare_page, compare_report, to_html, write_html
from ddplab.widgets.live import refresh
from ddplab.widgets.panel import ControlPanel
from ddplab.widgets.scaling import efficiency, scaling_figure
from ddplab.widgets.sweep import sweep_figure

__all__ = ["timeline_figure", "bucket_color", "compare_figures", "compare_timelines_figure",
           "metrics_figure", "sweep_figure", "scaling_figure", "efficiency",
           "ControlPanel", "refresh", "to_html", "write_html", "compare_report", "compare_page"]
