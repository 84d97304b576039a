"""Lab 12's one time axis (ddplab.widgets.compare.one_axis_figure): DDP, ZeRO-1 (ddplab's and
torch's), FSDP and fully_shard in one figure, every collective drawn from the observing group,
the optimizer's step included."""
from __future__ import annotations

import re

import pytest

from ddplab.lessons import sharding
from ddplab.widgets.compare import one_axis_figure

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

NAMES = ("ddp", "zero1", "torch_zero", "fsdp", "torch_fsdp2")
N_PARAMS = 6  # sharding.stack(): three Linear layers, a weight and a bias each


def _bars(fig, panel):
    """(rank, op, phase, start, end) of the collective bars of one panel (1-based)."""
    axis = "y" if panel == 1 else f"y{panel}"
    out = []
    for t in fig.data:
        if not t.legendgroup.startswith("comm") or t.yaxis != axis:
            continue
        for y, base, width, hover in zip(t.y, t.base, t.x, t.hovertext):
            op, phase = re.search(r"params: (\w+), ([\w ]+)<br>", hover).groups()
            out.append((int(y.split()[1]), op, phase, base, base + width))
    return out


def test_one_figure_one_time_axis_every_layers_collectives_on_every_rank(cluster2):
    runs = {name: cluster2.run(sharding.traffic_on_rank, name) for name in NAMES}
    fig = one_axis_figure(runs)
    # one x axis: the upper panels' follow the last one's (plotly's shared_xaxes)
    last = f"x{len(NAMES)}"
    assert [fig.layout[f"xaxis{k}"].matches for k in ("", *range(2, len(NAMES) + 1))] \
        == [last] * (len(NAMES) - 1) + [None]
    ends = []
    for panel, name in enumerate(NAMES, start=1):
        bars = _bars(fig, panel)
        ends += [e for *_, e in bars]
        assert all(0 <= a <= e for *_, a, e in bars)
        for rank in (0, 1):
            mine = [(op, phase) for r, op, phase, _, _ in bars if r == rank]
            # every call the rank made is drawn, its end stamped before the recording ended
            assert len(mine) == len(runs[name][rank]["calls"]), (name, rank, mine)
            if name in ("ddp", "zero1", "torch_zero"):
                # torch DDP's one bucket (the model is small), all-reduced in the backward;
                # ZeRO-1 then broadcasts every parameter from its owner in the step
                broadcasts = 0 if name == "ddp" else N_PARAMS
                assert sorted(mine) == [("all_reduce", "backward")] + [("broadcast", "step")] * broadcasts
                continue
            # three layers: an all-gather each in the forward; in the backward an all-gather
            # and a reduce-scatter each (fully_shard reduces its first layer after backward)
            assert mine.count(("all_gather_into_tensor", "forward")) == 3, (name, mine)
            assert mine.count(("all_gather_into_tensor", "backward")) == 3, (name, mine)
            assert sum(op == "reduce_scatter_tensor" for op, _ in mine) == 3, (name, mine)
            assert not any(phase == "step" for _, phase in mine)  # SGD on the shards: no traffic
    assert max(ends) > 0
    # coloured by operation, each named in the legend with a hover line that says what it does
    comm = {t.name: t for t in fig.data if t.legendgroup.startswith("comm")}
    assert {"all-reduce", "all-gather", "reduce-scatter", "broadcast"} <= set(comm)
    assert len({comm[n].marker.color for n in ("all-reduce", "all-gather", "reduce-scatter",
                                               "broadcast")}) == 4
    assert all("piece r only" in h for h in comm["reduce-scatter"].hovertext)
    assert all("every rank's piece" in h for h in comm["all-gather"].hovertext)
    # counted at the group: ZeRO-1 (all-reduce, then broadcast) and FSDP (two all-gathers,
    # a reduce-scatter) each send 1.5x DDP's ring bytes
    ring = {name: runs[name][0]["ring_bytes"] for name in NAMES}
    for name in ("zero1", "torch_zero", "fsdp", "torch_fsdp2"):
        assert abs(ring[name] - 1.5 * ring["ddp"]) < 1e-6 * ring["ddp"], ring
