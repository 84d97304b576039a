"""Numbers from a timeline: step time, exposed communication, overlap, bandwidth, waiting.

Teaches the definitions, because the words are used loosely elsewhere:
- exposed communication = last all-reduce end minus backward end (never below
  zero): the part of communication the step really pays for. The headline.
- overlap % = time communication was in flight WHILE backward ran, divided by
  the time communication was in flight (both as unions of intervals, so two
  buckets in flight at once are not counted twice). torch DDP's own
  ``avg_backward_compute_comm_overlap_time`` is a window (first launch to
  backward end), not this intersection. On 2 CPU cores gloo's threads share
  the cores with backward: in flight is not the same as free.
- algbw = payload bytes / communication time; busbw = algbw * 2(p-1)/p, the
  ring all-reduce's per-link traffic (the convention nccl-tests uses), GB/s.
- a rank's wait = its own exposed communication: after its backward ended it
  waits for the slowest rank's gradients. A straggler's cost shows up here on
  the OTHER ranks.
- ``saved_ms`` = manual's step time minus this strategy's.
- ``comm_bytes_per_step`` = gradient payload bytes handed to all-reduces in
  one step, as counted where they were seen (``meta["comm_bytes_per_step"]``,
  written by the run): at ``ddplab.sync.comm``, by kind, for ddplab's own
  strategies; at the observing process group, every all-reduce, for rows
  drawn from it. From the bucket records when a timeline lacks it.

Flagged iterations (warm-up, torch DDP's one-bucket first iteration and
rebuild) are excluded from every average. Medians, not means: a laptop's
background noise makes means lie.
"""
from __future__ import annotations

import statistics

from ddplab.timeline.records import Timeline


def union(intervals):
    """Merge overlapping (start, end) intervals."""
    merged = []
    for a, b in sorted(i for i in intervals if i is not None and i[1] >= i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def length(intervals) -> float:
    return sum(b - a for a, b in union(intervals))


def intersection_length(xs, ys) -> float:
    total = 0.0
    for a, b in union(xs):
        for c, d in union(ys):
            total += max(0.0, min(b, d) - max(a, c))
    return total


def iteration_metrics(tl: Timeline, rank: int, iteration: int) -> dict:
    it = tl.iteration(rank, iteration)
    buckets = tl.buckets_of(rank, iteration)
    comm = [b.comm_interval() for b in buckets]
    comm = [c for c in comm if c is not None]
    backward = it.span("backward") if it else None
    comm_s = length(comm)
    exposed = 0.0
    overlap = 0.0
    if comm and backward:
        exposed = max(0.0, max(e for _, e in comm) - backward[1])
        overlap = intersection_length(comm, [backward])
    step = (it.end - it.start) if it and it.start is not None and it.end is not None else None
    return {
        "step_s": step,
        "comm_s": comm_s,
        "exposed_comm_s": exposed,
        "overlap_s": overlap,
        "bytes": sum(b.sent_bytes() for b in buckets),  # on the wire (a compressing hook: less)
        "n_buckets": len(buckets),
    }


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


GATHER_OR_SCATTER = ("all_gather_into_tensor", "reduce_scatter_tensor")


def ring_bytes(tl: Timeline, buckets) -> float:
    """What one rank sends on a ring for ``buckets``: (p-1)/p of the full buffer N for an
    all-gather or a reduce-scatter (N: the gathered output, the scattered input), 2(p-1)/p of
    N for an all-reduce (a reduce-scatter, then an all-gather). N is what went on the wire
    (``wire_nbytes``, a compressing comm hook's size) where a recording counted it, else the
    bucket's size. This is the figure to set a DDP run beside a fully_shard one: their buffer
    sizes count an all-reduce's N once and FSDP's N twice per unit (gather and scatter)."""
    p = tl.world_size
    total = 0.0
    for b in buckets:
        wire = getattr(b, "wire_nbytes", None)
        n = b.nbytes if wire is None else wire
        total += n * (p - 1) / p * (1 if b.params[:1] and b.params[0] in GATHER_OR_SCATTER else 2)
    return total


def summarize(tl: Timeline) -> dict:
    """Per-strategy metrics over the counted (unflagged) iterations."""
    p = tl.world_size
    ranks = sorted({it.rank for it in tl.iterations})
    counted = tl.iteration_numbers()
    steps, exposed, overlap_pct, comm_s, nbytes, nbuckets = [], [], [], [], [], []
    wait = {r: [] for r in ranks}
    for i in counted:
        per_rank = {r: iteration_metrics(tl, r, i) for r in ranks}
        steps.append(max((m["step_s"] or 0.0) for m in per_rank.values()))
        exposed.append(max(m["exposed_comm_s"] for m in per_rank.values()))
        c = statistics.median(m["comm_s"] for m in per_rank.values())
        comm_s.append(c)
        o = statistics.median(m["overlap_s"] for m in per_rank.values())
        overlap_pct.append(100.0 * o / c if c > 0 else 0.0)
        nbytes.append(per_rank[ranks[0]]["bytes"])
        nbuckets.append(per_rank[ranks[0]]["n_buckets"])
        for r, m in per_rank.items():
            wait[r].append(m["exposed_comm_s"])
    med_comm = _median(comm_s)
    payload = _median(nbytes) or 0
    algbw = payload / med_comm / 1e9 if med_comm else None
    ms = (lambda x: None if x is None else 1000.0 * x)
    # Sharded strategies (FSDP) also gather weights in the forward, and wait for every
    # collective where it is made: exposed-after-backward and overlap would mislead there.
    sharded = any(b.params[:1] in (("all_gather_into_tensor",), ("reduce_scatter_tensor",))
                  for b in tl.buckets)
    return {
        "step_ms": ms(_median(steps)),
        "exposed_comm_ms": None if sharded else ms(_median(exposed)),
        "comm_ms": ms(med_comm),
        "overlap_pct": None if sharded else _median(overlap_pct),
        "comm_bytes_per_step": int(tl.meta.get("comm_bytes_per_step", payload)),
        "n_buckets": int(_median(nbuckets) or 0),
        "algbw_GBps": algbw,
        "busbw_GBps": None if algbw is None else algbw * 2 * (p - 1) / p,
        "wait_ms_by_rank": {r: ms(_median(w)) for r, w in wait.items()},
        "iterations_counted": len(counted),
        "iterations_excluded": sorted(set(tl.iteration_numbers(include_flagged=True)) - set(counted)),
    }


def summarize_run(tl: Timeline) -> dict:
    """``summarize`` plus ``ring_bytes_per_step`` (median over counted steps of rank 0's
    ``ring_bytes``): what a saved run's page and ``ddplab.view`` draw."""
    ranks = sorted({it.rank for it in tl.iterations})
    ring = [ring_bytes(tl, tl.buckets_of(ranks[0], i)) for i in tl.iteration_numbers()] if ranks else []
    return dict(summarize(tl), ring_bytes_per_step=_median(ring))


def add_saved_ms(summaries: dict, reference: str = "manual") -> dict:
    """``saved_ms`` for every strategy: the reference's step time minus its own."""
    ref = summaries.get(reference, {}).get("step_ms")
    for s in summaries.values():
        s["saved_ms"] = None if ref is None or s.get("step_ms") is None else ref - s["step_ms"]
    return summaries


def world_size_pairs(points) -> list:
    """{world_size: value} or (world_size, value) pairs -> sorted pairs, None values dropped."""
    items = points.items() if isinstance(points, dict) else points
    return sorted((int(p), float(t)) for p, t in items if t is not None)


def scaling_efficiency(points, mode: str) -> dict:
    """Scaling efficiency (a fraction, 1.0 = ideal) per world size, against the smallest given.

    ``points``: {world_size: step time} (or pairs). strong (fixed global
    batch): T(p0) * p0 / (T(p) * p); weak (fixed batch per rank): T(p0) / T(p).
    """
    if mode not in ("strong", "weak"):
        raise ValueError(f"mode must be 'strong' or 'weak', got {mode!r}")
    pairs = world_size_pairs(points)
    if not pairs:
        return {}
    p0, t0 = pairs[0]
    if mode == "strong":
        return {p: t0 * p0 / (t * p) for p, t in pairs}
    return {p: t0 / t for p, t in pairs}
