"""The what-if of memory against measurement at 1, 2, 3 and 4 ranks (slow: a 4-rank cluster,
sizes 1 and 3 on groups of its first ranks, beside the shared 2-rank one; make check's
test-unit-more). Same tolerance rule as
tests/measure/test_fits.py; and the curve of memory per rank against N that lab 12 draws
(ddplab.measure.memory_vs_ranks) goes through every point measured."""
from __future__ import annotations

import pytest
import torch
from test_fits import check_against

from ddplab.measure import memory_vs_ranks
from ddplab.measure.fits import ROWS, predict_bytes, predict_memory
from ddplab.measure.memory import default_model, measure, measure_on

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test
EXAMPLE = torch.randn(16, 256)


def test_prediction_within_ten_percent_at_one_to_four_ranks_and_the_curve_goes_through_them(cluster2):
    rows = memory_vs_ranks.ROWS  # ddp, zero1, zero2, fsdp
    measured = measure(rows=rows, world_sizes=(1, 3, 4)) + measure_on(cluster2, rows)
    ratios = check_against([m for m in measured if m["row"] in ROWS])
    peaks = [r[4] for r in ratios if r[3] == "peak"]
    print(f"peak predicted / measured: {min(peaks):.3f}-{max(peaks):.3f}")
    for m in measured:  # zero2: held and sent exactly; its peak is held to 10 % at 2 ranks only
        if m["row"] == "zero2":  # (tests/sync/test_zero2.py); at 1 rank it read 0.87
            pred = predict_memory(default_model(), m["world_size"], None, "zero2", rank=m["rank"])
            assert pred == {f: m[f] for f in ("params", "grads", "optimizer_state")}
            assert predict_bytes(default_model(), m["world_size"], "zero2") == m["sent_by_op"]
            print(f"zero2 at {m['world_size']}: peak predicted / measured "
                  f"{predict_memory(default_model(), m['world_size'], EXAMPLE, 'zero2')['peak'] / m['peak']:.3f}")
    curve = memory_vs_ranks.default_curve(world_sizes=range(1, 5))
    points = memory_vs_ranks.largest_held(measured)
    assert len(points) == 4 * 4
    for (row, n), held in points.items():
        assert curve["predicted"][row][n - 1] == held, (row, n)  # held: sizes only, exact
    # the steps are measured too: ZeRO-1's largest rank holds about as much at 3 ranks as at 2
    assert abs(points["zero1", 3] / points["zero1", 2] - 1) < 0.002
    assert abs(points["fsdp", 4] * 4 / points["ddp", 1] - 1) < 1e-4  # no padding at 4: 1/N
