"""Mutation catalogue, lab 10's exercise: which buckets are exposed, and for how long.

Correct solutions written three ways, and wrong ones: each classic slip the grader names, plus
answers in the wrong shape. The grader (ddplab/checks/yourmodel.py) runs in the kernel on built
cases; the lab adds its own recording.
"""
from ddplab.checks import yourmodel as Y


# -- correct -------------------------------------------------------------------------------
def exposed_ok_max(buckets, backward_end):
    latest = max((b["comm_end"] for b in buckets), default=backward_end)
    return max(0.0, latest - backward_end), sorted(b["index"] for b in buckets
                                                   if b["comm_end"] > backward_end)


def exposed_ok_loop(buckets, backward_end):
    wait, late = 0.0, []
    for b in sorted(buckets, key=lambda b: b["index"]):
        if b["comm_end"] > backward_end:
            late.append(b["index"])
            wait = max(wait, b["comm_end"] - backward_end)
    return wait, late


def exposed_ok_tuple_of_numpy(buckets, backward_end):
    import numpy as np

    ends = np.array([b["comm_end"] for b in buckets])
    idx = np.array([b["index"] for b in buckets])
    after = ends > backward_end
    return float(np.clip(ends.max() - backward_end, 0, None)), idx[after].tolist()


# -- wrong ---------------------------------------------------------------------------------
def exposed_summed(buckets, backward_end):
    total = sum(b["comm_end"] - b["comm_start"] for b in buckets)
    return total, sorted(b["index"] for b in buckets if b["comm_end"] > backward_end)


def exposed_summed_exposed_only(buckets, backward_end):
    late = [b for b in buckets if b["comm_end"] > backward_end]
    return sum(b["comm_end"] - b["comm_start"] for b in late), sorted(b["index"] for b in late)


def exposed_last_by_index(buckets, backward_end):
    last = max(buckets, key=lambda b: b["index"])
    return max(0.0, last["comm_end"] - backward_end), sorted(
        b["index"] for b in buckets if b["comm_end"] > backward_end)


def exposed_not_clamped(buckets, backward_end):
    return max(b["comm_end"] for b in buckets) - backward_end, sorted(
        b["index"] for b in buckets if b["comm_end"] > backward_end)


def exposed_by_start(buckets, backward_end):
    latest = max(b["comm_end"] for b in buckets)
    return max(0.0, latest - backward_end), sorted(b["index"] for b in buckets
                                                   if b["comm_start"] > backward_end)


def exposed_in_ms(buckets, backward_end):
    s, idx = exposed_ok_max(buckets, backward_end)
    return 1e3 * s, idx


def exposed_inclusive(buckets, backward_end):
    latest = max(b["comm_end"] for b in buckets)
    return max(0.0, latest - backward_end), sorted(b["index"] for b in buckets
                                                   if b["comm_end"] >= backward_end)


def exposed_seconds_only(buckets, backward_end):
    return exposed_ok_max(buckets, backward_end)[0]


def exposed_from_first_start(buckets, backward_end):  # the whole communication span
    s = min(b["comm_start"] for b in buckets)
    return max(b["comm_end"] for b in buckets) - s, exposed_ok_max(buckets, backward_end)[1]


def exposed_stub(buckets, backward_end):
    raise NotImplementedError


def exposed_crashes_on_empty_key(buckets, backward_end):
    return max(0.0, max(b["end"] for b in buckets) - backward_end), []


EXPOSED = {
    "check": lambda cluster, fn: Y.check_exposed(cluster, fn), "world": 2,
    "correct": [exposed_ok_max, exposed_ok_loop, exposed_ok_tuple_of_numpy],
    "wrong": [(exposed_summed, Y.SUMMED), (exposed_summed_exposed_only, Y.SUMMED_EXPOSED),
              (exposed_last_by_index, Y.LAST_BY_INDEX), (exposed_not_clamped, Y.NEGATIVE),
              (exposed_by_start, Y.BY_START), (exposed_in_ms, Y.UNITS),
              (exposed_inclusive, Y.AT_THE_END), (exposed_seconds_only, Y.NOT_A_PAIR),
              (exposed_from_first_start, None), (exposed_stub, "not implemented yet"),
              (exposed_crashes_on_empty_key, "your code raised an exception")],
}
