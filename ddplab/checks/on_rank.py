"""The graders' rank side: a training loop per exercise, wrapped around the learner's code.

Teaches how to test synchronization code on live ranks. Each loop trains
the graded net (``workload``) for a few steps with the learner's code in the
middle, and at every step notes, on every rank:

- what this rank's gradients were after synchronization, compared (on a
  copy of the model, no communication) with the gradient of this rank's
  own data and with the gradient one process would get from every rank's
  data, at the same weights: "ok", "local", "scaled" (by how much) or
  "wrong";
- which collectives ran, on what, and when (``watch``);
- after the step, whether every rank holds the same weights, and how far
  they are from one process and from torch DDP trained on the same data.

The learner's collectives are watched, and their waits cut short, through
the observing process group (see ``watch``); the grader meets the other ranks after each step on a group of
its own, so its collectives never pair with the learner's.

Leaves out: timing of any kind in the verdict (clock stamps feed only the
drawn timeline).
"""
from __future__ import annotations

import datetime
import traceback

import torch
import torch.distributed as dist

from ddplab.checks import workload as W
from ddplab.checks.mistakes import NOT_IMPLEMENTED, RAISED, CheckFailed
from ddplab.checks.watch import Stalled, Watch
from ddplab.pg.inner import timed_out
from ddplab.timeline.clock import estimate_offsets
from ddplab.timeline.recorder import Recorder


def run_learner_code(where: str, fn, *args):
    """Run learner code; its own errors become a CheckFailed that says where."""
    try:
        return fn(*args)
    except (CheckFailed, Stalled):
        raise
    except NotImplementedError as exc:
        raise CheckFailed(NOT_IMPLEMENTED, f"{where} raised NotImplementedError"
                          + (f" ({exc})" if str(exc) else "") + ".") from None
    except Exception as exc:  # noqa: BLE001 - the learner's error, shown as theirs
        frames = [(f.filename, f.lineno, f.name, f.line) for f in traceback.extract_tb(exc.__traceback__)
                  if "/ddplab/" not in f.filename and "/torch/" not in f.filename]
        hint = ""
        if isinstance(exc, TypeError) and "NoneType" in str(exc):
            # torch's own check (distributed_c10d._check_single_tensor) on a missing gradient
            hint = (" A frozen parameter (requires_grad=False) has no gradient: p.grad is None. "
                    "Skip parameters whose .grad is None.")
        raise CheckFailed(RAISED, f"{where} raised {type(exc).__name__}: {exc}{hint}", frames) from None


def classify_gradients(got, mean, local, world_size) -> dict:
    """Each parameter's gradient after sync: ok / local / scaled / local_scaled / missing / wrong."""
    out = {}
    for name, ref in mean.items():
        g = got.get(name)
        if g is None:
            out[name] = {"param": name, "class": "missing"}
        elif torch.allclose(g, ref, rtol=1e-9, atol=1e-12):
            out[name] = {"param": name, "class": "ok"}
        elif torch.allclose(g, local[name], rtol=1e-9, atol=1e-12):
            out[name] = {"param": name, "class": "local"}
        else:
            out[name] = _scaled(name, g, ref, "scaled") or _scaled(name, g, local[name], "local_scaled") \
                or {"param": name, "class": "wrong"}
    return out


def _scaled(name, g, ref, label):
    denom = float((ref * ref).sum())
    if denom == 0.0:
        return None
    s = float((g * ref).sum()) / denom
    if torch.allclose(g, s * ref, rtol=1e-9, atol=1e-12):
        return {"param": name, "class": label, "scale": s}
    return None


class Grading:
    """What one check holds on a rank: groups, recorders, references, the watch."""

    def __init__(self, cfg: dict, model):
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        timeout = datetime.timedelta(seconds=cfg["hang_s"])
        self.learner_group = dist.new_group(timeout=timeout)
        self.grader_group = dist.new_group(timeout=timeout)
        self.ddp_rec = Recorder("torch DDP", self.rank, self.world)
        self.rec = Recorder("yours", self.rank, self.world)
        self.watch = Watch(model, self.learner_group, self.rec, hang_s=cfg["hang_s"])
        self.watch.attach_markers(model)  # before the learner's hooks: see watch.py
        self.steps: list = []
        self.params: list = []  # this rank's weights after each step

    def begin(self, step):
        self.watch.begin_step(step)
        self.rec.begin_iteration(step)
        self.first_backward = self.watch.backwards + 1

    def end(self, step, model, got, mean, local):
        facts = self.watch.step_facts(step)
        facts["first_backward"] = self.first_backward
        facts["grads"] = classify_gradients(got, mean, local, self.world)
        params = W.flat_params(model)
        self.params.append(params)
        gathered = [torch.zeros_like(params) for _ in range(self.world)]
        try:  # the grader's own meeting, on its own group
            dist.all_gather(gathered, params, group=self.grader_group)
        except RuntimeError as exc:
            if not timed_out(exc):  # gloo's words or NCCL's (wrapped.timed_out)
                raise
            raise Stalled(self.rank, f"finished step {step} (having started "
                                     f"{len(facts['launches'])} collective(s)) and waited for the "
                                     "other ranks to finish it") from None
        facts["gap_between_ranks"] = float(max((g - gathered[0]).abs().max() for g in gathered))
        self.steps.append(facts)
        self.rec.end_iteration()

    def result(self, **extra) -> dict:
        # The references run last: an untouched stub fails before paying for torch DDP.
        ref = W.references(self.cfg["steps"], self.cfg["n_micro"], recorder=self.ddp_rec)
        for facts, params, one, ddp in zip(self.steps, self.params, ref["one_process"],
                                           ref["torch_ddp"]):
            facts["gap_one_process"] = float((params - one).abs().max())
            facts["gap_torch_ddp"] = float((params - ddp).abs().max())
        clock = estimate_offsets(rounds=3, group=self.grader_group)
        for g in (self.learner_group, self.grader_group):
            dist.destroy_process_group(g)
        return dict(extra, rank=self.rank, steps=self.steps, clock=clock,
                    timeline=self.rec.result().to_dict(),
                    ddp_timeline=self.ddp_rec.result().to_dict())


def _grads(model) -> dict:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in W.trainable(model)}


def grade_function(fn, cfg) -> dict:
    """``fn(model)`` after backward (average_gradients). The ranks start equal: averaging
    gradients is not asked to broadcast weights."""
    rank = dist.get_rank()
    model = W.graded_model(W.SEED + rank)
    model.load_state_dict(W.graded_model(W.SEED).state_dict())
    g = Grading(cfg, model)
    opt = torch.optim.SGD(model.parameters(), lr=W.LR)
    for step in range(cfg["steps"]):
        (x, y), = W.micro_batches(rank, step)
        local, mean = W.grads_at(model, x, y), W.grads_at(model, *W.union(step, g.world))
        g.begin(step)
        with g.rec.phase("forward"):
            loss = W.loss_fn(model(x), y)
        opt.zero_grad()
        g.watch.phase = "backward"
        with g.rec.phase("backward"):
            loss.backward()
        g.watch.phase = "after backward"
        with g.watch.installed(), g.rec.phase("wait"):
            run_learner_code("your function", fn, model)
        got = _grads(model)
        with g.rec.phase("step"):
            opt.step()
        g.end(step, model, got, mean, local)
    return g.result()


def grade_wrapper(cls, cfg) -> dict:
    """``cls(module, *cfg["args"])`` wraps the model (OverlapDDP, BucketedDDP): it must
    broadcast rank 0's weights and average gradients by the end of backward
    (or in ``finish_gradient_synchronization()``, which is called when it exists)."""
    rank = dist.get_rank()
    inner = W.graded_model(W.SEED + rank)  # a different start on every rank
    g = Grading(cfg, inner)
    with g.watch.installed():
        model = run_learner_code("your class's __init__", cls, inner, *cfg.get("args", ()))
    start_gap = float((W.flat_params(inner) - W.flat_params(W.graded_model(W.SEED))).abs().max())
    opt = torch.optim.SGD(inner.parameters(), lr=W.LR)
    finish = getattr(model, "finish_gradient_synchronization", None)
    for step in range(cfg["steps"]):
        (x, y), = W.micro_batches(rank, step)
        local, mean = W.grads_at(inner, x, y), W.grads_at(inner, *W.union(step, g.world))
        g.begin(step)
        opt.zero_grad()
        with g.watch.installed():
            with g.rec.phase("forward"):
                loss = W.loss_fn(run_learner_code("your forward", model, x), y)
            g.watch.phase = "backward"
            with g.rec.phase("backward"):
                run_learner_code("backward (your hooks)", loss.backward)
            g.watch.phase = "after backward"
            if callable(finish):
                with g.rec.phase("wait"):
                    run_learner_code("your finish_gradient_synchronization", finish)
        got = _grads(inner)
        with g.rec.phase("step"):
            opt.step()
        g.end(step, inner, got, mean, local)
    return g.result(start_gap=start_gap)


def grade_accumulation(fn, cfg) -> dict:
    """``fn(model, optimizer, micro_batches)``: one optimizer step over the micro-batches,
    with ``model`` a torch DistributedDataParallel."""
    from ddplab.sync.registry import build_strategy

    rank, n = dist.get_rank(), cfg["n_micro"]
    inner = W.graded_model(W.SEED + rank)
    g = Grading(cfg, inner)
    # torch DDP's own bucket all-reduces reach the watch through the observing group
    model = build_strategy("ddp", inner, process_group=g.learner_group).model
    opt = torch.optim.SGD(model.parameters(), lr=W.LR)
    stepped: list = []
    real_step = opt.step

    def step_and_note(*args, **kwargs):  # the gradients the optimizer really used
        stepped.append(_grads(inner))
        return real_step(*args, **kwargs)
    opt.step = step_and_note
    for step in range(cfg["steps"]):
        batches = W.micro_batches(rank, step, n)
        mine = (torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
        local, mean = W.grads_at(inner, *mine), W.grads_at(inner, *W.union(step, g.world, n))
        opt.zero_grad(set_to_none=True)
        stepped.clear()
        g.begin(step)
        with g.watch.installed(), g.rec.phase("backward"):
            run_learner_code("your function", fn, model, opt, batches)
        got = stepped[0] if stepped else _grads(inner)
        g.end(step, inner, got, mean, local)
        g.steps[-1]["optimizer_steps"] = len(stepped)
        g.steps[-1]["backwards"] = g.watch.backwards - g.first_backward + 1
    return g.result()


GRADERS = {"average_gradients": grade_function, "overlap": grade_wrapper,
           "bucketed": grade_wrapper, "no_sync": grade_accumulation}


def grade_exercise(exercise: str, learner, cfg: dict) -> dict:
    """The job every rank runs for one check."""
    return GRADERS[exercise](learner, cfg)
