"""The graders a learner calls: run your code on the live ranks, name the mistake, or show the timeline.

Each ``check_*(cluster, your_code)`` sends one job to every rank of the
Cluster (``on_rank``), gathers what the ranks observed, and either

- raises ``CheckFailed`` naming the likely mistake (``mistakes``), or
- prints a short summary and draws your timeline next to torch DDP's
  (same model, same data, same ranks) when run in a notebook.

A check that hangs is stopped: collectives stall for at most ``timeout``
seconds before the rank reports what it was waiting for, and the whole job
for at most ``2 * timeout + 10`` seconds (then the message shows where each
rank was).

``passed`` remembers each exercise's last verdict in this kernel, and
``yours_or_ours`` lets later cells fall back to ddplab's own implementation
when an exercise was skipped or failed.
"""
from __future__ import annotations

import dataclasses
import linecache

from ddplab.checks import workload as W
from ddplab.checks.mistakes import HUNG, NOT_IMPLEMENTED, RAISED, CheckFailed, diagnose

STATE_CHANGED = "an earlier cell changed torch on the ranks"
NOT_FINISHED = "your code did not finish (a loop that never ends?)"
from ddplab.cluster.errors import JobTimeout, RankError

passed: dict = {}  # exercise -> True / False (last verdict in this kernel)
TITLES = {"all_reduce": "all_reduce", "average_gradients": "average_gradients", "overlap": "OverlapDDP",
          "bucketed": "BucketedDDP", "no_sync": "no_sync accumulation"}


@dataclasses.dataclass
class CheckResult:
    exercise: str
    summary: str
    per_rank: list
    config: dict

    def timelines(self) -> dict:
        """``{"yours": Timeline, "torch DDP": Timeline}`` on rank 0's clock."""
        from ddplab.timeline import Timeline

        offsets = {int(k): v for k, v in self.per_rank[0]["clock"]["offsets"].items()}
        out = {}
        for label, key in (("yours", "timeline"), ("torch DDP", "ddp_timeline")):
            tl = Timeline.merge([Timeline.from_dict(f[key]) for f in self.per_rank]).shifted(offsets)
            tl.strategy = label
            out[label] = tl
        return out

    def figure(self):
        from ddplab.widgets import compare_timelines_figure

        fig = compare_timelines_figure(self.timelines())
        fig.update_layout(title=f"{TITLES[self.exercise]}: your timeline next to torch DDP's "
                                "(last step; same model, data and ranks)")
        return fig

    def __repr__(self):
        return f"CheckResult({self.exercise!r}: passed)"


def _config(cluster, learner, what, steps, timeout, **extra) -> dict:
    if not callable(learner):
        raise TypeError(f"pass your {what} itself (a callable), got {type(learner).__name__}")
    if getattr(cluster, "world_size", 0) < 2:
        raise ValueError("the graders need a Cluster of at least 2 ranks: ddplab.Cluster(world_size=2)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    return dict(steps=steps, n_micro=1, hang_s=float(timeout), **extra)


def _run(cluster, exercise: str, learner, cfg: dict, draw: bool) -> CheckResult:
    from ddplab.checks import on_rank

    passed[exercise] = False
    try:
        per_rank = cluster.run_job(on_rank.grade_exercise, (exercise, learner, cfg),
                                   job_timeout=2 * cfg["hang_s"] + 10)
    except RankError as err:
        raise from_rank_error(err) from None
    try:
        diagnose(exercise, per_rank, cfg)
    except CheckFailed as failed:
        raise failed from None
    passed[exercise] = True
    result = CheckResult(exercise, _summary(exercise, per_rank, cfg), per_rank, cfg)
    print(result.summary)
    if draw:
        _draw(result)
    return result


def from_rank_error(err: RankError) -> Exception:
    exceptions = {r: e for r, e in err.exceptions.items() if e is not None}
    failed = {r: e for r, e in exceptions.items() if isinstance(e, CheckFailed)}
    if failed:
        first = failed[min(failed)]
        if first.frames:
            lines = [f'  File "{f}", line {n}, in {name}\n    '
                     f'{(line or linecache.getline(f, n)).strip()}' for f, n, name, line in first.frames]
            return CheckFailed(first.mistake, first.detail + "\nwhere, in your code:\n" + "\n".join(lines))
        return CheckFailed(first.mistake, first.detail)
    from ddplab.checks.watch import Stalled

    stalled = {r: e for r, e in exceptions.items() if isinstance(e, Stalled)}
    if stalled or isinstance(err, JobTimeout):
        lines = [f"rank {r} {e.what}." for r, e in sorted(stalled.items())]
        lines += [f"rank {r}: {s}." for r, s in sorted(err.status.items()) if r not in stalled]
        if isinstance(err, JobTimeout):
            lines += [f"rank {r} was here (Python stack):\n{text.rstrip()[-1500:]}"
                      for r, text in sorted(err.stacks.items())]
        how = ("Every rank must call the same collectives, in the same order, and wait only for "
               "work it launched.")
        return CheckFailed(HUNG, "stopped: " + "\n".join(lines) + f"\n{how}\n(The ranks were "
                           "replaced, as after any stuck collective.)")
    return raised(err)


def raised(err: RankError) -> CheckFailed:
    """A learner's exception on the ranks, in words (never a raw RankError)."""
    exceptions = {r: e for r, e in err.exceptions.items() if e is not None}
    if any(isinstance(e, NotImplementedError) for e in exceptions.values()):
        return CheckFailed(NOT_IMPLEMENTED, "your code raised NotImplementedError on the ranks.")
    lines = [f"rank {r}: {type(e).__name__}: {str(e).strip()[:400]}" for r, e in sorted(exceptions.items())]
    return CheckFailed(RAISED, "\n".join(lines or [str(err).splitlines()[0][:400]]))


def _draw(result: CheckResult) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or not hasattr(shell, "kernel"):
        return  # a terminal or a test: nothing to draw on
    display(result.figure())


def _summary(exercise, per_rank, cfg) -> str:
    steps = per_rank[0]["steps"]
    gap1 = max(s["gap_one_process"] for f in per_rank for s in f["steps"])
    gap2 = max(s["gap_torch_ddp"] for f in per_rank for s in f["steps"])
    launches = [x for x in steps[-1]["launches"]]
    n = len(launches)
    on = sorted({x["kind"] for x in launches})
    kinds = {"grad": "gradients", "own": "your own tensors", "weight": "weights"}
    lines = [f"{TITLES[exercise]}: passed. {cfg['steps']} steps on {len(per_rank)} ranks, float64, "
             "different data and start on every rank, a tied and a frozen parameter.",
             f"  weights equal one process on all the data (max gap {gap1:.1e}) and torch DDP "
             f"({gap2:.1e}) after every step;",
             f"  last step on rank 0: {n} collective(s) on {', '.join(kinds[k] for k in on) or '-'}"]
    inside = [x for x in launches if x["phase"] == "backward"]
    if exercise in ("overlap", "bucketed"):
        open_ = sum(1 for x in inside if not x["waited_before_next_hook"])
        lines[-1] += (f", {len(inside)} launched during backward, {open_} still in flight when "
                      "the next gradient hook fired")
    if exercise == "bucketed":
        order = [cfg["bucket_numels"].index(x["numel"]) for x in launches]
        lines[-1] += f"; buckets launched in order {order}"
    if exercise == "no_sync":
        lines[-1] += (f", all in the backward of the last of {cfg['n_micro']} micro-batches; "
                      f"optimizer stepped {steps[-1]['optimizer_steps']} time(s) per step")
    return "\n".join(lines) + "."


def check_average_gradients(cluster, fn, *, steps: int = 3, timeout: float = 15.0, draw: bool = True):
    """Grade ``fn(model)``, called after ``loss.backward()`` on every rank: afterwards every
    ``param.grad`` must hold the mean over ranks (ranks start from equal weights here)."""
    cfg = _config(cluster, fn, "function", steps, timeout)
    return _run(cluster, "average_gradients", fn, cfg, draw)


def check_overlap_ddp(cluster, cls, *, steps: int = 3, timeout: float = 15.0, draw: bool = True):
    """Grade ``cls(module)``: broadcast rank 0's weights at construction, launch one async
    all-reduce per gradient from its hook, and have averaged gradients by the end of
    backward (or after ``finish_gradient_synchronization()``, called if it exists)."""
    cfg = _config(cluster, cls, "class", steps, timeout)
    return _run(cluster, "overlap", cls, cfg, draw)


def check_bucketed_ddp(cluster, cls, *, steps: int = 3, timeout: float = 15.0, draw: bool = True):
    """Grade ``cls(module, bucket_cap_mb)``: as ``check_overlap_ddp``, with gradients in
    buckets (``ddplab.sync.assign_buckets``' rule), each launched once ready, in index order."""
    from ddplab.sync.bucket import assign_buckets

    params = [p for _, p in W.trainable(W.graded_model(W.SEED))]
    layout = assign_buckets(params, W.BUCKET_CAP_MB)
    numels = [sum(params[i].numel() for i in b) for b in layout]
    cfg = _config(cluster, cls, "class", steps, timeout, args=(W.BUCKET_CAP_MB,), bucket_numels=numels)
    return _run(cluster, "bucketed", cls, cfg, draw)


def check_no_sync(cluster, fn, *, micro_batches: int = 4, steps: int = 3, timeout: float = 15.0,
                  draw: bool = True):
    """Grade ``fn(model, optimizer, micro_batches)``: ONE optimizer step accumulating the
    gradients of every micro-batch, ``model`` being torch's DistributedDataParallel; the
    loss is ``ddplab.checks.loss_fn`` (a mean over the micro-batch)."""
    cfg = _config(cluster, fn, "function", steps, timeout)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 2:
        raise ValueError(f"micro_batches must be an integer >= 2, got {micro_batches!r}")
    cfg["n_micro"] = micro_batches
    return _run(cluster, "no_sync", fn, cfg, draw)


def attempt(fn, *args, **kwargs):
    """Call the learner's ``fn`` here, in the kernel; an untouched stub fails as
    "not implemented yet" (for exercises checked by plain asserts)."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise CheckFailed(NOT_IMPLEMENTED, f"{getattr(fn, '__name__', 'your code')} raised "
                                           "NotImplementedError.") from None


def run_exercise(cluster, fn, *args, **kwargs) -> list:
    """``cluster.run(fn, ...)`` for a learner's function; an untouched stub fails as
    "not implemented yet" instead of a rank's traceback."""
    try:
        return cluster.run(fn, *args, **kwargs)
    except RankError as err:
        if any(isinstance(e, NotImplementedError) for e in err.exceptions.values()):
            raise CheckFailed(NOT_IMPLEMENTED, f"{getattr(fn, '__name__', 'your code')} raised "
                                               "NotImplementedError on the ranks.") from None
        raise


def yours_or_ours(exercise: str, yours, ours):
    """``yours`` if its check passed in this kernel, else ``ours``, saying so."""
    if passed.get(exercise):
        return yours
    why = "did not pass its check" if exercise in passed else "was not checked (skipped?)"
    print(f"Your {TITLES[exercise]} {why}: the cells below use ddplab's own "
          f"{getattr(ours, '__name__', ours)} instead.")
    return ours


def _changes_here() -> list:
    from ddplab.contracts.pristine import changes

    return changes()


def refuse_changed_torch(cluster) -> None:
    """Before grading: every rank's grad mode, default dtype and torch.distributed functions as
    the rank started, or a CheckFailed naming what a cell changed. A job of its own, with no
    collective: a rank changed alone cannot leave the others waiting in the grader's."""
    per_rank = cluster.run_job(_changes_here, job_timeout=30)
    said = [f"rank {r}: {c}" for r, found in enumerate(per_rank) for c in (found or [])]
    if said:
        raise CheckFailed(STATE_CHANGED, "what a cell ran on the ranks stays in force for every "
                          "later cell, this check's included, and correct code fails under it:\n"
                          + "\n".join(said) + "\nUndo it in a %%ddp cell (as written after each "
                          "colon), or restart the ranks (cluster.shutdown(), then a new "
                          "ddplab.Cluster(...)), and run the check again.")


def outside_collectives(err: RankError) -> list:
    """The ranks a job timeout found running, none of whose threads was inside torch.distributed
    or ddplab's process group (their Python stacks, dumped when the job ran out of time): the
    code never finished on its own, no collective is pending there. Empty: none, or unknown."""
    stacks = getattr(err, "stacks", None) or {}
    return sorted(r for r, text in stacks.items() if text.strip()
                  and "torch/distributed/" not in text and "ddplab/pg/" not in text)


def not_finished(err: RankError, ranks: list) -> CheckFailed:
    where = "\n".join(f"rank {r} was here (Python stack):\n{err.stacks[r].rstrip()[-1200:]}"
                       for r in ranks)
    return CheckFailed(NOT_FINISHED, f"rank(s) {ranks} were still running your code when the "
                       "check ran out of time, and no collective was pending on them: a loop that "
                       "never ends, or a wait on something that never comes. Look at where each "
                       "was:\n" + where + "\n(The ranks were replaced.)")
