"""Chrome-trace JSON (opens in Perfetto and chrome://tracing) from timelines.

Teaches: the trace is the timeline, drawn by a tool built for it. One process
per rank (per strategy when several are exported together), two tracks each:
"compute" (forward, backward, wait, step) and "communication" (one slice per
bucket all-reduce, from launch or known start to completion); a recorded
fully_shard run adds one track per collective (all-gathers, reduce-scatters),
each slice named by its op and FSDP unit. Bucket index,
bytes, parameter names and each stamp's source sit in the slice's args, so
clicking a slice answers "what was in this bucket?".

Leaves out: flow arrows between ranks, counters. Reference: the Trace Event
Format (JSON object form with ``traceEvents``; "X" complete events, "M"
metadata events; times in microseconds).
"""
from __future__ import annotations

import json

from ddplab.timeline.records import Timeline

# A recorded fully_shard run (ddplab.measure.recording_fsdp): its all-gathers and reduce-scatters
# overlap in backward, so each op gets a track of its own
OP_TRACKS = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 3}


def to_chrome_trace(timelines, origin: float | None = None) -> dict:
    """Trace events for one timeline or a list of them (each strategy its own processes)."""
    if isinstance(timelines, Timeline):
        timelines = [timelines]
    if origin is None:
        starts = [it.start for tl in timelines for it in tl.iterations if it.start is not None]
        origin = min(starts) if starts else 0.0
    us = (lambda t: round((t - origin) * 1e6, 3))
    events = []
    for k, tl in enumerate(timelines):
        label = tl.strategy + (" (simulated link)" if tl.meta.get("simulated_link") else "")
        for rank in sorted({it.rank for it in tl.iterations} | {b.rank for b in tl.buckets}):
            pid = k * 1000 + rank
            events += [
                {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"{label} rank {rank}"}},
                {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}},
                {"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "compute"}},
            ]
            # a recorded fully_shard run's collectives are on their ops' tracks: no empty row
            if tl.strategy != "fully_shard" or any(len(b.params) != 3 or b.params[0] not in OP_TRACKS
                                                   for b in tl.buckets if b.rank == rank):
                events.append({"ph": "M", "pid": pid, "tid": 1, "name": "thread_name",
                               "args": {"name": "communication"}})
            if tl.strategy == "fully_shard":
                events += [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": op}}
                           for op, tid in OP_TRACKS.items()]
        for it in tl.iterations:
            pid = k * 1000 + it.rank
            for phase, (a, b) in sorted(it.phases.items(), key=lambda kv: kv[1][0]):
                if a is None or b is None:
                    continue
                events.append({"ph": "X", "pid": pid, "tid": 0, "name": phase, "ts": us(a),
                               "dur": max(0.0, us(b) - us(a)), "cat": "compute",
                               "args": {"iteration": it.iteration, "flags": sorted(it.flags),
                                        "source": it.sources.get(phase, "cpu")}})
        for b in tl.buckets:
            span = b.comm_interval()
            if span is None:
                continue
            pid = k * 1000 + b.rank
            # a recorded fully_shard run: (op, phase, unit), each op on a track of its own
            op = b.params[0] if tl.strategy == "fully_shard" and len(b.params) == 3 else None
            tid, name = (OP_TRACKS[op], f"{op} {b.params[2]}") if op in OP_TRACKS else (1, f"bucket {b.index}")
            events.append({"ph": "X", "pid": pid, "tid": tid, "name": name,
                           "ts": us(span[0]), "dur": max(0.0, us(span[1]) - us(span[0])),
                           "cat": "communication",
                           "args": {"iteration": b.iteration, "bucket": b.index, "bytes": b.nbytes,
                                    "bytes_on_the_wire": b.sent_bytes(),
                                    "params": list(b.params), "simulated": b.simulated,
                                    "sources": dict(b.sources)}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "ddplab", "strategies": [tl.strategy for tl in timelines]}}


def write_chrome_trace(path, timelines) -> str:
    with open(path, "w") as f:
        json.dump(to_chrome_trace(timelines), f)
    return str(path)
