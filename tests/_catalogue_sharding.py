"""Mutation catalogue, lab 11's exercise: the sharded optimizer's partition and step.

Each solution is a class holding the pair the lab asks for, ``partition(params,
world_size) -> owner`` and ``step(local, params, owner)``, graded by
ddplab/checks/sharding.py at 2 and at 3 ranks. The grader's weights have even and
odd sizes, so the shares are uneven at both: where a padding slip shows. Correct
partitions three ways (largest first to the smallest share, as torch's; round
robin; blocks in order) and correct steps three ways (a broadcast per parameter,
an all-gather of padded flat shards, all_gather_into_tensor and all_gather_single), and the slips the
grader names. A deadlock (a rank skipping a broadcast) is planted too: it costs
the catalogue's collective timeout and a replacement of the ranks.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddplab.checks import sharding as S
from ddplab.checks.mistakes import HUNG, NOT_IMPLEMENTED, RAISED


# -- partitions ----------------------------------------------------------------------------
def largest_first(params, world_size):
    owner, sizes = {}, [0] * world_size
    for p in sorted(params, key=lambda t: t.numel(), reverse=True):
        r = sizes.index(min(sizes))
        owner[p] = r
        sizes[r] += p.numel()
    return owner


def round_robin(params, world_size):
    return {p: i % world_size for i, p in enumerate(params)}


def blocks(params, world_size):
    return {p: i * world_size // len(params) for i, p in enumerate(params)}


# -- steps ---------------------------------------------------------------------------------
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


def _shares(params, owner):
    return [[p for p in params if owner[p] == r] for r in range(dist.get_world_size())]


def _flat_padded(params, owner):
    shares = _shares(params, owner)
    longest = max(sum(p.numel() for p in s) for s in shares)
    mine = shares[dist.get_rank()]
    flat = torch.cat([p.detach().reshape(-1) for p in mine]) if mine else params[0].new_zeros(0)
    return shares, longest, F.pad(flat, (0, longest - flat.numel()))


def _copy_back(shares, parts):
    with torch.no_grad():
        for share, part in zip(shares, parts):
            o = 0
            for p in share:
                p.copy_(part[o:o + p.numel()].view_as(p))
                o += p.numel()


@torch.no_grad()
def gathered_padded(local, params, owner):
    local.step()
    shares, longest, flat = _flat_padded(params, owner)
    parts = [torch.empty_like(flat) for _ in shares]
    dist.all_gather(parts, flat)
    _copy_back(shares, parts)


@torch.no_grad()
def gathered_into_tensor(local, params, owner):
    local.step()
    shares, longest, flat = _flat_padded(params, owner)
    out = flat.new_empty(len(shares) * longest)
    dist.all_gather_into_tensor(out, flat)
    _copy_back(shares, out.view(len(shares), longest))


@torch.no_grad()
def gathered_single(local, params, owner):
    local.step()
    shares, longest, flat = _flat_padded(params, owner)
    out = flat.new_empty(len(shares) * longest)
    dist.all_gather_single(out, flat)  # torch 2.13's name for all_gather_into_tensor
    _copy_back(shares, out.split(longest))


# -- wrong steps ---------------------------------------------------------------------------
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


def from_the_next_rank(local, params, owner):
    local.step()
    for p in params:
        dist.broadcast(p.data, src=(owner[p] + 1) % dist.get_world_size())


def divided_again(local, params, owner):
    for group in local.param_groups:
        for p in group["params"]:
            p.grad.div_(dist.get_world_size())  # DDP has averaged already
    local.step()
    for p in params:
        dist.broadcast(p.data, src=owner[p])


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


@torch.no_grad()
def all_reduced_averaged(local, params, owner):
    """The mean of every rank's copy: the owner's stepped one with the others' unstepped ones."""
    local.step()
    for p in params:
        dist.all_reduce(p)
        p /= dist.get_world_size()


def own_full_adam(local, params, owner):
    """Every rank steps every parameter with an Adam of its own: nothing sharded, nothing sent."""
    if not hasattr(local, "full_copy"):
        local.full_copy = torch.optim.Adam(params, lr=local.param_groups[0]["lr"])
    local.full_copy.step()


@torch.no_grad()
def gathered_never_copied(local, params, owner):
    local.step()
    shares, longest, flat = _flat_padded(params, owner)
    parts = [torch.empty_like(flat) for _ in shares]
    dist.all_gather(parts, flat)
    for share, part in zip(shares, parts):  # views of the gathered tensor, never the parameters
        o = 0
        for p in share:
            p = part[o:o + p.numel()].view_as(p)
            o += p.numel()


@torch.no_grad()
def gathered_without_padding(local, params, owner):
    local.step()
    shares = _shares(params, owner)
    mine = torch.cat([p.reshape(-1) for p in shares[dist.get_rank()]])
    parts = [mine.new_empty(sum(p.numel() for p in s)) for s in shares]
    dist.all_gather(parts, mine)
    _copy_back(shares, parts)


@torch.no_grad()
def cut_as_if_unpadded(local, params, owner):
    local.step()
    shares, longest, flat = _flat_padded(params, owner)
    out = flat.new_empty(len(shares) * longest)
    dist.all_gather_into_tensor(out, flat)
    o = 0  # one running offset over the whole gathered tensor: every part's padding is read
    for share in shares:
        for p in share:
            p.copy_(out[o:o + p.numel()].view_as(p))
            o += p.numel()


@torch.no_grad()
def gathered_whole_model(local, params, owner):
    local.step()
    flat = torch.cat([p.reshape(-1) for p in params])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    o = 0
    for p in params:
        p.copy_(every[owner[p]][o:o + p.numel()].view_as(p))
        o += p.numel()


def one_rank_skips_one(local, params, owner):
    local.step()
    last = params[-1]
    skipper = (owner[last] + 1) % dist.get_world_size()  # a rank that does not own it
    for p in params:
        if p is last and dist.get_rank() == skipper:
            continue  # this rank never makes the last broadcast: its owner waits for it
        dist.broadcast(p.data, src=owner[p])


def async_never_waited(local, params, owner):
    local.step()
    for p in params:
        dist.broadcast(p.data, src=owner[p], async_op=True)  # the works are dropped


def stale_copy_from_the_next_rank(local, params, owner):
    stale = [p.detach().clone() for p in params]  # kept from before the step
    local.step()
    for p, old in zip(params, stale):
        src = (owner[p] + 1) % dist.get_world_size()
        buf = old if dist.get_rank() == src else p.data
        dist.broadcast(buf, src=src)
        p.data.copy_(buf)


def divided_then_gathered(local, params, owner):
    for p in params:
        p.grad.div_(dist.get_world_size())  # DDP has averaged already
    gathered_padded(local, params, owner)


@torch.no_grad()
def float32_buffer(local, params, owner):
    local.step()
    shares, longest, flat = _flat_padded(params, owner)
    out = torch.empty(len(shares) * longest)  # float32: the parameters are float64
    dist.all_gather_into_tensor(out, flat)
    _copy_back(shares, out.view(len(shares), longest))


@torch.no_grad()
def flat_pieces_kept(local, params, owner):
    local.step()
    shares, longest, flat = _flat_padded(params, owner)
    out = flat.new_empty(len(shares) * longest)
    dist.all_gather_into_tensor(out, flat)
    for share, part in zip(shares, out.view(len(shares), longest)):
        o = 0
        for p in share:
            p.data = part[o:o + p.numel()].clone()  # no view(shape): p becomes flat
            o += p.numel()


@torch.no_grad()
def one_buffer_for_every_rank(local, params, owner):
    local.step()
    shares, longest, flat = _flat_padded(params, owner)
    buf = torch.empty_like(flat)
    parts = [buf] * len(shares)  # one tensor, overwritten by every rank's part
    dist.all_gather(parts, flat)
    _copy_back(shares, parts)


# -- wrong partitions ----------------------------------------------------------------------
def skips_the_smallest(params, world_size):
    owner = largest_first(params, world_size)
    del owner[min(params, key=lambda t: t.numel())]
    return owner


def one_past_the_last_rank(params, world_size):
    return {p: i % (world_size + 1) for i, p in enumerate(params)}


def by_own_rank(params, world_size):
    return {p: (i + dist.get_rank()) % world_size for i, p in enumerate(params)}


def not_written(*args):
    raise NotImplementedError


def solution(partition, step):
    """One learner's pair, named after both (the catalogue prints the name)."""
    cls = type(f"{partition.__name__}+{step.__name__}", (), {})
    cls.partition, cls.step = staticmethod(partition), staticmethod(step)
    return cls


CORRECT = [solution(largest_first, per_param), solution(round_robin, gathered_padded),
           solution(blocks, gathered_into_tensor), solution(largest_first, async_waited),
           solution(round_robin, by_rank), solution(largest_first, gathered_into_tensor),
           solution(largest_first, gathered_single)]
WRONG = [(solution(largest_first, no_broadcast), S.NO_BROADCAST),
         (solution(largest_first, broadcast_first), S.NOT_RECEIVED),
         (solution(largest_first, broadcast_gradients), S.NOT_RECEIVED),
         (solution(largest_first, broadcast_a_copy), S.NOT_RECEIVED),
         (solution(largest_first, from_rank0), S.WRONG_SOURCE),
         (solution(round_robin, from_the_next_rank), S.WRONG_SOURCE),
         (solution(largest_first, divided_again), S.DIVIDED_TWICE),
         (solution(largest_first, no_step), S.NO_STEP),
         (solution(largest_first, twice), S.WRONG_BYTES),
         (solution(largest_first, all_reduced), S.AVERAGED_COPIES),
         (solution(round_robin, all_reduced_averaged), S.AVERAGED_COPIES),
         (solution(round_robin, own_full_adam), S.OWN_OPTIMIZER),
         (solution(round_robin, gathered_never_copied), S.NOT_COPIED_BACK),
         (solution(largest_first, gathered_without_padding), RAISED),
         (solution(largest_first, cut_as_if_unpadded), S.WRONG_CUT),
         (solution(largest_first, gathered_whole_model), S.WRONG_BYTES),
         (solution(skips_the_smallest, per_param), S.NOT_OWNED),
         (solution(one_past_the_last_rank, per_param), S.NOT_OWNED),
         (solution(by_own_rank, per_param), S.OWNERS_DIFFER),
         (solution(not_written, not_written), NOT_IMPLEMENTED),
         (solution(largest_first, not_written), NOT_IMPLEMENTED),
         (solution(largest_first, one_rank_skips_one), HUNG),
         (solution(largest_first, async_never_waited), S.NOT_WAITED),
         (solution(round_robin, stale_copy_from_the_next_rank), S.WRONG_SOURCE),
         (solution(largest_first, divided_then_gathered), S.DIVIDED_TWICE),
         (solution(largest_first, one_buffer_for_every_rank), S.WRONG_CUT)]
# each replaces the ranks (a raised step leaves a collective half-done): at 2 ranks only
WRONG_2 = WRONG + [(solution(largest_first, float32_buffer), RAISED),
                   (solution(largest_first, flat_pieces_kept), RAISED)]


def _check(cluster, fn):
    return S.check_sharded_step(cluster, fn.step, fn.partition)


SHARDED_STEP = {"check": _check, "world": 2, "correct": CORRECT, "wrong": WRONG_2}
SHARDED_STEP_3 = {"check": _check, "world": 3, "correct": CORRECT, "wrong": WRONG}
