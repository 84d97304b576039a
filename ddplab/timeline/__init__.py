"""Timelines: per-rank, per-bucket records, clock alignment, metrics, Chrome-trace export."""
from ddplab.timeline.metrics import add_saved_ms, iteration_metrics, scaling_efficiency, summarize
from ddplab.timeline.records import BucketRecord, GradRecord, IterationRecord, Timeline
from ddplab.timeline.trace import to_chrome_trace, write_chrome_trace

__all__ = ["BucketRecord", "GradRecord", "IterationRecord", "Timeline", "summarize", "iteration_metrics",
           "add_saved_ms", "scaling_efficiency", "to_chrome_trace", "write_chrome_trace"]
