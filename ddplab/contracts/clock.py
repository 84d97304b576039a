"""The one clock every stamp in ddplab uses.

Teaches: stamps from the training loop, the communication choke point, the
simulated link and the recorder are only comparable if they come from the
same clock. ``now()`` is ``time.perf_counter``: seconds, monotonic, shared by
processes on one host (CLOCK_MONOTONIC on Linux). It sits at the bottom of
the package so that every layer (netsim included) can read it without
importing anything above itself. Aligning clocks ACROSS ranks is
``ddplab.timeline.clock.estimate_offsets``.

Leaves out: GPU time (CUDA events; ddplab.timeline.cuda_events).
"""
from __future__ import annotations

import time


def now() -> float:
    """Seconds on this rank's monotonic clock."""
    return time.perf_counter()
