"""Mutation catalogue, gradient synchronization: lab 02 (average_gradients, OverlapDDP) and lab 03
(BucketedDDP, no_sync accumulation). Not among tests/checks/test_checks.py's planted mistakes.
"""
import contextlib

import _exercise_solutions as S
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddplab import checks
from ddplab.checks import mistakes as M


def _off(cluster, fn, check):
    return check(cluster, fn, draw=False)


# -- lab 02: average_gradients --------------------------------------------------------------------
def avg_ok_divide_first(model):
    w = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(w)
            dist.all_reduce(p.grad)


def avg_ok_flat(model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def avg_ok_async_then_wait(model):
    works = [(p, dist.all_reduce(p.grad, async_op=True)) for p in model.parameters() if p.requires_grad]
    for p, work in works:
        work.wait()
        p.grad.mul_(1.0 / dist.get_world_size())


def _each_grad(model, fn):
    for p in model.parameters():
        if p.grad is not None:
            fn(p)


def avg_by_world_minus_one(model):
    _each_grad(model, lambda p: (dist.all_reduce(p.grad), p.grad.div_(dist.get_world_size() - 1)))


def avg_never_waited(model):  # async, no wait()
    _each_grad(model, lambda p: (dist.all_reduce(p.grad, async_op=True), p.grad.div_(dist.get_world_size())))


def avg_flat_never_copied_back(model):
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()


def avg_only_first_parameter(model):
    p = next(p for p in model.parameters() if p.grad is not None)
    dist.all_reduce(p.grad)
    p.grad /= dist.get_world_size()


def avg_max(model):
    _each_grad(model, lambda p: dist.all_reduce(p.grad, op=dist.ReduceOp.MAX))


def avg_broadcast(model):  # rank 0's gradient everywhere
    _each_grad(model, lambda p: dist.broadcast(p.grad, src=0))


def avg_reduce_to_rank0(model):
    _each_grad(model, lambda p: (dist.reduce(p.grad, dst=0), p.grad.div_(dist.get_world_size())))


def avg_in_float32(model):
    def one(p):
        g = p.grad.float()
        dist.all_reduce(g)
        p.grad.copy_(g / dist.get_world_size())
    _each_grad(model, one)


def avg_zeroes_grads(model):
    S.my_average_gradients(model)
    model.zero_grad()


AVERAGE = {
    "check": lambda c, fn: _off(c, fn, checks.check_average_gradients), "world": 2,
    "correct": [avg_ok_divide_first, avg_ok_flat, avg_ok_async_then_wait],
    "wrong": [(avg_by_world_minus_one, None), (avg_never_waited, M.NEVER_WAITED),
              (avg_flat_never_copied_back, M.NO_SYNC_AT_ALL), (avg_only_first_parameter, None),
              (avg_max, None), (avg_broadcast, None), (avg_reduce_to_rank0, None), (avg_in_float32, None),
              (avg_zeroes_grads, None)],
}


# -- lab 02: OverlapDDP ----------------------------------------------------------------------------
class OverlapOkDivideAfterWait(S.MyOverlapDDP):
    def grad_ready(self, param):
        self.works.append((param, dist.all_reduce(param.grad, async_op=True)))

    def finish_gradient_synchronization(self):
        for param, work in self.works:
            work.wait()
            param.grad /= self.world_size
        self.works.clear()


class OverlapOkCallback(torch.nn.Module):  # waits from a callback queued at the end of backward
    def __init__(self, module):
        super().__init__()
        self.module, self.pending, self.queued = module, [], False
        with torch.no_grad():
            for t in list(module.parameters()):
                dist.broadcast(t, 0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        p.grad.div_(dist.get_world_size())
        self.pending.append(dist.all_reduce(p.grad, async_op=True))
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._drain)

    def _drain(self):
        while self.pending:
            self.pending.pop().wait()
        self.queued = False

    def forward(self, x):
        return self.module(x)


class OverlapOkFutures(S.MyOverlapDDP):
    def grad_ready(self, param):
        param.grad.div_(self.world_size)
        self.works.append(dist.all_reduce(param.grad, async_op=True).get_future())

    def finish_gradient_synchronization(self):
        torch.futures.wait_all(self.works)
        self.works.clear()


class OverlapBroadcastFromRank1(S.MyOverlapDDP):
    def __init__(self, module):
        for p in module.parameters():
            dist.broadcast(p.data, src=1)
        torch.nn.Module.__init__(self)
        self.module, self.world_size, self.works = module, dist.get_world_size(), []
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.grad_ready)


def _overlap_init(self, module, params, broadcast):
    torch.nn.Module.__init__(self)
    self.module, self.world_size, self.works = module, dist.get_world_size(), []
    for p in broadcast:
        dist.broadcast(p.data, src=0)
    for p in params:
        p.register_post_accumulate_grad_hook(self.grad_ready)


class OverlapTrainableOnlyBroadcast(S.MyOverlapDDP):  # the frozen layer keeps each rank's weights
    def __init__(self, module):
        trainable = [p for p in module.parameters() if p.requires_grad]
        _overlap_init(self, module, trainable, trainable)


class OverlapOnlyUpLayer(S.MyOverlapDDP):  # hooks on one layer only
    def __init__(self, module):
        _overlap_init(self, module, list(module.up.parameters()), list(module.parameters()))


class OverlapTiedTwice(S.MyOverlapDDP):  # the tied weight hooked twice (remove_duplicate=False)
    def __init__(self, module):
        params = [p for _, p in module.named_parameters(remove_duplicate=False) if p.requires_grad]
        _overlap_init(self, module, params, list(module.parameters()))


class OverlapWaitsLastOnly(S.MyOverlapDDP):
    def finish_gradient_synchronization(self):
        self.works[-1].wait()
        self.works.clear()


class OverlapReducesACopy(S.MyOverlapDDP):
    def grad_ready(self, param):
        self.works.append(dist.all_reduce(param.grad.clone() / self.world_size, async_op=True))


class OverlapMax(S.MyOverlapDDP):
    def grad_ready(self, param):
        self.works.append(dist.all_reduce(param.grad, op=dist.ReduceOp.MAX, async_op=True))


class OverlapForwardReturnsNone(S.MyOverlapDDP):
    def forward(self, *args, **kwargs):
        self.module(*args, **kwargs)


class OverlapZeroesInFinish(S.MyOverlapDDP):
    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()
        self.module.zero_grad()


OVERLAP = {
    "check": lambda c, fn: _off(c, fn, checks.check_overlap_ddp), "world": 2,
    "correct": [OverlapOkDivideAfterWait, OverlapOkCallback, OverlapOkFutures],
    "wrong": [(OverlapBroadcastFromRank1, M.NO_BROADCAST), (OverlapTrainableOnlyBroadcast, M.NO_BROADCAST),
              (OverlapOnlyUpLayer, None), (OverlapTiedTwice, M.REDUCED_TWICE), (OverlapWaitsLastOnly, M.NEVER_WAITED),
              (OverlapReducesACopy, M.NO_SYNC_AT_ALL), (OverlapMax, None), (OverlapForwardReturnsNone, M.RAISED),
              (OverlapZeroesInFinish, None)],
}


# -- lab 03: BucketedDDP ---------------------------------------------------------------------------
class BucketsOkFlattenHelpers(S.MyBucketedDDP):
    def finish_gradient_synchronization(self):
        for bucket, flat, work in self.in_flight:
            work.wait()
            for p, g in zip(bucket, _unflatten_dense_tensors(flat, [p.grad for p in bucket])):
                p.grad.copy_(g)
        self.in_flight.clear()
        self.ready = [0] * len(self.buckets)
        self.next_bucket = 0


def _own_layout(params, cap_mb):
    """The rule written out, as torch's: reverse order; add a tensor, then close the bucket
    once it has reached the cap."""
    cap, out, cur, size = cap_mb * 2 ** 20, [], [], 0
    for i in reversed(range(len(params))):
        cur.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= cap:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


class BucketsOkOwnLayout(S.MyBucketedDDP):
    def __init__(self, module, bucket_cap_mb):
        torch.nn.Module.__init__(self)
        self.module, self.world_size = module, dist.get_world_size()
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = [[params[i] for i in b] for b in _own_layout(params, bucket_cap_mb)]
        self.bucket_of = {p: k for k, b in enumerate(self.buckets) for p in b}
        self.ready, self.next_bucket, self.in_flight = [0] * len(self.buckets), 0, []
        for p in params:
            p.register_post_accumulate_grad_hook(self.grad_ready)


class BucketsOkDivideAfter(S.MyBucketedDDP):
    def grad_ready(self, param):
        self.ready[self.bucket_of[param]] += 1
        while self.next_bucket < len(self.buckets) and \
                self.ready[self.next_bucket] == len(self.buckets[self.next_bucket]):
            bucket = self.buckets[self.next_bucket]
            flat = torch.cat([p.grad.flatten() for p in bucket])
            self.in_flight.append((bucket, flat, dist.all_reduce(flat, async_op=True)))
            self.next_bucket += 1

    def finish_gradient_synchronization(self):
        for _, flat, work in self.in_flight:
            work.wait()
            flat /= self.world_size
        S.MyBucketedDDP.finish_gradient_synchronization(self)  # waits again (done) and copies back


class _BucketsLayout(S.MyBucketedDDP):
    layout = None

    def __init__(self, module, bucket_cap_mb):
        super().__init__(module, bucket_cap_mb)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = [[params[i] for i in b] for b in type(self).layout(params, bucket_cap_mb)]
        self.bucket_of = {p: k for k, b in enumerate(self.buckets) for p in b}
        self.ready = [0] * len(self.buckets)


class BucketsForwardOrder(_BucketsLayout):  # parameters() order, not reversed
    layout = staticmethod(lambda ps, cap: [[len(ps) - 1 - i for i in b] for b in _own_layout(ps[::-1], cap)])


class BucketsOneBucket(_BucketsLayout):
    layout = staticmethod(lambda ps, cap: [list(reversed(range(len(ps))))])


class BucketsOnePerParameter(_BucketsLayout):
    layout = staticmethod(lambda ps, cap: [[i] for i in reversed(range(len(ps)))])


class BucketsNeverCopiedBack(S.MyBucketedDDP):
    def finish_gradient_synchronization(self):
        for _, _, work in self.in_flight:
            work.wait()
        self.in_flight.clear()
        self.ready, self.next_bucket = [0] * len(self.buckets), 0


class BucketsNoDivision(S.MyBucketedDDP):
    def __init__(self, module, bucket_cap_mb):
        super().__init__(module, bucket_cap_mb)
        self.world_size = 1


class BucketsNoBroadcast(S.MyBucketedDDP):
    def __init__(self, module, bucket_cap_mb):
        saved = [p.detach().clone() for p in module.parameters()]
        super().__init__(module, bucket_cap_mb)
        with torch.no_grad():
            for p, s in zip(module.parameters(), saved):
                p.copy_(s)


class BucketsCopyBackReversed(S.MyBucketedDDP):  # the flat buffer read back to front
    def finish_gradient_synchronization(self):
        for i, (bucket, flat, work) in enumerate(self.in_flight):
            work.wait()
            self.in_flight[i] = (bucket, flat.flip(0), _Done())
        S.MyBucketedDDP.finish_gradient_synchronization(self)


class BucketsWaitsFirstOnly(S.MyBucketedDDP):
    def finish_gradient_synchronization(self):
        self.in_flight = self.in_flight[:1] + [(b, f, _Done()) for b, f, _ in self.in_flight[1:]]
        S.MyBucketedDDP.finish_gradient_synchronization(self)


class _Done:
    def wait(self):
        return True


BUCKETED = {
    "check": lambda c, fn: _off(c, fn, checks.check_bucketed_ddp), "world": 2,
    "correct": [BucketsOkFlattenHelpers, BucketsOkOwnLayout, BucketsOkDivideAfter],
    "wrong": [(BucketsForwardOrder, None), (BucketsOneBucket, M.BAD_LAYOUT),
              (BucketsOnePerParameter, M.BAD_LAYOUT), (BucketsNeverCopiedBack, M.NO_SYNC_AT_ALL),
              (BucketsNoDivision, M.NO_DIVISION), (BucketsNoBroadcast, M.NO_BROADCAST),
              (BucketsCopyBackReversed, None), (BucketsWaitsFirstOnly, M.NEVER_WAITED)],
}


# -- lab 03: no_sync accumulation ------------------------------------------------------------------
def acc_ok_exitstack(model, optimizer, micro_batches):
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.ExitStack() as stack:
            if i < n - 1:
                stack.enter_context(model.no_sync())
            (checks.loss_fn(model(x), y) * (1.0 / n)).backward()
    optimizer.step()


def acc_ok_block(model, optimizer, micro_batches):
    *early, (x_last, y_last) = micro_batches
    n = len(micro_batches)
    with model.no_sync():
        for x, y in early:
            checks.loss_fn(model(x), y).div(n).backward()
    checks.loss_fn(model(x_last), y_last).div(n).backward()
    optimizer.step()


def acc_ok_scaled_grads(model, optimizer, micro_batches):
    # accumulate the SUM, then scale the (already averaged over ranks) gradients once
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        ctx = model.no_sync() if i + 1 < n else contextlib.nullcontext()
        with ctx:
            checks.loss_fn(model(x), y).backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= n
    optimizer.step()


def _acc(model, optimizer, micro_batches, *, divide=None, zero_each=False, steps=1, sync_first=False,
         only_last=False):
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        if only_last and i < n - 1:
            continue
        quiet = (i > 0) if sync_first else (i < n - 1)
        with (model.no_sync() if quiet else contextlib.nullcontext()):
            if zero_each:
                optimizer.zero_grad()
            (checks.loss_fn(model(x), y) / (divide if divide is not None else n)).backward()
    for _ in range(steps):
        optimizer.step()


def acc_divides_by_world(model, optimizer, micro_batches):
    _acc(model, optimizer, micro_batches, divide=dist.get_world_size())


def acc_divides_twice(model, optimizer, micro_batches):
    _acc(model, optimizer, micro_batches, divide=len(micro_batches) ** 2)


def acc_zero_grad_each(model, optimizer, micro_batches):
    _acc(model, optimizer, micro_batches, zero_each=True)


def acc_only_last(model, optimizer, micro_batches):
    _acc(model, optimizer, micro_batches, only_last=True)


def acc_never_steps(model, optimizer, micro_batches):
    _acc(model, optimizer, micro_batches, steps=0)


def acc_steps_twice(model, optimizer, micro_batches):
    _acc(model, optimizer, micro_batches, steps=2)


def acc_syncs_first_not_last(model, optimizer, micro_batches):
    _acc(model, optimizer, micro_batches, sync_first=True)


def acc_one_backward_of_everything(model, optimizer, micro_batches):  # no accumulation at all
    loss = sum(checks.loss_fn(model(x), y) for x, y in micro_batches) / len(micro_batches)
    loss.backward()
    optimizer.step()


NO_SYNC = {
    "check": lambda c, fn: _off(c, fn, checks.check_no_sync), "world": 2,
    "correct": [acc_ok_exitstack, acc_ok_block, acc_ok_scaled_grads],
    "wrong": [(acc_divides_by_world, None), (acc_divides_twice, None), (acc_zero_grad_each, None),
              (acc_only_last, None), (acc_never_steps, None), (acc_steps_twice, None),
              (acc_syncs_first_not_last, M.REDUCED_IN_NO_SYNC), (acc_one_backward_of_everything, None)],
}
