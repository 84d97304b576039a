"""The mistakes a grader can name, and how it tells them apart from what it observed.

Teaches how each classic data-parallel bug shows up from the outside:

- in the VALUES: after synchronization every rank should hold the gradient
  one process would compute on the union of all ranks' data. A gradient
  ``world_size`` times too large means no division; ``1/world_size`` of it
  means dividing twice; this rank's own local gradient means nothing was
  synchronized. With gradient accumulation the factor is the number of
  micro-batches instead;
- in WHAT was all-reduced: the parameter's own storage means weights were
  averaged instead of gradients (e.g. ``dist.all_reduce(param)`` in a hook
  that receives the parameter, not its gradient);
- in WHEN: a wait before the next gradient hook fires means nothing could
  overlap with backward; gradient all-reduces during a backward that should
  have been inside ``no_sync``; buckets launched in another order than their
  index (the values can still come out right, since every rank makes the same
  mistake, but ranks pair collectives by order, and a rank whose gradients
  arrive in another order would add up the wrong buckets);
- in WHERE the ranks start: a wrapper that does not broadcast rank 0's
  weights leaves every rank training its own model.

``diagnose(exercise, per_rank)`` turns the ranks' facts (see ``on_rank``)
into a ``CheckFailed`` that names the first mistake found, in that order.
"""
from __future__ import annotations

NOT_IMPLEMENTED = "not implemented yet"
RAISED = "your code raised an exception"
HUNG = "your code hung"
NO_DIVISION = "no division by world size"
WEIGHTS_AVERAGED = "weights averaged instead of gradients"
DIVIDED_TWICE = "divided twice"
NO_BROADCAST = "no initial broadcast"
WAIT_IN_HOOK = "waiting inside the hook (no overlap)"
OUT_OF_ORDER = "buckets launched out of order"
NO_SYNC_NO_DIVISION = "no_sync without dividing the loss by the number of micro-batches"
REDUCED_IN_NO_SYNC = "a gradient all-reduced inside no_sync"
NO_SYNC_AT_ALL = "no synchronization at all"
NEVER_WAITED = "an all-reduce was never waited for"
REDUCED_TWICE = "one gradient all-reduced twice in a step"
BAD_LAYOUT = "buckets not laid out by the rule"
WRONG = "the result differs from one process training on all the data"

EXPLAIN = {
    NOT_IMPLEMENTED: "replace the `raise NotImplementedError` in your cell with your code, run that "
                     "cell, then run this check again.",
    NO_DIVISION: "all-reduce SUMs the ranks' gradients; divide by the world size to get their mean "
                 "(each rank's loss is already a mean over its own batch).",
    WEIGHTS_AVERAGED: "the all-reduce ran on the parameter itself, not on its gradient. A "
                      "post-accumulate-grad hook receives the PARAMETER: reduce `param.grad`.",
    DIVIDED_TWICE: "the gradients came out world_size times too small: the division by the world "
                   "size happened twice (e.g. before and after the all-reduce).",
    NO_BROADCAST: "the ranks started from different weights and still trained different models. "
                  "In __init__ copy rank 0's parameters to every rank: "
                  "dist.broadcast(p.data, src=0) for every parameter.",
    WAIT_IN_HOOK: "every all-reduce was finished before the next gradient hook fired, so none "
                  "of them overlapped with backward. Launch with async_op=True, keep the work, "
                  "and wait for all of them only at the end of backward.",
    OUT_OF_ORDER: "a bucket left before a bucket with a lower index. Ranks pair collectives by "
                  "the order they are called in: launch bucket k only once buckets 0..k-1 have "
                  "been launched (keep a 'next bucket to launch' counter).",
    NO_SYNC_NO_DIVISION: "the accumulated gradient is the SUM over the micro-batches; divide each "
                         "micro-batch's loss by their number to get the mean.",
    REDUCED_IN_NO_SYNC: "gradients were all-reduced during a backward that should only have "
                        "accumulated. torch decides at FORWARD time: run both the forward and "
                        "the backward of every micro-batch but the last inside model.no_sync().",
    NO_SYNC_AT_ALL: "after synchronization each rank still held the gradient of its own data: "
                    "no gradient was all-reduced.",
    NEVER_WAITED: "an async all-reduce was launched and never waited for, so the optimizer may "
                  "read the gradient before the result arrived. Call work.wait() at the end.",
    REDUCED_TWICE: "the same gradient tensor went through all-reduce twice in one step. A "
                   "parameter used in two places (tied weights) is ONE parameter with one "
                   "gradient: hook and reduce each parameter once (model.parameters() already "
                   "lists a shared parameter once; named_parameters(remove_duplicate=False) "
                   "does not). Two reductions can even give the right mean by chance.",
    BAD_LAYOUT: "put parameters in buckets in REVERSE model.parameters() order (trainable ones), "
                "adding each to the open bucket of its dtype and closing that bucket once its "
                "size reaches bucket_cap_mb (torch's rule); "
                "ddplab.sync.assign_buckets(params, bucket_cap_mb) gives that layout.",
    WRONG: "",
}


class CheckFailed(AssertionError):
    """A grader's verdict: ``.mistake`` is one of this module's names, ``.detail`` says more."""

    def __init__(self, mistake: str, detail: str = "", frames=()):
        self.mistake, self.detail, self.frames = mistake, detail, list(frames)
        text = f"{mistake}: {EXPLAIN.get(mistake, '')}".rstrip(": ")
        super().__init__(text + (f"\n{detail}" if detail else ""))

    def __reduce__(self):
        return (CheckFailed, (self.mistake, self.detail, self.frames))

    def _render_traceback_(self):
        # IPython shows this instead of a traceback: the verdict is about the learner's
        # code, and the grader's own frames would only hide it.
        return [f"\x1b[0;31mCheckFailed\x1b[0m: {self}"]


def _grad_classes(per_rank, step):
    return [c for facts in per_rank for c in facts["steps"][step]["grads"].values()]


def _launches(per_rank, step):
    return [x for facts in per_rank for x in facts["steps"][step]["launches"]]


def diagnose(exercise: str, per_rank: list, cfg: dict) -> None:
    """Raise ``CheckFailed`` for the first mistake in ``per_rank`` (facts by rank), else return."""
    world = len(per_rank)
    first = per_rank[0]
    if exercise in ("overlap", "bucketed"):
        gaps = [f["start_gap"] for f in per_rank]
        if max(gaps) > 1e-12:
            raise CheckFailed(NO_BROADCAST, f"after your __init__, rank {gaps.index(max(gaps))}'s "
                                            f"weights differ from rank 0's by up to {max(gaps):.3g}.")
    for step in range(len(first["steps"])):
        launches = _launches(per_rank, step)
        weights = [x for x in launches if x["kind"] == "weight"]
        if weights:
            raise CheckFailed(WEIGHTS_AVERAGED, f"in step {step}: {weights[0]['description']}.")
        classes = _grad_classes(per_rank, step)
        if exercise == "no_sync":
            _no_sync_timing(per_rank, step, cfg)
        never = [x for x in launches if not x["waited"]]
        if never:
            raise CheckFailed(NEVER_WAITED, f"in step {step}: {never[0]['description']}.")
        _reduced_twice(per_rank, step)
        if classes and all(c["class"] in ("local", "local_scaled") for c in classes):
            raise CheckFailed(NO_SYNC_AT_ALL, _nothing_synced(step, launches))
        if exercise in ("overlap", "bucketed"):
            _overlap_timing(per_rank, step)
        if exercise == "bucketed":
            _bucket_order(per_rank, step, cfg)
        if exercise == "no_sync":
            _optimizer_steps(per_rank, step)
        _values(exercise, per_rank, step, classes, world, cfg)
        gap = max(f["steps"][step]["gap_one_process"] for f in per_rank)
        if gap > 1e-9:
            raise CheckFailed(WRONG, f"after step {step} the weights differ from one process's "
                                     f"by up to {gap:.3g} (the gradients looked right: was the "
                                     "optimizer step or the weights changed elsewhere?)")


def _reduced_twice(per_rank, step):
    """The same gradient (the same memory: address and length) reduced twice by one rank."""
    for rank, facts in enumerate(per_rank):
        seen = {}
        for x in facts["steps"][step]["launches"]:
            if x["kind"] != "grad" or x.get("ptr") is None:
                continue
            key = (x["ptr"], x["numel"])
            if key in seen:
                raise CheckFailed(REDUCED_TWICE, f"in step {step} on rank {rank}: the gradient of "
                                                 f"{x['param']} ({x['numel']} elements) was "
                                                 "all-reduced twice.")
            seen[key] = x


def _values(exercise, per_rank, step, classes, world, cfg):
    scales = [c.get("scale") for c in classes if c["class"] == "scaled"]
    bad = [c for c in classes if c["class"] != "ok"]
    if not bad:
        return
    where = f"in step {step}, e.g. {bad[0]['param']} ({bad[0]['class']})"
    if scales and all(abs(s - scales[0]) < 1e-6 for s in scales) and len(scales) == len(bad):
        s = scales[0]
        if exercise == "no_sync" and abs(s - cfg["n_micro"]) < 1e-6:
            raise CheckFailed(NO_SYNC_NO_DIVISION, f"the gradients were {s:g} times the mean {where}.")
        if abs(s - world) < 1e-6:
            raise CheckFailed(NO_DIVISION, f"the gradients were {s:g} times the mean {where}.")
        if abs(s - 1 / world) < 1e-9:
            raise CheckFailed(DIVIDED_TWICE, f"the gradients were 1/{world} of the mean {where}.")
    raise CheckFailed(WRONG, f"gradients after your synchronization differ from one-process "
                             f"training's {where}: " + ", ".join(
                                 f"{c['param']}: {c['class']}" for c in bad[:6]))


def _nothing_synced(step, launches) -> str:
    text = f"in step {step}"
    if step > 0:
        text += (" (step 0 was synchronized, so something that worked once did not happen again: "
                 "is some state, a counter or a list, not reset at the end of a step?)")
    own = [x for x in launches if x["kind"] == "own"]
    if own:
        text += (f"; {len(own)} collective(s) ran on tensors that are not the gradients, and the "
                 "result never reached p.grad: dist.all_reduce(p.grad / world) or "
                 "dist.all_reduce(p.grad.clone()) reduces a temporary copy")
    return text + "."


def _optimizer_steps(per_rank, step):
    n = per_rank[0]["steps"][step]["optimizer_steps"]
    if n != 1:
        raise CheckFailed(WRONG, f"optimizer.step() ran {n} time(s) in one call of your function "
                                 f"(step {step}): step once, after the last micro-batch's backward.")


def _overlap_timing(per_rank, step):
    for facts in per_rank:
        inside = [x for x in facts["steps"][step]["launches"] if x["phase"] == "backward"]
        if inside and all(x["waited_before_next_hook"] for x in inside):
            raise CheckFailed(WAIT_IN_HOOK, f"in step {step} on rank {facts['rank']}: "
                                            f"{len(inside)} all-reduce(s) launched in backward, each "
                                            "waited for before the next hook fired.")


def _bucket_order(per_rank, step, cfg):
    sizes = cfg["bucket_numels"]  # bucket index -> elements, from the rule
    for facts in per_rank:
        launched = [x["numel"] for x in facts["steps"][step]["launches"]
                    if x["op"] == "all_reduce" and x["kind"] != "weight"]
        if sorted(launched) != sorted(sizes):
            raise CheckFailed(BAD_LAYOUT, f"rank {facts['rank']} all-reduced tensors of {launched} "
                                          f"elements in step {step}; the rule gives buckets of "
                                          f"{sizes} elements (index 0 first).")
        order = [sizes.index(n) for n in launched]
        if order != sorted(order):
            raise CheckFailed(OUT_OF_ORDER, f"rank {facts['rank']} launched buckets in the order "
                                            f"{order} in step {step} (the gradients became ready "
                                            "in that order).")


def _no_sync_timing(per_rank, step, cfg):
    n = cfg["n_micro"]
    for facts in per_rank:
        s = facts["steps"][step]
        early = [x for x in s["launches"] if x["backward"] is not None
                 and x["backward"] < s["first_backward"] + n - 1]
        if early:
            k = early[0]["backward"] - s["first_backward"]
            raise CheckFailed(REDUCED_IN_NO_SYNC, f"rank {facts['rank']}, step {step}: "
                                                  f"{len(early)} all-reduce(s) during the backward "
                                                  f"of micro-batch {k} of {n}.")
