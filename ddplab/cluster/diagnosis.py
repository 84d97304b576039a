"""Reading a failed job: what went wrong first, and can the ranks be kept?

Teaches: when one rank of a data-parallel job fails, the others fail *because
of it* a moment later ("Connection closed by peer", a timeout in the
collective it never joined). A useful error names the root cause, not the
loudest echo. And after a failure the process group may be out of step: if
rank 0 launched three async all-reduces before it raised and rank 1 none,
the next job's first all-reduce on rank 1 pairs with one of rank 0's stale
ones and returns a wrong number, silently. So:

- The root cause comes first: a rank that died (with its signal), then the
  earliest error on a rank, then errors torch.distributed raised (the usual
  knock-on errors).
- The ranks are kept only when it is proven that their collectives still
  line up: every rank answered, no rank died or raised a torch.distributed
  error, and every process group's *sequence number* (the count of
  collectives issued on it, kept by torch per group) is equal on every rank.
  Otherwise they are replaced.
- A collective timeout is recognised by type and state, never by wording:
  TimeoutError or DistError, or the RuntimeError gloo raises, once the rank
  waited at least the group's timeout while the ranks' collectives did not
  line up. With NCCL, torch's watchdog aborts a rank whose collective ran past
  the timeout (SIGABRT); a rank that died that way after at least the
  timeout is reported as a CollectiveTimeout too. (That path needs two GPUs
  and was not run on the machines this was written on.)

Leaves out, compared with torch: the flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE)
that dumps which collective each rank was in; TORCH_DISTRIBUTED_DEBUG=DETAIL
checks collectives' shapes across ranks (pass it in ``env``).

References: ProcessGroup._get_sequence_number_for_group; torch.distributed's
DistError family; TORCH_NCCL_ASYNC_ERROR_HANDLING (the watchdog).
"""
from __future__ import annotations

import signal

_SIGNAL_WORDS = {"SIGSEGV": "segmentation fault", "SIGKILL": "killed, e.g. by the out-of-memory "
                 "killer or kill -9", "SIGABRT": "aborted", "SIGBUS": "bus error",
                 "SIGFPE": "arithmetic error", "SIGTERM": "terminated"}


def exit_words(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        name = signal.Signals(-code).name
        words = _SIGNAL_WORDS.get(name)
        return f"signal {name}" + (f" ({words})" if words else "")
    return f"exit code {code}"


def died_info(code: int | None, elapsed: float) -> dict:
    """A failure record for a rank whose process ended in the middle of a job."""
    return {"type": "RankDied", "message": f"the rank process ended with {exit_words(code)}",
            "frames": [], "died": True, "code": code, "dist_error": False, "elapsed": elapsed}


def lined_up(groups: dict) -> bool:
    """True when every rank reported the same sequence number for every group."""
    states = list(groups.values())
    return bool(states) and all(s is not None for s in states) and all(s == states[0] for s in states)


def is_collective_timeout(info: dict, timeout: float, backend: str, in_step: bool) -> bool:
    if info.get("died"):
        # NCCL's watchdog aborts the process once a collective outlives the timeout.
        return ("nccl" in backend and info.get("code") == -signal.SIGABRT
                and info.get("elapsed", 0.0) >= timeout)
    if info.get("timeout"):
        return True
    waited = info.get("elapsed", 0.0) >= 0.95 * timeout
    # Out of step, or stuck inside a collective (the same count of collectives on
    # every rank can still be different collectives: all_reduce against broadcast).
    stuck = not in_step or info.get("in_collective", False)
    return waited and stuck and (info.get("dist_error") or info.get("runtime_error", False))


def root_cause_order(failures: dict) -> list[int]:
    """Failed ranks, root cause first: died, then own errors, then torch.distributed's."""
    def key(rank):
        f = failures[rank]
        knock_on = f.get("dist_error") or f.get("runtime_error")
        return (0 if f.get("died") else 2 if knock_on else 1, f.get("elapsed", 0.0), rank)

    return sorted(failures, key=key)


def headline(failures: dict) -> str:
    order = root_cause_order(failures)
    first = failures[order[0]]
    if first.get("died"):
        head = f"rank {order[0]} died: {first['message']}"
    else:
        head = f"rank {order[0]} raised {first['type']}: {first['message']}"
    if len(order) > 1:
        rest = "; ".join(f"rank {r}: {failures[r]['type']}" for r in order[1:])
        head += f" (then {rest}{', a knock-on error' if len(order) == 2 else ''})"
    return head


def replace_reason(failures: dict, pending: set, groups: dict, timed_out: list) -> str | None:
    """Why the ranks must be replaced after this job, or None when they can be kept."""
    if pending:
        return "A rank failed while others were still running or inside a collective."
    if any(f.get("died") for f in failures.values()):
        return "A rank process died, and its peers' process group with it."
    if timed_out:
        return "A collective timed out, which leaves the process group unusable."
    from ddplab.pg.group import UNFINISHED_GPU_WORK  # here, not at the top: the kernel never imports torch for it

    unfinished = sorted(r for r, s in groups.items() if s and s.get(UNFINISHED_GPU_WORK))
    if unfinished:
        return (f"NCCL work issued on rank(s) {unfinished} had not finished on the GPU (a blocking "
                "op returns before it runs), so the next job would queue behind it.")
    if any(f.get("dist_error") or f.get("in_collective") for f in failures.values()):
        return "torch.distributed raised an error, after which the process group may be unusable."
    if not lined_up(groups):
        counts = ", ".join(f"rank {r}: {_count(s)}" for r, s in sorted(groups.items()))
        return ("The ranks had issued different numbers of collectives before they stopped "
                f"({counts}), so the next job's collectives would pair with stale ones.")
    return None


def _count(state) -> str:
    if state is None:
        return "unknown"
    return " / ".join(f"{sum(seq)} on group {name}" for name, seq in sorted(state.items())) or "none"


def unpickle_exceptions(failures: dict) -> None:
    """Rebuild each rank's exception object where it travelled (for ``except`` clauses)."""
    import cloudpickle

    for info in failures.values():
        if info.get("exception"):
            try:
                info["exception_obj"] = cloudpickle.loads(info["exception"])
            except Exception:  # a class the kernel cannot import: the text still says it all
                pass


def rank_status(world_size: int, results: dict, failures: dict, targets: set) -> dict:
    """One line per rank for an error message: what each rank did in the job."""
    status = {}
    for r in range(world_size):
        if r in results:
            status[r] = "returned normally"
        elif r in failures:
            status[r] = "died" if failures[r].get("died") else f"raised {failures[r]['type']}"
        elif r not in targets:
            status[r] = "not taking part (the job ran on other ranks only)"
        else:
            status[r] = "still running: broken off (its stack is below)"
    return status
