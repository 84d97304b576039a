"""Lab 12's one time axis (ddplab.widgets.compare.one_axis_figure): DDP, FSDP and fully_shard
in one figure, every collective drawn from the observing group."""
from __future__ import annotations

import re

from ddplab.lessons import sharding
from ddplab.widgets.compare import one_axis_figure

NAMES = ("ddp", "fsdp", "torch_fsdp2")


def _bars(fig, panel):
    """(rank, op, phase, start, end) of the collective bars of one panel (1-based)."""
    axis = "y" if panel == 1 else f"y{panel}"
    out = []
    for t in fig.data:
        if t.legendgroup != "comm" or t.yaxis != axis:
            continue
        for y, base, width, hover in zip(t.y, t.base, t.x, t.hovertext):
            op, phase = re.search(r"params: (\w+), ([\w ]+)<br>", hover).groups()
            out.append((int(y.split()[1]), op, phase, base, base + width))
    return out


def test_one_figure_one_time_axis_every_layers_collectives_on_every_rank(cluster2):
    runs = {name: cluster2.run(sharding.traffic_on_rank, name) for name in NAMES}
    fig = one_axis_figure(runs)
    # one x axis: the upper panels' follow the last one's (plotly's shared_xaxes)
    assert [fig.layout[f"xaxis{k}"].matches for k in ("", 2, 3)] == ["x3", "x3", None]
    ends = []
    for panel, name in enumerate(NAMES, start=1):
        bars = _bars(fig, panel)
        ends += [e for *_, e in bars]
        assert all(0 <= a <= e for *_, a, e in bars)
        for rank in (0, 1):
            mine = [(op, phase) for r, op, phase, _, _ in bars if r == rank]
            # DDP: its all-reduce. Its bar can be missing: traffic_on_rank may end the
            # recording before torch DDP's future callback stamps the end (not checked here)
            if name == "ddp":
                assert {op for op, _ in mine} <= {"all_reduce"}
                continue
            # three layers: an all-gather each in the forward; in the backward an all-gather
            # and a reduce-scatter each (fully_shard reduces its first layer after backward)
            assert mine.count(("all_gather_into_tensor", "forward")) == 3, (name, mine)
            assert mine.count(("all_gather_into_tensor", "backward")) == 3, (name, mine)
            assert sum(op == "reduce_scatter_tensor" for op, _ in mine) == 3, (name, mine)
    assert max(ends) > 0
