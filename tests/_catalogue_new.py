"""Mutation catalogue, lab 00's send/recv warm-up and lab 09's bucket prediction.
Not among tests/checks/test_checks_labs00_09.py's planted solutions.
"""
import torch
import torch.distributed as dist

from ddplab.checks import firstgroup as W
from ddplab.checks import reducer_map as B
from ddplab.checks import ring as RC


# -- lab 00: warm-up, correct ------------------------------------------------------------------------
def pass_ok_both_async(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = t.new_empty(t.shape)
    works = [dist.irecv(buf, src=(rank - 1) % p), dist.isend(t, dst=(rank + 1) % p)]
    for w in works:
        w.wait()
    return buf


def pass_ok_rank0_receives_first(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros_like(t)
    if rank == 0:
        dist.recv(buf, (rank - 1) % p)
        dist.send(t, (rank + 1) % p)
    else:
        dist.send(t, (rank + 1) % p)
        dist.recv(buf, (rank - 1) % p)
    return buf


def pass_ok_clone(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    mine = t.clone()
    req = dist.isend(mine, (rank + 1) % p)
    incoming = torch.empty(t.numel(), dtype=t.dtype)
    dist.recv(incoming, (rank - 1) % p)
    req.wait()
    return incoming.view_as(t)


# -- lab 00: warm-up, wrong --------------------------------------------------------------------------
def _pass(t, *, buf=None, wait_send=True, wait_recv=True, src=-1, ret=None):
    rank, p = dist.get_rank(), dist.get_world_size()
    b = buf(t) if buf else torch.empty_like(t)
    req = dist.isend(t, (rank + 1) % p)
    got = dist.irecv(b, (rank + src) % p)
    if wait_recv:
        got.wait()
    if wait_send:
        req.wait()
    return ret(t, b) if ret else b


def pass_isend_never_waited(t):
    return _pass(t, wait_send=False)


def pass_irecv_never_waited(t):
    return _pass(t, wait_recv=False)


def pass_returns_own(t):
    return _pass(t, ret=lambda t, b: t)


def pass_buffer_short(t):
    return _pass(t, buf=lambda t: torch.empty(t.numel() - 1, dtype=t.dtype))


def pass_all_gather(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    everyone = [torch.empty_like(t) for _ in range(p)]
    dist.all_gather(everyone, t)
    return everyone[(rank - 1) % p]


def pass_sends_twice(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    dist.isend(t, (rank + 1) % p).wait()
    return _pass(t)


def pass_recv_from_right(t):  # sends right AND receives from the right
    return _pass(t, src=1)


def pass_returns_sum(t):
    return _pass(t, ret=lambda t, b: b.sum())


def pass_everyone_recv_first(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    dist.recv(buf, (rank - 1) % p)
    dist.send(t, (rank + 1) % p)
    return buf


WARM_UP = {
    "check": lambda cluster, fn: W.check_pass_right(cluster, fn), "world": 3,
    "correct": [pass_ok_both_async, pass_ok_rank0_receives_first, pass_ok_clone],
    "wrong": [(pass_returns_own, W.WRONG_VALUES), (pass_isend_never_waited, RC.MISSING_WAIT),
              (pass_irecv_never_waited, RC.MISSING_WAIT), (pass_buffer_short, W.SIZE),
              (pass_all_gather, RC.COLLECTIVE), (pass_sends_twice, None), (pass_recv_from_right, None),
              (pass_returns_sum, W.NOTHING_RETURNED), (pass_everyone_recv_first, RC.UNPAIRED)],
}


# -- lab 00: warm-up judged for NCCL (backend="nccl", as the lab asks): only a batched pair --------
def pass_ok_batched(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, (rank + 1) % p),
                                        dist.P2POp(dist.irecv, buf, (rank - 1) % p)]):
        work.wait()
    return buf


def pass_ok_batched_imported_recv_first(t):
    from torch.distributed import P2POp, batch_isend_irecv, irecv, isend

    rank, p = dist.get_rank(), dist.get_world_size()
    buf = t.new_zeros(t.shape)
    reqs = batch_isend_irecv([P2POp(irecv, buf, (rank - 1) % p), P2POp(isend, t.clone(), (rank + 1) % p)])
    [r.wait() for r in reqs]
    return buf


def pass_ok_batched_with_group(t):
    from torch.distributed import distributed_c10d as c10d

    group = c10d._get_default_group()
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    incoming = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, incoming, (rank - 1) % p, group),
                                    dist.P2POp(dist.isend, t.contiguous(), (rank + 1) % p, group)])
    for w in works:
        w.wait()
    return incoming.view_as(t)


def pass_batched_never_waited(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    dist.batch_isend_irecv([dist.P2POp(dist.isend, t, (rank + 1) % p),
                            dist.P2POp(dist.irecv, buf, (rank - 1) % p)])
    return buf


WARM_UP_NCCL = {
    "check": lambda cluster, fn: W.check_pass_right(cluster, fn, backend="nccl"), "world": 3,
    "correct": [pass_ok_batched, pass_ok_batched_imported_recv_first, pass_ok_batched_with_group],
    "wrong": [(pass_ok_both_async, RC.UNBATCHED), (pass_ok_clone, RC.UNBATCHED),
              (pass_ok_rank0_receives_first, RC.UNGROUPED), (pass_batched_never_waited, RC.MISSING_WAIT),
              (pass_returns_own, RC.UNBATCHED), (pass_all_gather, RC.COLLECTIVE),
              (pass_everyone_recv_first, RC.UNPAIRED), (pass_isend_never_waited, RC.MISSING_WAIT)],
}


# -- lab 09: bucket assignment, correct --------------------------------------------------------------
def _limits(cap):
    mib = 2 ** 20
    return [mib, 25 * mib] if cap is None else [cap * mib]


def _ready(params, ready_order):
    return range(len(params) - 1, -1, -1) if ready_order is None else ready_order


def buckets_ok_lists(params, bucket_cap_mb=None, ready_order=None):
    limits = _limits(bucket_cap_mb)
    done, open_ = [], {}
    for i in _ready(params, ready_order):
        p = params[i]
        state = open_.setdefault(p.dtype, {"idx": [], "bytes": 0, "k": 0})
        state["idx"].append(i)
        state["bytes"] += p.numel() * p.element_size()
        if state["bytes"] >= limits[state["k"]]:
            done.append(state["idx"])
            open_[p.dtype] = {"idx": [], "bytes": 0, "k": min(state["k"] + 1, len(limits) - 1)}
    return done + [s["idx"] for s in open_.values() if s["idx"]]


def buckets_ok_generator(params, bucket_cap_mb=None, ready_order=None):
    def walk():
        limits = _limits(bucket_cap_mb)
        current = {}
        for i in list(_ready(params, ready_order)):
            key = params[i].dtype
            idx, size, k = current.pop(key, ([], 0, 0))
            idx = idx + [i]
            size += params[i].nelement() * params[i].element_size()
            if size >= limits[k]:
                yield idx
                current[key] = ([], 0, min(k + 1, len(limits) - 1))
            else:
                current[key] = (idx, size, k)
        yield from (idx for idx, _, _ in current.values() if idx)  # still open: any order
    return list(walk())


def buckets_ok_torch_helper(params, bucket_cap_mb=None, ready_order=None):
    order = list(_ready(params, ready_order))
    limits = [int(x) for x in _limits(bucket_cap_mb)]
    buckets, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order], limits,
                                                         [False] * len(order), order)
    return [[int(i) for i in b] for b in buckets]


# -- lab 09: bucket assignment, wrong ----------------------------------------------------------------
def _rule(params, cap, ready_order=None, *, close_at=lambda size, limit: size >= limit,
          limits=None, tail=True, post=None):
    limits = limits or _limits(cap)
    done, open_ = [], {}
    for i in _ready(params, ready_order):
        p = params[i]
        idx, size, k = open_.get(p.dtype, ([], 0, 0))
        idx, size = idx + [i], size + p.numel() * p.element_size()
        if close_at(size, limits[k]):
            done.append(idx)
            idx, size, k = [], 0, min(k + 1, len(limits) - 1)
        open_[p.dtype] = (idx, size, k)
    out = done + ([idx for idx, _, _ in open_.values() if idx] if tail else [])
    return post(out) if post else out


def buckets_strictly_over(params, bucket_cap_mb=None, ready_order=None):  # > instead of >=
    return _rule(params, bucket_cap_mb, ready_order, close_at=lambda size, limit: size > limit)


def buckets_forget_open_tail(params, bucket_cap_mb=None, ready_order=None):
    return _rule(params, bucket_cap_mb, ready_order, tail=False)


def buckets_last_first(params, bucket_cap_mb=None, ready_order=None):
    return _rule(params, bucket_cap_mb, ready_order, post=lambda out: out[::-1])


def buckets_sorted_inside(params, bucket_cap_mb=None, ready_order=None):
    return _rule(params, bucket_cap_mb, ready_order, post=lambda out: [sorted(b) for b in out])


def buckets_cap_ignored(params, bucket_cap_mb=None, ready_order=None):
    return _rule(params, None, ready_order)


def buckets_param_objects(params, bucket_cap_mb=None, ready_order=None):
    return _rule(params, bucket_cap_mb, ready_order, post=lambda out: [[params[i] for i in b] for b in out])


def buckets_none_cap_crashes(params, bucket_cap_mb=None, ready_order=None):
    return _rule(params, bucket_cap_mb, ready_order, limits=[bucket_cap_mb * 2 ** 20])


def buckets_cap_in_kib(params, bucket_cap_mb=None, ready_order=None):
    return _rule(params, bucket_cap_mb, ready_order, limits=[x / 1024 * 1000 for x in _limits(bucket_cap_mb)])


def buckets_one_bucket(params, bucket_cap_mb=None, ready_order=None):
    return [list(reversed(range(len(params))))]


def buckets_ok_tail_reversed(params, bucket_cap_mb=None, ready_order=None):
    # the buckets still open at the end in another order: torch's is its hash map's
    limits = _limits(bucket_cap_mb)
    closed, open_ = [], {}
    for i in _ready(params, ready_order):
        idx, size, k = open_.pop(params[i].dtype, ([], 0, 0))
        idx, size = idx + [i], size + params[i].numel() * params[i].element_size()
        if size >= limits[k]:
            closed.append(idx)
            idx, size, k = [], 0, min(k + 1, len(limits) - 1)
        open_[params[i].dtype] = (idx, size, k)
    return closed + [idx for idx, _, _ in reversed(open_.values()) if idx]


def buckets_ready_order_ignored(params, bucket_cap_mb=None, ready_order=None):
    return _rule(params, bucket_cap_mb, None)


def buckets_two_args(params, bucket_cap_mb=None):  # the signature before ready_order
    return _rule(params, bucket_cap_mb)


BUCKET_ASSIGNMENT = {
    "check": lambda cluster, fn: B.check_bucket_assignment(cluster, fn), "world": 2,
    "correct": [buckets_ok_lists, buckets_ok_generator, buckets_ok_torch_helper,
                buckets_ok_tail_reversed],
    "wrong": [(buckets_forget_open_tail, None), (buckets_strictly_over, None), (buckets_last_first, None),
              (buckets_sorted_inside, None), (buckets_cap_ignored, None),
              (buckets_param_objects, B.NOT_BUCKETS), (buckets_none_cap_crashes, None),
              (buckets_cap_in_kib, None), (buckets_one_bucket, None),
              (buckets_ready_order_ignored, B.READY_ORDER_IGNORED), (buckets_two_args, B.NO_READY_ORDER)],
}
