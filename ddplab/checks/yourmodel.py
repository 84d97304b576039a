"""Grader for lab 10: which buckets are exposed, and for how long.

``check_exposed(cluster, fn, recorded=None)`` calls ``fn(buckets, backward_end)`` in the
kernel. ``buckets`` is one rank's buckets of one iteration, a list of dicts with
``index``, ``comm_start`` and ``comm_end`` (seconds on the rank's clock, bucket 0 first);
``backward_end`` is when that rank's backward computed its last gradient. The answer is a
pair ``(exposed_s, exposed)``: the communication the step still waits for once backward's
compute is over, ``max(0, latest comm_end - backward_end)``, and the indices of the
buckets whose all-reduce ends after ``backward_end``, in index order.

That is what ddplab's metrics call exposed communication (``ddplab.timeline.metrics``):
the wait DDP's ``finalize_backward`` makes at the end of backward. Time spent by a bucket's
all-reduce while backward is still computing is hidden; only what sticks out at the end
costs the step. Buckets are cases built so that each classic slip gives another answer,
then every iteration of a run recorded on live ranks (the grader records a short one on the
learner's cluster, or takes ``recorded``), against ddplab's own metrics.

Leaves out: GPU streams (on a GPU, the comparison must be between times on the GPU's own
clock; ddplab's recorder labels its host stamps as such).
References: ddplab/timeline/metrics.py (iteration_metrics); torch's reducer.cpp
(finalize_backward waits for every bucket's work).
"""
from __future__ import annotations

import math
import traceback

from ddplab.checks import graders
from ddplab.checks.mistakes import EXPLAIN, NOT_IMPLEMENTED, RAISED, CheckFailed

SUMMED = "communication times summed"
SUMMED_EXPOSED = "the exposed buckets' whole all-reduces summed"
LAST_BY_INDEX = "the highest-indexed bucket taken as the last to finish"
NEGATIVE = "a negative exposed time when everything is hidden"
BY_START = "a bucket counted as exposed only when it starts after backward"
UNITS = "milliseconds where seconds were asked"
AT_THE_END = "a bucket ending exactly as backward ends counted as exposed"
NOT_A_PAIR = "not a pair (exposed seconds, list of bucket indices)"
WRONG = "differs from ddplab's exposed communication"

EXPLAIN.update({
    SUMMED: "all-reduces that run while backward still computes are hidden: only the part after "
            "backward_end costs the step.",
    SUMMED_EXPOSED: "an exposed bucket may have started long before backward ended, and buckets "
                    "queue one after another: the step waits from backward_end to the LATEST "
                    "comm_end, once.",
    LAST_BY_INDEX: "buckets finish in the order their all-reduces end, which need not be index "
                   "order (a rank may launch late, gloo has two threads): take the latest comm_end.",
    NEGATIVE: "when every all-reduce ends before backward does, nothing is exposed: 0, not a "
              "negative time (clamp with max(0, ...)).",
    BY_START: "a bucket whose all-reduce started during backward but ends after it is exposed "
              "too: compare comm_end with backward_end.",
    UNITS: "the stamps are in seconds, and so is the answer.",
    AT_THE_END: "a bucket whose all-reduce ends exactly when backward ends makes the step wait "
                "for nothing: exposed means comm_end > backward_end.",
    NOT_A_PAIR: "return (exposed_s, [indices]), e.g. (0.004, [2, 3]).",
    WRONG: "compare with the rule in the lab's exercise, one bucket at a time.",
})
graders.TITLES.setdefault("exposed", "exposed communication vs ddplab's metrics")

# (comm intervals per bucket index, backward_end), each built so the slips above differ.
CASES = [
    ([(0.010, 0.020), (0.018, 0.034), (0.030, 0.050)], 0.040),  # two hidden/straddling, one after
    ([(0.010, 0.015), (0.016, 0.022)], 0.030),  # all hidden: 0 and []
    ([(0.010, 0.060), (0.020, 0.045)], 0.040),  # bucket 0 finishes last (gloo's second thread)
    ([(0.005, 0.012), (0.013, 0.040), (0.041, 0.044)], 0.040),  # ends exactly at backward_end
    ([(0.030, 0.032), (0.041, 0.043)], 0.031),  # one straddles, one after
]


def reference(buckets, backward_end):
    """The answer: (max(0, latest end - backward_end), indices ending after backward_end)."""
    ends = [b["comm_end"] for b in buckets]
    exposed = max(0.0, max(ends, default=backward_end) - backward_end)
    return exposed, sorted(b["index"] for b in buckets if b["comm_end"] > backward_end)


def as_buckets(intervals):
    return [{"index": i, "comm_start": s, "comm_end": e} for i, (s, e) in enumerate(intervals)]


def slips(buckets, backward_end) -> dict:
    """What each slip answers, to name a wrong answer."""
    ends = {b["index"]: b["comm_end"] for b in buckets}
    ref_s, ref_i = reference(buckets, backward_end)
    last = buckets[-1]["comm_end"] if buckets else backward_end
    return {
        SUMMED: (sum(b["comm_end"] - b["comm_start"] for b in buckets), ref_i),
        SUMMED_EXPOSED: (sum(b["comm_end"] - b["comm_start"] for b in buckets
                             if b["comm_end"] > backward_end), ref_i),
        LAST_BY_INDEX: (max(0.0, last - backward_end), ref_i),
        NEGATIVE: (max(ends.values(), default=backward_end) - backward_end, ref_i),
        BY_START: (ref_s, sorted(b["index"] for b in buckets if b["comm_start"] > backward_end)),
        UNITS: (ref_s * 1e3, ref_i),
        AT_THE_END: (ref_s, sorted(b["index"] for b in buckets if b["comm_end"] >= backward_end)),
    }


def _call(fn, buckets, backward_end, where):
    try:
        got = fn([dict(b) for b in buckets], backward_end)
    except NotImplementedError:
        raise CheckFailed(NOT_IMPLEMENTED, f"{getattr(fn, '__name__', 'your function')} "
                                           "raised NotImplementedError") from None
    except Exception as err:  # a learner's bug is a verdict, not a grader crash
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        raise CheckFailed(RAISED, f"{where}: {last}") from None
    try:
        seconds, indices = got
        return float(seconds), sorted(int(i) for i in indices)
    except (TypeError, ValueError):
        raise CheckFailed(NOT_A_PAIR, f"{where}: got {got!r}") from None


def _same(a, b) -> bool:
    return math.isclose(a[0], b[0], rel_tol=1e-6, abs_tol=1e-9) and a[1] == b[1]


def _judge(fn, buckets, backward_end, where) -> None:
    got = _call(fn, buckets, backward_end, where)
    want = reference(buckets, backward_end)
    if _same(got, want):
        return
    named = next((m for m, ans in slips(buckets, backward_end).items()
                  if _same(got, ans) and not _same(ans, want)), WRONG)
    raise CheckFailed(named, f"{where}: backward_end={backward_end:.6f}, buckets "
                             f"{[(b['index'], round(b['comm_start'], 6), round(b['comm_end'], 6)) for b in buckets]}"
                             f"; your answer {got[0]:.6f} s, {got[1]}; expected {want[0]:.6f} s, {want[1]}")


def recorded_cases(timeline) -> list:
    """(buckets, backward_end, where) for every rank and iteration of a recorded run that has
    a backward and measured communication."""
    out = []
    for it in timeline.iterations:
        back = it.span("backward")
        buckets = [b for b in timeline.buckets_of(it.rank, it.iteration) if b.comm_interval()]
        if back is None or not buckets or "no_sync" in it.flags:
            continue
        out.append(([{"index": b.index, "comm_start": b.comm_interval()[0], "comm_end": b.comm_end}
                     for b in buckets], back[1], f"rank {it.rank}, iteration {it.iteration}"))
    return out


def check_exposed(cluster, fn, recorded=None) -> dict:
    """Grade ``fn`` on the built cases, then on every iteration of ``recorded`` (a Timeline),
    by default a short run the grader records on ``cluster``'s ranks (an MLP, 0.25 MiB buckets)."""
    for k, (intervals, backward_end) in enumerate(CASES):
        _judge(fn, as_buckets(intervals), backward_end, f"case {k}")
    if recorded is None and cluster is not None:
        from ddplab.lessons.yourmodel import record_on_rank
        from ddplab.timeline.records import Timeline

        recorded = Timeline.from_dict(cluster.run(record_on_rank, "mlp", None, None, 0.25, 6)[0])
    n = 0
    if recorded is not None:
        from ddplab.timeline.metrics import iteration_metrics

        for buckets, backward_end, where in recorded_cases(recorded):
            rank, iteration = (int(x) for x in where.replace("rank ", "").split(", iteration "))
            # the reference above is ddplab's metric, on the same stamps
            assert math.isclose(reference(buckets, backward_end)[0],
                                iteration_metrics(recorded, rank, iteration)["exposed_comm_s"],
                                abs_tol=1e-12)
            _judge(fn, buckets, backward_end, where)
            n += 1
    print(f"passed: {len(CASES)} built cases and {n} recorded iterations, each slip named")
    return {"cases": len(CASES), "recorded": n}
