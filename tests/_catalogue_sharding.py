"""Mutation catalogue, lab 11's exercise: the sharded optimizer's step.

Correct solutions written three ways, and wrong ones: each slip the grader
(ddplab/checks/sharding.py) names. A broadcast only the owner makes (a hang)
is planted in tests/checks/test_checks_sharding.py, on ranks with a short
collective timeout.
"""
import torch.distributed as dist

from ddplab.checks import sharding as S


# -- correct -------------------------------------------------------------------------------
def per_param(local, params, owner):
    local.step()
    for p in params:
        dist.broadcast(p.data, src=owner[p])


def async_waited(local, params, owner):
    local.step()
    works = [dist.broadcast(p.data, src=owner[p], async_op=True) for p in params]
    for w in works:
        w.wait()


def by_rank(local, params, owner):
    local.step()
    for r in range(dist.get_world_size()):
        for p in params:
            if owner[p] == r:
                dist.broadcast(p.detach(), src=r)


# -- wrong ---------------------------------------------------------------------------------
def no_broadcast(local, params, owner):
    local.step()


def broadcast_first(local, params, owner):
    for p in params:
        dist.broadcast(p.data, src=owner[p])
    local.step()


def broadcast_gradients(local, params, owner):
    local.step()
    for p in params:
        dist.broadcast(p.grad, src=owner[p])


def broadcast_a_copy(local, params, owner):
    local.step()
    for p in params:
        dist.broadcast(p.detach().clone(), src=owner[p])


def from_rank0(local, params, owner):
    local.step()
    for p in params:
        dist.broadcast(p.data, src=0)


def no_step(local, params, owner):
    for p in params:
        dist.broadcast(p.data, src=owner[p])


def twice(local, params, owner):
    local.step()
    for p in params:
        dist.broadcast(p.data, src=owner[p])
        dist.broadcast(p.data, src=owner[p])


def all_reduced(local, params, owner):
    local.step()
    for p in params:
        dist.all_reduce(p.data)


def not_written(local, params, owner):
    raise NotImplementedError


SHARDED_STEP = {
    "check": lambda cluster, fn: S.check_sharded_step(cluster, fn), "world": 2,
    "correct": [per_param, async_waited, by_rank],
    "wrong": [(no_broadcast, S.NO_BROADCAST), (broadcast_first, S.NOT_RECEIVED),
              (broadcast_gradients, S.NOT_RECEIVED), (broadcast_a_copy, S.NOT_RECEIVED),
              (from_rank0, S.WRONG_SOURCE), (no_step, S.NO_STEP), (twice, S.WRONG_BYTES),
              (all_reduced, S.WRONG_BYTES), (not_written, "not implemented yet")],
}
