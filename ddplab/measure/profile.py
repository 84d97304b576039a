"""What a recorded run says about its compute: work per gradient, and how much communication slowed it.

Teaches: a recording mixes two things, the model's own compute and the
communication that ran beside it. To ask "what if" you need the first alone.
From each counted iteration of each rank this module reads

- ``pre_s``: step start to backward start (forward, zero_grad, the loss);
- for every gradient, the backward WORK done before it was ready;
- ``backward_work_s``: the whole of backward's work;
- ``post_s``: from the end of both backward and the last all-reduce to the
  step's end (the optimizer).

Work is wall time with contention taken out. The model: while an all-reduce is
in flight on a rank, that rank's compute runs ``1 + c`` times slower (on a
2-core machine gloo's threads take cores from backward; on GPUs NCCL's kernels
take SMs). ``c`` is measured by comparing backward with communication in flight
against backward without: a compute-only ``baseline`` timeline (compare()'s
``"none"``), or iterations of the recording itself whose backward had no
communication in flight (``no_sync`` steps, torch DDP's one-bucket first
step). With neither, or when no communication overlapped backward, ``c`` is 0
and ``contention_note`` says it was not measured.

Also read from the recording: whether a prediction from it can be held to 10 %
(``untrusted_reasons``; the rules are listed in ddplab.measure.whatif).

Leaves out, compared with a profiler: where inside backward the slowdown falls
(it is spread evenly over the in-flight time), skew between ranks' step starts,
and mixed dtypes (a recording's gradients are re-bucketed as one dtype).
References: torch/csrc/distributed/c10d/reducer.cpp (``mark_variable_ready``:
a bucket launches once its last gradient is ready); ddplab.timeline.records.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ddplab.timeline.metrics import intersection_length, union
from ddplab.timeline.records import Timeline


@dataclass
class RankProfile:
    rank: int
    pre_s: float
    backward_work_s: float
    post_s: float
    grad_work_s: dict  # param -> backward work done when its gradient was ready
    nbytes: dict  # param -> bytes


@dataclass
class Profile:
    world_size: int
    ranks: list  # RankProfile, by rank
    contention: float  # c: compute runs 1 + c times slower while communication is in flight
    contention_note: str
    comm_samples: list = field(default_factory=list)  # (nbytes, seconds on the link)
    from_buckets: bool = False  # no per-parameter times: each recorded bucket is one unit
    recorded_layout: list = field(default_factory=list)  # buckets as lists of units
    simulated_link: dict | None = None

    @property
    def ready_order(self) -> list:
        """Units in the order their gradients were ready on rank 0 (the order torch rebuilds in)."""
        first = self.ranks[0]
        return sorted(first.grad_work_s, key=lambda p: (first.grad_work_s[p], p))


def _in_flight(buckets) -> list:
    return union([b.comm_interval() for b in buckets])


def _units(tl: Timeline, rank: int, iteration: int, from_buckets: bool) -> list:
    """(unit, nbytes, ready) for one rank and iteration."""
    if from_buckets:
        return [(b.index, b.nbytes, b.grads_ready) for b in tl.buckets_of(rank, iteration)
                if b.grads_ready is not None]
    return [(g.param, g.nbytes, g.ready) for g in tl.grads
            if g.rank == rank and g.iteration == iteration]


def _samples(tl: Timeline, ranks, iterations, from_buckets):
    """Per (rank, iteration) with a backward: its stamps relative to backward start."""
    out = []
    for i in iterations:
        for r in ranks:
            it = tl.iteration(r, i)
            if it is None or "backward" not in it.phases or it.start is None or it.end is None:
                continue
            b0, b1 = it.phases["backward"]
            buckets = tl.buckets_of(r, i)
            flight = _in_flight(buckets)
            comm_end = max((e for _, e in flight), default=b1)
            out.append({"rank": r, "iteration": i, "b0": b0, "b1": b1, "flight": flight,
                        "pre": b0 - it.start, "post": it.end - max(b1, comm_end),
                        "overlap": intersection_length(flight, [(b0, b1)]),
                        "units": _units(tl, r, i, from_buckets), "buckets": buckets})
    return out


def measure_contention(samples, baseline_backward_s) -> tuple[float, str]:
    """c from backward with communication in flight against backward without (see module doc)."""
    busy = [s for s in samples if s["overlap"] > 0]
    if baseline_backward_s is None:
        return 0.0, ("contention not measured: no compute-only baseline and no iteration whose "
                     "backward ran without communication; predictions assume none")
    if not busy:
        return 0.0, "contention not measured: no communication overlapped backward in the recording"
    recorded = statistics.median(s["b1"] - s["b0"] for s in busy)
    overlap = statistics.median(s["overlap"] for s in busy)
    # backward work = recorded - overlap * c / (1 + c); the share lost is capped below 1
    share = min(0.95, max(0.0, (recorded - baseline_backward_s) / overlap))
    c = share / (1 - share)
    note = (f"contention measured: compute ran {1 + c:.2f}x slower while communication was in "
            f"flight (backward {1e3 * recorded:.2f} ms with {1e3 * overlap:.2f} ms of it "
            f"overlapped, {1e3 * baseline_backward_s:.2f} ms without)")
    if share == 0.95:
        note += ("; at the model's limit: backward was slower than the overlap can explain, "
                 "so something else (other load on the machine) slowed it too")
    return c, note


def _baseline_backward(baseline: Timeline | None, quiet_samples) -> float | None:
    if baseline is not None:
        spans = [it.phases["backward"] for it in baseline.iterations
                 if "backward" in it.phases and it.iteration in baseline.iteration_numbers()]
        return statistics.median(b - a for a, b in spans) if spans else None
    if quiet_samples:
        return statistics.median(s["b1"] - s["b0"] for s in quiet_samples)
    return None


def _work(t: float, b0: float, flight, c: float) -> float:
    """Backward work done by wall time ``t`` (in flight, work runs 1/(1+c) as fast)."""
    return (t - b0) - intersection_length(flight, [(b0, t)]) * c / (1 + c)


def _link_samples(samples) -> list:
    """(nbytes, time on the link): from the later of launch/start and the previous end."""
    out = []
    for s in samples:
        free = float("-inf")
        for b in s["buckets"]:
            iv = b.comm_interval()
            if iv is None:
                continue
            # queued behind the previous one: count from its end; gloo may also run two
            # all-reduces at once (finishing out of order): then count the whole interval
            start = max(iv[0], free) if free < iv[1] else iv[0]
            out.append((b.sent_bytes(), iv[1] - start))  # what went on the wire
            free = max(free, iv[1])
    return out


def _by_bytes(sample) -> list:
    """Buckets that name their parameters (not indices): the gradients in ready order, cut
    where the bytes add up to each bucket's size (a rebuilt layout is made in that order).
    [] when they do not add up, so the recorded layout is not replayed."""
    units = sorted(sample["units"], key=lambda u: (u[2], u[0]))
    layout, k = [], 0
    for b in sample["buckets"]:
        taken, total = [], 0
        while k < len(units) and total < b.nbytes:
            taken.append(units[k][0])
            total += units[k][1]
            k += 1
        if total != b.nbytes:
            return []
        layout.append(taken)
    return layout if k == len(units) else []


def read_profile(recording: Timeline, baseline: Timeline | None = None,
                 contention: float | None = None) -> Profile:
    """The compute profile of ``recording`` (see the module docstring).

    ``contention``: give c yourself instead of measuring it (0: take wall times as work).
    """
    if not recording.iterations:
        raise ValueError("the recording has no iterations: record at least one step")
    from_buckets = not recording.grads
    ranks = sorted({it.rank for it in recording.iterations})
    counted = recording.iteration_numbers()
    samples = _samples(recording, ranks, counted, from_buckets)
    quiet = [s for s in samples if not s["flight"]]  # no_sync steps: no communication at all
    busy = [s for s in samples if s["flight"] and s["units"]]
    if not busy:
        raise ValueError("the recording has no step with gradients and communication: record "
                         "steps that synchronize (not only no_sync ones), with bucket records")
    if contention is None:
        if baseline is None and not quiet:
            flagged = set(recording.iteration_numbers(include_flagged=True)) - set(counted)
            quiet = [s for s in _samples(recording, ranks, sorted(flagged), from_buckets)
                     if s["overlap"] == 0 and s["flight"]]  # e.g. torch DDP's one-bucket step
        c, note = measure_contention(busy, _baseline_backward(baseline, quiet))
    else:
        if contention < 0:
            raise ValueError(f"contention must be >= 0 (0 = none), got {contention!r}")
        c, note = float(contention), f"contention given: {1 + contention:.2f}x slower in flight"
    profiles = []
    for r in ranks:
        mine = [s for s in busy if s["rank"] == r]
        if not mine:
            continue
        works = {}
        for s in mine:
            for unit, _, ready in s["units"]:
                works.setdefault(unit, []).append(_work(ready, s["b0"], s["flight"], c))
        profiles.append(RankProfile(
            r, statistics.median(s["pre"] for s in mine),
            statistics.median(_work(s["b1"], s["b0"], s["flight"], c) for s in mine),
            statistics.median(s["post"] for s in mine),
            {u: statistics.median(w) for u, w in works.items()},
            {u: n for s in mine for u, n, _ in s["units"]}))
    first = busy[0]
    if from_buckets:
        layout = [[b.index] for b in first["buckets"]]
    else:
        layout = [list(b.params) for b in first["buckets"]]
        if not all(isinstance(p, int) for ps in layout for p in ps) or not all(layout):
            layout = _by_bytes(first)
    return Profile(recording.world_size, profiles, c, note, _link_samples(busy), from_buckets,
                   layout, recording.meta.get("simulated_link"))


TARGET = 0.10  # the error a trusted prediction is held to (docs/benchmarks.md checks it)
# Other work may take up to half a core from the ranks before a recording counts as loaded:
# the load average also counts gloo's threads and short jobs (a quiet 2-core machine with
# 2 ranks read 1.4-2.2 here)
SLACK_CORES = 0.5


def untrusted_reasons(recording: Timeline, prof: Profile) -> list:
    """Why a prediction from ``recording`` cannot be held to ``TARGET`` (module docstring)."""
    from ddplab.timeline.metrics import iteration_metrics

    why = []
    ranks = sorted({it.rank for it in recording.iterations})
    steps = sorted(max(iteration_metrics(recording, r, i)["step_s"] or 0.0 for r in ranks)
                   for i in recording.iteration_numbers())
    if len(steps) >= 4:
        q = statistics.quantiles(steps, n=4)
        spread = (q[2] - q[0]) / statistics.median(steps)
        if spread > TARGET:
            why.append(f"the recording's own steps varied by {100 * spread:.0f} % (interquartile "
                       f"range over the median), more than the {100 * TARGET:.0f} % a prediction "
                       "is held to")
    if "at the model's limit" in prof.contention_note:
        why.append("backward ran slower than the communication in flight can explain (other "
                   "load on the machine), so its compute time is not the model's")
    machine = recording.meta.get("machine") or {}
    load, cores, mine = machine.get("load_1m"), machine.get("cores"), machine.get("local_ranks")
    if None not in (load, cores, mine):
        free = cores - max(0.0, load - mine)
        if free < mine - SLACK_CORES:
            why.append(f"recorded on a loaded machine: load average {load:.1f} on {cores} cores "
                       f"with {mine} ranks of yours, about {max(free, 0):.1f} cores free for "
                       f"{mine} ranks (compute waited for cores, by an amount that changes "
                       "from run to run)")
    return why
