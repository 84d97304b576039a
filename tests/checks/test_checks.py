"""The graders name each classic mistake, planted in two spellings; the solutions pass.

Every planted mistake below is one small change to the reference solutions in
_exercise_solutions.py, written the way a learner would. The grader must name
it (``CheckFailed.mistake``) from what ran on the live ranks: values,
which collectives ran on what, and when ``wait()`` happened. Budget: ~30 s
on 2 ranks (the two hang tests wait out a 3 s collective timeout each).
"""
import contextlib

import _exercise_solutions as S
import pytest
import torch
import torch.distributed as dist

import ddplab
from ddplab import checks
from ddplab.checks import loss_fn
from ddplab.checks import mistakes as M
from ddplab.sync import core

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(cluster2):
    return cluster2  # shared for the session (conftest.py)


def failure(check, cluster, code, **kw):
    with pytest.raises(checks.CheckFailed) as info:
        check(cluster, code, draw=False, **kw)
    assert isinstance(info.value, AssertionError)
    return info.value


# -- planted mistakes: average_gradients -------------------------------------------------
def avg_no_division(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def avg_flat_no_division(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def avg_weights(model):
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= dist.get_world_size()


def avg_divided_twice(model):
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= world
            dist.all_reduce(p.grad)
            p.grad /= world


def avg_nothing(model):
    world = dist.get_world_size()  # ... and then forgot the loop
    return world


def avg_reduces_a_copy(model):
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.clone()
            dist.all_reduce(g)
            g /= dist.get_world_size()  # never written back


def avg_only_rank0(model):
    if dist.get_rank() == 0:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)


def avg_waits_forever(model):
    import threading
    threading.Event().wait()  # e.g. waiting for a result no thread will ever set


def avg_forgets_frozen(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def avg_stub(model):
    raise NotImplementedError


# -- planted mistakes: OverlapDDP --------------------------------------------------------
class OverlapNoDivision(S.MyOverlapDDP):
    def grad_ready(self, param):
        self.works.append(dist.all_reduce(param.grad, async_op=True))


class OverlapWeights(S.MyOverlapDDP):  # the hook gets the parameter, and reduces it
    def grad_ready(self, param):
        param.data /= self.world_size
        self.works.append(dist.all_reduce(param.data, async_op=True))


class OverlapDividedTwice(S.MyOverlapDDP):
    def finish_gradient_synchronization(self):
        for work in self.works:
            work.wait()
        self.works.clear()
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad /= self.world_size


class OverlapNoBroadcast(S.MyOverlapDDP):
    def __init__(self, module):
        torch.nn.Module.__init__(self)
        self.module, self.world_size, self.works = module, dist.get_world_size(), []
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.grad_ready)


class OverlapWaitsInHook(S.MyOverlapDDP):
    def grad_ready(self, param):
        param.grad /= self.world_size
        dist.all_reduce(param.grad, async_op=True).wait()


class OverlapBlockingHook(S.MyOverlapDDP):
    def grad_ready(self, param):
        dist.all_reduce(param.grad)  # async_op=False: blocks right here
        param.grad /= self.world_size


class OverlapStub(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        raise NotImplementedError("write __init__")


# -- planted mistakes: BucketedDDP -------------------------------------------------------
class BucketsWhenFull(S.MyBucketedDDP):
    """Launches each bucket as soon as it is full, whatever its index."""
    def grad_ready(self, param):
        k = self.bucket_of[param]
        self.ready[k] += 1
        if self.ready[k] == len(self.buckets[k]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[k]]) / self.world_size
            self.in_flight.append((self.buckets[k], flat, dist.all_reduce(flat, async_op=True)))


class BucketsHighestFirst(S.MyBucketedDDP):
    """Scans for full buckets from the highest index down."""
    def grad_ready(self, param):
        self.ready[self.bucket_of[param]] += 1
        launched = {id(b) for b, _, _ in self.in_flight}
        for k in reversed(range(len(self.buckets))):
            bucket = self.buckets[k]
            if id(bucket) not in launched and self.ready[k] == len(bucket):
                flat = torch.cat([p.grad.reshape(-1) for p in bucket]) / self.world_size
                self.in_flight.append((bucket, flat, dist.all_reduce(flat, async_op=True)))


class BucketsBroadcastACopy(S.MyBucketedDDP):
    def __init__(self, module, bucket_cap_mb):
        real = dist.broadcast
        try:  # the learner's line was dist.broadcast(p.detach().clone(), src=0)
            dist.broadcast = lambda t, src, *a, **k: real(t.detach().clone(), src, *a, **k)
            super().__init__(module, bucket_cap_mb)
        finally:
            dist.broadcast = real


class BucketsNeverReset(S.MyBucketedDDP):
    def finish_gradient_synchronization(self):
        for bucket, flat, work in self.in_flight:
            work.wait()
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.in_flight.clear()  # ... but the counters keep last step's values


class OverlapNeverWaits(S.MyOverlapDDP):
    def finish_gradient_synchronization(self):
        self.works.clear()


class BucketsWaitAtLaunch(S.MyBucketedDDP):
    def grad_ready(self, param):
        super().grad_ready(param)
        for _, _, work in self.in_flight:
            work.wait()


# -- planted mistakes: no_sync -----------------------------------------------------------
def acc_no_division(model, optimizer, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        with (contextlib.nullcontext() if i == len(micro_batches) - 1 else model.no_sync()):
            loss_fn(model(x), y).backward()
    optimizer.step()


def acc_block_then_last_no_division(model, optimizer, micro_batches):
    *early, last = micro_batches
    with model.no_sync():
        for x, y in early:
            loss_fn(model(x), y).backward()
    x, y = last
    loss_fn(model(x), y).backward()
    optimizer.step()


def acc_without_no_sync(model, optimizer, micro_batches):
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()


def acc_forward_outside(model, optimizer, micro_batches):
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        loss = loss_fn(model(x), y) / n  # the forward decides: this one syncs
        with (contextlib.nullcontext() if i == n - 1 else model.no_sync()):
            loss.backward()
    optimizer.step()


def acc_everything_in_no_sync(model, optimizer, micro_batches):
    with model.no_sync():
        for x, y in micro_batches:
            (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()


def acc_steps_every_micro_batch(model, optimizer, micro_batches):
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with (contextlib.nullcontext() if i == n - 1 else model.no_sync()):
            (loss_fn(model(x), y) / n).backward()
        optimizer.step()


def acc_stub(model, optimizer, micro_batches):
    raise NotImplementedError


PLANTED = [
    (checks.check_average_gradients, avg_no_division, M.NO_DIVISION),
    (checks.check_average_gradients, avg_flat_no_division, M.NO_DIVISION),
    (checks.check_overlap_ddp, OverlapNoDivision, M.NO_DIVISION),
    (checks.check_average_gradients, avg_weights, M.WEIGHTS_AVERAGED),
    (checks.check_overlap_ddp, OverlapWeights, M.WEIGHTS_AVERAGED),
    (checks.check_average_gradients, avg_divided_twice, M.DIVIDED_TWICE),
    (checks.check_overlap_ddp, OverlapDividedTwice, M.DIVIDED_TWICE),
    (checks.check_overlap_ddp, OverlapNoBroadcast, M.NO_BROADCAST),
    (checks.check_bucketed_ddp, BucketsBroadcastACopy, M.NO_BROADCAST),
    (checks.check_overlap_ddp, OverlapWaitsInHook, M.WAIT_IN_HOOK),
    (checks.check_overlap_ddp, OverlapBlockingHook, M.WAIT_IN_HOOK),
    (checks.check_bucketed_ddp, BucketsWaitAtLaunch, M.WAIT_IN_HOOK),
    (checks.check_bucketed_ddp, BucketsWhenFull, M.OUT_OF_ORDER),
    (checks.check_bucketed_ddp, BucketsHighestFirst, M.OUT_OF_ORDER),
    (checks.check_no_sync, acc_no_division, M.NO_SYNC_NO_DIVISION),
    (checks.check_no_sync, acc_block_then_last_no_division, M.NO_SYNC_NO_DIVISION),
    (checks.check_no_sync, acc_without_no_sync, M.REDUCED_IN_NO_SYNC),
    (checks.check_no_sync, acc_forward_outside, M.REDUCED_IN_NO_SYNC),
    (checks.check_average_gradients, avg_nothing, M.NO_SYNC_AT_ALL),
    (checks.check_average_gradients, avg_reduces_a_copy, M.NO_SYNC_AT_ALL),
    (checks.check_no_sync, acc_everything_in_no_sync, M.NO_SYNC_AT_ALL),
]


@pytest.mark.parametrize("check, code, mistake", PLANTED,
                         ids=[f"{m}-{getattr(c, '__name__', c)}" for _, c, m in PLANTED])
def test_a_planted_mistake_is_named(cluster, check, code, mistake):
    failed = failure(check, cluster, code)
    assert failed.mistake == mistake, str(failed)
    assert str(failed).startswith(mistake)


SOLVED = [(checks.check_average_gradients, S.my_average_gradients),
          (checks.check_overlap_ddp, S.MyOverlapDDP),
          (checks.check_bucketed_ddp, S.MyBucketedDDP),
          (checks.check_no_sync, S.my_accumulation_step)]


@pytest.mark.parametrize("check, code", SOLVED, ids=[c.__name__ for _, c in SOLVED])
def test_the_solutions_pass_and_draw_beside_torch_ddp(cluster, check, code, capsys):
    result = check(cluster, code, draw=False)
    out = capsys.readouterr().out
    assert "passed" in out and "torch DDP" in out
    timelines = result.timelines()
    assert set(timelines) == {"yours", "torch DDP"}
    assert timelines["yours"].buckets, "the learner's all-reduces are on the timeline"
    assert result.figure().data  # drawn with ddplab.widgets
    assert checks.passed[result.exercise] is True


@pytest.mark.parametrize("check, code", [(checks.check_average_gradients, avg_stub),
                                         (checks.check_overlap_ddp, OverlapStub),
                                         (checks.check_no_sync, acc_stub)])
def test_an_untouched_stub_is_not_implemented_yet(cluster, check, code):
    failed = failure(check, cluster, code)
    assert failed.mistake == M.NOT_IMPLEMENTED
    assert "raise NotImplementedError" in str(failed)


def test_a_learner_error_is_shown_with_the_learners_line(cluster):
    failed = failure(checks.check_average_gradients, cluster, avg_forgets_frozen)
    assert failed.mistake == M.RAISED
    assert "dist.all_reduce(p.grad)" in str(failed)  # the learner's own line, not ddplab's
    assert "frozen parameter" in str(failed)


def test_learner_drafts_get_hints_that_point_at_the_cause(cluster):
    """Mistakes met while working through the exercises as a learner."""
    text = str(failure(checks.check_average_gradients, cluster, avg_reduces_a_copy))
    assert "temporary copy" in text
    failed = failure(checks.check_bucketed_ddp, cluster, BucketsNeverReset)
    assert failed.mistake == M.NO_SYNC_AT_ALL and "in step 1" in str(failed)
    assert "not reset" in str(failed)
    assert failure(checks.check_overlap_ddp, cluster, OverlapNeverWaits).mistake == M.NEVER_WAITED
    failed = failure(checks.check_no_sync, cluster, acc_steps_every_micro_batch)
    assert "optimizer.step() ran 4 time(s)" in str(failed)


@pytest.mark.slow
def test_a_hang_is_stopped_and_says_what_it_waited_for(cluster):
    failed = failure(checks.check_average_gradients, cluster, avg_only_rank0, timeout=3)
    text = str(failed)
    assert failed.mistake == M.HUNG
    assert "rank 0 was waiting for all_reduce on the gradient of" in text
    # rank 1 reports from its own timeout, normally within the cluster's grace period; on a
    # badly loaded machine it may be broken off first, and is then listed as still running
    assert "rank 1 finished step 0" in text or "rank 1: still running" in text
    # the cluster is usable afterwards, and the solution still passes
    checks.check_average_gradients(cluster, S.my_average_gradients, draw=False)


@pytest.mark.slow
@pytest.mark.more
def test_a_python_hang_is_stopped_with_where_it_waited(cluster):
    # both ranks sit in Python, not in a collective: the job limit (2 * 1 + 10 s) stops them
    failed = failure(checks.check_average_gradients, cluster, avg_waits_forever, timeout=1)
    assert failed.mistake == M.HUNG
    assert "avg_waits_forever" in str(failed) and "Python stack" in str(failed)


@pytest.mark.slow
def test_a_failed_or_skipped_exercise_falls_back_to_ddplab(cluster, capsys):
    failure(checks.check_average_gradients, cluster, avg_no_division)
    assert checks.yours_or_ours("average_gradients", avg_no_division,
                                ddplab.average_gradients) is ddplab.average_gradients
    assert "did not pass" in capsys.readouterr().out
    checks.passed.pop("bucketed", None)
    assert checks.yours_or_ours("bucketed", BucketsWhenFull, ddplab.BucketedDDP) is ddplab.BucketedDDP


def test_bad_arguments_say_what_to_pass(cluster):
    with pytest.raises(TypeError, match="callable"):
        checks.check_average_gradients(cluster, "my_average_gradients")
    with pytest.raises(ValueError, match="micro_batches"):
        checks.check_no_sync(cluster, S.my_accumulation_step, micro_batches=1)


class OverlapWaitsInCallback(S.MyOverlapDDP):
    """Waits at the end of backward from an autograd callback, as torch DDP does (no finish method)."""
    finish_gradient_synchronization = None

    def grad_ready(self, param):
        if not self.works:
            torch.autograd.Variable._execution_engine.queue_callback(self.wait_all)
        super().grad_ready(param)

    def wait_all(self):
        for work in self.works:
            work.wait()
        self.works.clear()


# The bucketed exercise asks for the reference's layout from the first step on
# (ddplab.sync.core.BucketedDDP); the full BucketedDDP, like torch's DDP, runs its
# first step as one bucket and then rebuilds, so it is graded through the reference.
@pytest.mark.parametrize("check, code", [(checks.check_average_gradients, ddplab.average_gradients),
                                         (checks.check_overlap_ddp, ddplab.OverlapDDP),
                                         (checks.check_average_gradients, core.average_gradients),
                                         (checks.check_overlap_ddp, core.OverlapDDP),
                                         (checks.check_bucketed_ddp, core.BucketedDDP),
                                         (checks.check_overlap_ddp, OverlapWaitsInCallback)],
                         ids=["average_gradients", "OverlapDDP", "core.average_gradients",
                              "core.OverlapDDP", "core.BucketedDDP", "callback-wait"])
def test_ddplabs_own_strategies_and_a_torch_style_wait_pass(cluster, check, code):
    check(cluster, code, draw=False)
