"""Mutation catalogue, labs 05-07: DistributedSampler indices, batch statistics over ranks,
agreed step counts, a compressing comm hook. Not among the planted mistakes of
tests/checks/test_data_checks.py, tests/checks/test_checks_labs06_08.py, tests/lessons/test_compression_and_reducer.py.
"""
import itertools
import math

import torch
import torch.distributed as dist

from ddplab.checks import compression as CC
from ddplab.checks import data as DC
from ddplab.checks import hangs as HC


# -- lab 05: sampler indices -----------------------------------------------------------------------
def sampler_ok_arithmetic(n, world, rank, drop_last=False):
    per = n // world if drop_last else -(-n // world)
    return [(rank + world * k) % n for k in range(per)]


def sampler_ok_cycle(n, world, rank, drop_last=False):
    total = (n // world) * world if drop_last else math.ceil(n / world) * world
    padded = list(itertools.islice(itertools.cycle(range(n)), total))
    return padded[rank:total:world]


def sampler_ok_torch(n, world, rank, drop_last=False):
    from torch.utils.data import DistributedSampler
    return list(DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False,
                                   drop_last=drop_last))


def _sampler(n, world, rank, drop_last, *, total=None, pad=None, deal=None):
    size = total(n, world, drop_last) if total else (n // world if drop_last else -(-n // world)) * world
    idx = list(range(n))
    extra = size - n
    idx = idx[:size] if extra < 0 else idx + (pad(idx, extra) if pad else (idx * (extra // n + 1))[:extra])
    return deal(idx, world, rank) if deal else idx[rank::world]


def sampler_pads_when_dividing(n, world, rank, drop_last=False):  # always one more row
    return _sampler(n, world, rank, drop_last, total=lambda n, w, d: (n // w if d else n // w + 1) * w)


def sampler_pads_with_last(n, world, rank, drop_last=False):
    return _sampler(n, world, rank, drop_last, pad=lambda idx, k: [idx[-1]] * k)


def sampler_drop_last_rounds_up(n, world, rank, drop_last=False):
    return _sampler(n, world, rank, False)[: -(-n // world) if drop_last else None]


def sampler_pad_once(n, world, rank, drop_last=False):  # idx + idx[:extra] is short when extra > n
    return _sampler(n, world, rank, drop_last, pad=lambda idx, k: idx[:k])


def sampler_rank_plus_one(n, world, rank, drop_last=False):
    return _sampler(n, world, (rank + 1) % world, drop_last)


def sampler_reversed(n, world, rank, drop_last=False):
    return _sampler(n, world, rank, drop_last, deal=lambda idx, w, r: idx[::-1][r::w])


def sampler_blocks_ceil(n, world, rank, drop_last=False):
    return _sampler(n, world, rank, drop_last, deal=lambda idx, w, r: idx[r * len(idx) // w:(r + 1) * len(idx) // w])


def sampler_shuffled(n, world, rank, drop_last=False):
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(n, generator=g).tolist()
    return [order[i] for i in _sampler(n, world, rank, drop_last)]


def sampler_drops_tail_without_flag(n, world, rank, drop_last=False):  # drops always
    return _sampler(n, world, rank, True)


SAMPLER = {
    "check": lambda cluster, fn: DC.check_sampler_indices(fn), "world": 2,
    "correct": [sampler_ok_arithmetic, sampler_ok_cycle, sampler_ok_torch],
    "wrong": [(sampler_pads_when_dividing, DC.PAD_WHEN_DIVIDES), (sampler_pads_with_last, DC.PAD_FROM_END),
              (sampler_drop_last_rounds_up, DC.DROP_LAST_IGNORED), (sampler_pad_once, DC.NO_PADDING),
              (sampler_rank_plus_one, None), (sampler_reversed, None), (sampler_blocks_ceil, DC.BLOCKS),
              (sampler_shuffled, None), (sampler_drops_tail_without_flag, None)],
}


# -- lab 05: batch statistics ----------------------------------------------------------------------
def stats_ok_all_gather(x):
    p = dist.get_world_size()
    stats = torch.cat([x.sum(0), (x * x).sum(0), x.new_tensor([x.shape[0]])])
    everyone = [torch.empty_like(stats) for _ in range(p)]
    dist.all_gather(everyone, stats)
    total = torch.stack(everyone).sum(0)
    c = x.shape[1]
    mean = total[:c] / total[-1]
    return mean, total[c:2 * c] / total[-1] - mean.square()


def stats_ok_parallel_variance(x):  # Chan et al.: merge (count, mean, M2) of every rank
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (x.shape[0], x.mean(0).cpu(), x.var(0, unbiased=False).cpu() * x.shape[0]))
    n, mean, m2 = parts[0]
    for nb, mb, m2b in parts[1:]:
        delta = mb - mean
        mean = mean + delta * nb / (n + nb)
        m2 = m2 + m2b + delta * delta * n * nb / (n + nb)
        n += nb
    return mean.to(x.device), (m2 / n).to(x.device)


def stats_ok_separate_reduces(x):
    s, ss = x.sum(dim=0), x.pow(2).sum(dim=0)
    count = torch.tensor(len(x), dtype=torch.int64)
    for t in (s, ss, count):
        dist.all_reduce(t)
    mean = s / count
    return mean, ss / count - mean * mean


def _sums(x, count=None):
    packed = torch.cat([x.sum(0), (x * x).sum(0)])
    dist.all_reduce(packed)
    c = x.shape[1]
    n = count if count is not None else _count(x)
    mean = packed[:c] / n
    return mean, packed[c:] / n - mean * mean


def _count(x):
    n = torch.tensor([float(len(x))], dtype=x.dtype)
    dist.all_reduce(n)
    return n


def stats_keepdim(x):
    mean, var = _sums(x)
    return mean.unsqueeze(0), var.unsqueeze(0)  # shape (1, C), as x.mean(0, keepdim=True) gives


def stats_count_local_times_world(x):
    return _sums(x, count=len(x) * dist.get_world_size())


def stats_divides_by_local_count(x):
    return _sums(x, count=len(x))


def stats_std_not_var(x):
    mean, var = _sums(x)
    return mean, var.sqrt()


def stats_swapped(x):
    mean, var = _sums(x)
    return var, mean


def stats_in_float32(x):
    mean, var = _sums(x.float())
    return mean, var


def stats_var_around_local_mean(x):
    mean, _ = _sums(x)
    sq = ((x - x.mean(0)) ** 2).sum(0)
    dist.all_reduce(sq)
    return mean, sq / _count(x)


def stats_never_written(x):  # the all-reduced sums land in a temporary
    c = x.shape[1]
    packed = torch.cat([x.sum(0), (x * x).sum(0), x.new_tensor([len(x)])])
    dist.all_reduce(packed.clone())
    mean = packed[:c] / packed[-1]
    return mean, packed[c:2 * c] / packed[-1] - mean * mean


def stats_all_reduce_max_count(x):
    n = torch.tensor([float(len(x))], dtype=x.dtype)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return _sums(x, count=n)


BATCH_STATS = {
    "check": lambda cluster, fn: DC.check_batch_stats(cluster, fn), "world": 2,
    "correct": [stats_ok_all_gather, stats_ok_parallel_variance, stats_ok_separate_reduces],
    "wrong": [(stats_keepdim, DC.KEEPDIM), (stats_count_local_times_world, DC.COUNT_LOCAL_TIMES_WORLD),
              (stats_divides_by_local_count, None), (stats_std_not_var, None), (stats_swapped, None),
              (stats_in_float32, None), (stats_var_around_local_mean, DC.MEAN_OF_VARS),
              (stats_never_written, DC.LOCAL_STATS), (stats_all_reduce_max_count, None)],
}


# -- lab 06: agreed step count ---------------------------------------------------------------------
def steps_ok_negated_max(n):
    t = torch.tensor(-n)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return -t.item()


def steps_ok_all_gather_tensor(n):
    mine = torch.tensor([n], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return int(torch.cat(everyone).min())


def steps_ok_float_min(n):
    t = torch.tensor([float(n)])
    dist.all_reduce(t, dist.ReduceOp.MIN)
    return t  # a one-element tensor holding a whole number


def _reduce(n, op):
    t = torch.tensor([n])
    dist.all_reduce(t, op=op)
    return int(t)


def steps_broadcast(n):  # rank 0's count, not the minimum
    t = torch.tensor([n])
    dist.broadcast(t, src=0)
    return int(t)


def steps_min_minus_one(n):
    return _reduce(n, dist.ReduceOp.MIN) - 1


def steps_product(n):
    return _reduce(n, dist.ReduceOp.PRODUCT)


def steps_mean_rounded(n):
    return round(_reduce(n, dist.ReduceOp.SUM) / dist.get_world_size())


def steps_hard_coded(n):
    return 5


def steps_barrier_then_own(n):
    dist.barrier()
    return n


def steps_returns_list(n):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, n)
    return everyone


def steps_min_of_float_half(n):  # divides the count by two "to be safe"
    return _reduce(n, dist.ReduceOp.MIN) / 2


def steps_reduce_to_rank0(n):
    t = torch.tensor([n])
    dist.reduce(t, dst=0, op=dist.ReduceOp.MIN)
    return int(t)


AGREED = {
    "check": lambda cluster, fn: HC.check_agreed_steps(cluster, fn, train=False), "world": 2,
    "correct": [steps_ok_negated_max, steps_ok_all_gather_tensor, steps_ok_float_min],
    "wrong": [(steps_broadcast, HC.BROADCAST), (steps_min_minus_one, HC.NOT_MIN), (steps_product, None),
              (steps_mean_rounded, HC.NOT_MIN), (steps_hard_coded, None), (steps_barrier_then_own, HC.OWN_COUNT),
              (steps_returns_list, HC.NOT_A_NUMBER), (steps_min_of_float_half, None),
              (steps_reduce_to_rank0, None)],
}


# -- lab 07: comm hook ---------------------------------------------------------------------------
def hook_ok_half_then_new_tensor(state, bucket):
    w = dist.get_world_size()
    small = bucket.buffer().half() / w
    return dist.all_reduce(small, async_op=True).get_future().then(
        lambda fut: fut.value()[0].to(torch.float32))


def hook_ok_bf16_in_place(state, bucket):
    buf = bucket.buffer()
    small = buf.to(dtype=torch.bfloat16)
    small.mul_(1.0 / dist.get_world_size())
    fut = dist.all_reduce(small, async_op=True).get_future()

    def back(f):
        return buf.copy_(f.wait()[0])
    return fut.then(back)


def hook_ok_group_from_state(state, bucket):
    group = state if state is not None else dist.group.WORLD
    world = group.size()
    buf = bucket.buffer()
    small = buf.to(torch.float16).div_(world)
    work = dist.all_reduce(small, group=group, async_op=True)
    return work.get_future().then(lambda f: buf.copy_(f.value()[0]))


_bound_all_reduce = dist.all_reduce  # bound when the solution was written, before any grader ran


def hook_ok_imported_name(state, bucket):  # a patched dist.all_reduce would never see this call
    buf = bucket.buffer()
    small = buf.to(torch.float16).div_(dist.get_world_size())
    return _bound_all_reduce(small, async_op=True).get_future().then(
        lambda f: buf.copy_(f.value()[0]))


def _done(value):
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def hook_blocking_in_done_future(state, bucket):  # not async: all-reduce, then a finished future
    buf = bucket.buffer()
    small = buf.to(torch.float16).div_(dist.get_world_size())
    dist.all_reduce(small)
    return _done(buf.copy_(small))


def hook_waits_inside(state, bucket):
    buf = bucket.buffer()
    small = buf.to(torch.float16).div_(dist.get_world_size())
    dist.all_reduce(small, async_op=True).wait()
    return _done(buf.copy_(small))


def _hook(state, bucket, *, dtype=torch.float16, divide=None, op=None, back=None, part=None):
    buf = bucket.buffer()
    small = (buf[:part(buf)] if part else buf).to(dtype)
    small.div_(divide if divide is not None else dist.get_world_size())
    kw = {"op": op} if op is not None else {}
    fut = dist.all_reduce(small, async_op=True, **kw).get_future()
    return fut.then(back or (lambda f: buf.copy_(f.value()[0]) if not part else buf))


def hook_divides_by_world_minus_one(state, bucket):
    return _hook(state, bucket, divide=max(1, dist.get_world_size() - 1) * 1.5)


def hook_max(state, bucket):
    return _hook(state, bucket, op=dist.ReduceOp.MAX)


def hook_half_the_bucket(state, bucket):
    return _hook(state, bucket, part=lambda b: b.numel() // 2)


def hook_value_one_short(state, bucket):
    return _hook(state, bucket, back=lambda f: f.value()[0][:-1].float())


def hook_int8(state, bucket):  # "compressed" to whole numbers
    return _hook(state, bucket, dtype=torch.int8, divide=1)


def hook_no_all_reduce(state, bucket):
    return _done(bucket.buffer().div_(dist.get_world_size()))


def hook_broadcast(state, bucket):
    small = bucket.buffer().half()
    buf = bucket.buffer()
    fut = dist.broadcast(small, src=0, async_op=True).get_future()
    return fut.then(lambda f: buf.copy_(f.value()[0]))


COMM_HOOK = {
    "check": lambda cluster, fn: CC.check_comm_hook(cluster, fn), "world": 2,
    "correct": [hook_ok_half_then_new_tensor, hook_ok_bf16_in_place, hook_ok_group_from_state,
                hook_ok_imported_name],
    "wrong": [(hook_blocking_in_done_future, CC.NOT_ASYNC), (hook_waits_inside, CC.NOT_ASYNC),
              (hook_divides_by_world_minus_one, None), (hook_max, None), (hook_half_the_bucket, None),
              (hook_value_one_short, CC.WRONG_SHAPE), (hook_int8, None), (hook_no_all_reduce, CC.NOT_REDUCED),
              (hook_broadcast, None)],
}
