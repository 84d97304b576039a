"""The what-if of memory against measurement at 1, 3 and 4 ranks (slow: three clusters;
make check's test-unit-more). Same tolerance rule as tests/measure/test_fits.py."""
from __future__ import annotations

import pytest
from test_fits import check_against

from ddplab.measure.fits import ROWS
from ddplab.measure.memory import measure

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test


def test_prediction_within_ten_percent_at_one_three_and_four_ranks():
    ratios = check_against(measure(rows=ROWS, world_sizes=(1, 3, 4)))
    peaks = [r[4] for r in ratios if r[3] == "peak"]
    print(f"peak predicted / measured: {min(peaks):.3f}-{max(peaks):.3f}")
