"""How a recording of your run ends: never silently.

Teaches: a recorder that gathers every rank's part must run collectives, and a
collective is only safe where every rank reaches it. ``ddplab.record`` finishes
by itself at the end of the last step asked for (ddplab.measure.recording).
When the run ends before that (a shorter loop, the process group destroyed, an
error), nothing can be gathered any more, so the recorder says so instead:
at exit, rank 0 prints one line naming the steps recorded and what to call.
A gathering that fails after the recorder finished by itself (a rank died, or
never came) runs on a thread where no call of yours can receive the error, so
each rank where it failed prints it at once (ddplab.measure.recording).

Also here: what rank 0's machine looked like while it recorded (cores, load
average), which the what-if reads to say when it cannot be trusted.

Leaves out: writing a partial run from rank 0's part alone (it would be one
rank drawn as if it were the run).
References: Python's atexit (runs at a normal exit and after an uncaught
exception, not when the process is killed); torch.distributed.is_initialized.
"""
from __future__ import annotations

import atexit
import os
import sys
import weakref

FINISH_TIMEOUT_S = 120.0  # how long a rank waits for the others: at record() and finish()'s first barrier
UNFINISHED: weakref.WeakSet = weakref.WeakSet()  # RunRecorders not finished yet


DESTROYED = ("ddplab.record: the process group was destroyed before finish(), so the ranks' "
             "parts cannot be gathered and nothing was written: call rec.finish() on every "
             "rank BEFORE dist.destroy_process_group()")


def _steps_text(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


@atexit.register
def _say_unfinished() -> None:
    """At exit: every recording not finished says so on rank 0 (never a silent run)."""
    for rec in list(UNFINISHED):
        if not rec.finished and rec.rank == 0:
            print(unfinished_message(rec), file=sys.stderr, flush=True)


def group_alive(group) -> bool:
    """Whether ``group`` can still run collectives (not destroyed)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    try:
        dist.get_rank(group)
    except (RuntimeError, ValueError):
        return False
    return True


def unfinished_message(rec) -> str:
    """What rank 0 says at exit when ``rec`` (a RunRecorder) never finished: nothing written."""
    started = rec.started  # the last step whose forward ran
    first, last = rec.steps.start, min(started, rec.steps.stop - 1)
    asked = f"steps=range({rec.steps.start}, {rec.steps.stop})"
    where = f" to {rec.out}.json" if rec.out is not None else ""
    if last < first:
        done = (f"no step was recorded: your loop ran {rec.step} optimizer step(s), "
                "fewer than the first one asked for")
    elif started >= rec.steps.stop - 1:
        done = (f"{_steps_text(first, last)} of {asked} were recorded, but no torch.optim "
                f"optimizer step came after step {last}'s backward and no forward after it "
                "(the recorder finishes at either)")
    else:
        done = (f"{_steps_text(first, last)} of {asked} were recorded, but the run ended "
                f"before the end of step {rec.steps.stop - 1}, the last one asked for")
    error = getattr(sys, "last_value", None)  # set when an uncaught exception ends the script
    if error is not None:
        return (f"ddplab.record: nothing was written{where}: the run stopped with an error "
                f"({type(error).__name__}); {done}.")
    how = ("call rec.finish() on every rank after your loop and BEFORE "
           "dist.destroy_process_group() (the group was destroyed first)"
           if not group_alive(rec.group) else "call rec.finish() on every rank after your loop")
    shorter = (f", or ask for steps=range({first}, {last + 1})" if last >= first else
               ", or ask for steps your loop runs")
    return f"ddplab.record: nothing was written{where}: {done}. To write it, {how}{shorter}."


def machine(world: int) -> dict:
    """Rank 0's machine while it recorded: the what-if's "loaded machine" rule reads it."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return {"cores": cores, "load_1m": os.getloadavg()[0],
            "local_ranks": int(os.environ.get("LOCAL_WORLD_SIZE", world))}
