"""Mutation catalogue, lab 12's exercise: a unit's four hooks (ddplab.checks.fsdp), as a learner
might write them. Each solution is a class holding ``pre_forward``, ``post_forward``,
``pre_backward`` and ``post_backward``, each a function of ``(fsdp, unit)``, graded at 2 ranks
and (the padding and order slips, and the correct ways) at 3.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddplab.checks import fsdp as FC
from ddplab.checks.mistakes import HUNG, NOT_IMPLEMENTED, RAISED
from ddplab.sync.core.fsdp import alloc_storage, free_storage


def _gathered(fsdp, sp):
    out = sp.shard.new_empty(fsdp.world_size * sp.shard.numel())
    dist.all_gather_single(out, sp.shard.detach(), group=fsdp.process_group)
    return out


def _fill(fsdp, unit, cut):
    """The gathered pieces, cut by ``cut(flat, sp)``, into the unit's full tensors."""
    for sp, full in zip(unit.params, unit.fulls):
        alloc_storage(full)
        full.data.copy_(cut(_gathered(fsdp, sp), sp))


def pre_forward(fsdp, unit):
    if not unit.gathered:
        _fill(fsdp, unit, lambda out, sp: out[:sp.numel].view(sp.shape))
        unit.gathered = True
    fsdp.swap_in(unit)


def post_forward(fsdp, unit):
    fsdp.swap_out(unit)
    for full in unit.fulls:
        free_storage(full)
    unit.gathered = False


def _scatter(fsdp, sp, full, piece_of):
    ws = fsdp.world_size
    n = sp.shard.numel()
    flat = F.pad(full.grad.reshape(-1), (0, n * ws - sp.numel))
    piece = piece_of(flat, n, ws)
    sp.shard.grad = piece if sp.shard.grad is None else sp.shard.grad + piece
    full.grad = None


def _rs(flat, n, ws):
    out = flat.new_empty(n)
    dist.reduce_scatter_single(out, flat)
    return out / ws


def post_backward(fsdp, unit, piece_of=_rs):
    for sp, full in zip(unit.params, unit.fulls):
        if full.grad is not None:
            _scatter(fsdp, sp, full, piece_of)
    post_forward(fsdp, unit)


def hooks(name, **changed):
    """The solution with some hooks replaced."""
    base = {"pre_forward": pre_forward, "post_forward": post_forward,
            "pre_backward": pre_forward, "post_backward": post_backward}
    base.update(changed)
    return type(name, (), {k: staticmethod(v) for k, v in base.items()})


# -- correct, written differently ----------------------------------------------------------
def one_gather_per_unit(fsdp, unit):
    """All the unit's pieces in one all_gather_into_tensor, as the reference does."""
    if unit.gathered:
        fsdp.swap_in(unit)
        return
    ws, sizes = fsdp.world_size, [sp.shard.numel() for sp in unit.params]
    mine = torch.cat([sp.shard.detach() for sp in unit.params])
    out = mine.new_empty(ws * mine.numel())
    dist.all_gather_into_tensor(out, mine)
    for sp, full, col in zip(unit.params, unit.fulls, out.view(ws, -1).split(sizes, dim=1)):
        alloc_storage(full)
        full.data.copy_(col.reshape(-1)[:sp.numel].view(sp.shape))
    unit.gathered = True
    fsdp.swap_in(unit)


def one_scatter_per_unit(fsdp, unit):
    """Divide first, then one reduce_scatter_tensor for the unit's gradients."""
    ws = fsdp.world_size
    if all(f.grad is None for f in unit.fulls):
        post_forward(fsdp, unit)
        return
    sizes = [sp.shard.numel() for sp in unit.params]
    rows = torch.cat([F.pad(f.grad.reshape(-1) / ws, (0, n * ws - sp.numel)).view(ws, n)
                      for sp, f, n in zip(unit.params, unit.fulls, sizes)], dim=1)
    mine = rows.new_zeros(sum(sizes))
    dist.reduce_scatter_tensor(mine, rows.reshape(-1))
    for sp, f, piece in zip(unit.params, unit.fulls, mine.split(sizes)):
        sp.shard.grad = piece.clone() if sp.shard.grad is None else sp.shard.grad + piece
        f.grad = None
    post_forward(fsdp, unit)


def gather_by_broadcasts(fsdp, unit):
    """Each rank's piece broadcast from that rank: the same ring bytes as an all-gather."""
    for sp, full in zip(unit.params, unit.fulls):
        n = sp.shard.numel()
        pieces = [sp.shard.detach().clone() if r == fsdp.rank else sp.shard.new_empty(n)
                  for r in range(fsdp.world_size)]
        for r, piece in enumerate(pieces):
            dist.broadcast(piece, src=r)
        alloc_storage(full)
        full.data.copy_(torch.cat(pieces)[:sp.numel].reshape(sp.shape))
    fsdp.swap_in(unit)


def _list_gather(fsdp, unit, copy):
    """dist.all_gather into a list; no gathered flag (each call gathers)."""
    for sp, full in zip(unit.params, unit.fulls):
        parts = [torch.empty_like(sp.shard) for _ in range(fsdp.world_size)]
        dist.all_gather(parts, sp.shard.detach())
        alloc_storage(full)
        copy(full, torch.cat(parts).narrow(0, 0, sp.numel).reshape(sp.shape))
    fsdp.swap_in(unit)


def list_gather_no_flag(fsdp, unit):
    _list_gather(fsdp, unit, lambda full, new: full.data.copy_(new))


@torch.no_grad()
def _copy_no_grad(full, new):
    full.copy_(new)  # bumps full's version: autograd saved it in the forward


def copied_under_no_grad(fsdp, unit):
    _list_gather(fsdp, unit, _copy_no_grad)


def ceil_computed(fsdp, unit):
    """n computed from numel (ceil), not read off the shard."""
    ws = fsdp.world_size
    for sp, full in zip(unit.params, unit.fulls):
        if full.grad is None:
            continue
        n = -(-full.grad.numel() // ws)
        flat = F.pad(full.grad.flatten(), (0, n * ws - full.grad.numel()))
        out = torch.empty(n)
        dist.reduce_scatter_single(out, flat)
        out.div_(ws)
        sp.shard.grad = out if sp.shard.grad is None else sp.shard.grad + out
        full.grad = None
    post_forward(fsdp, unit)


CORRECT = [hooks("the_solution"),
           hooks("one_collective_per_unit", pre_forward=one_gather_per_unit,
                 pre_backward=one_gather_per_unit, post_backward=one_scatter_per_unit),
           hooks("broadcasts_and_ceil", pre_forward=gather_by_broadcasts,
                 pre_backward=gather_by_broadcasts, post_backward=ceil_computed),
           hooks("list_gather_no_flag", pre_forward=list_gather_no_flag,
                 pre_backward=list_gather_no_flag)]


# -- planted mistakes ----------------------------------------------------------------------
def not_written(fsdp, unit):
    raise NotImplementedError


def keeps_memory(fsdp, unit):
    fsdp.swap_out(unit)
    unit.gathered = False


def keeps_full_weights_in(fsdp, unit):
    for full in unit.fulls:
        free_storage(full)
    unit.gathered = False


def nothing(fsdp, unit):
    pass


def fresh_tensors(fsdp, unit):
    """New full tensors at every gather: the backward reads the forward's, freed."""
    unit.fulls = [_gathered(fsdp, sp)[:sp.numel].view(sp.shape).clone() for sp in unit.params]
    fsdp.swap_in(unit)


def no_alloc(fsdp, unit):
    for sp, full in zip(unit.params, unit.fulls):
        full.data.copy_(_gathered(fsdp, sp)[:sp.numel].view(sp.shape))  # into freed memory
    fsdp.swap_in(unit)


def _setting(cut):
    def pre(fsdp, unit):
        for sp, full in zip(unit.params, unit.fulls):
            full.data = cut(_gathered(fsdp, sp), sp, fsdp)
        fsdp.swap_in(unit)
    return pre


no_view = _setting(lambda out, sp, fsdp: out[:sp.numel])
padding_left = _setting(lambda out, sp, fsdp: out)
shard_only = _setting(lambda out, sp, fsdp: sp.shard.detach().clone())
reversed_pieces = _setting(lambda out, sp, fsdp: out.view(fsdp.world_size, -1).flip(0)
                           .reshape(-1)[:sp.numel].view(sp.shape))
rotated_pieces = _setting(lambda out, sp, fsdp: out.view(fsdp.world_size, -1).roll(1, 0)
                          .reshape(-1)[:sp.numel].view(sp.shape))


def not_swapped_in(fsdp, unit):
    for sp, full in zip(unit.params, unit.fulls):
        alloc_storage(full)
        full.data.copy_(_gathered(fsdp, sp)[:sp.numel].view(sp.shape))


def gather_by_all_reduce(fsdp, unit):
    for sp, full in zip(unit.params, unit.fulls):
        n = sp.shard.numel()
        flat = sp.shard.new_zeros(fsdp.world_size * n)
        flat[fsdp.rank * n:(fsdp.rank + 1) * n] = sp.shard.detach()
        dist.all_reduce(flat)
        alloc_storage(full)
        full.data.copy_(flat[:sp.numel].view(sp.shape))
    fsdp.swap_in(unit)


def _backward(piece_of):
    return lambda fsdp, unit: post_backward(fsdp, unit, piece_of)


def _all_reduced(flat, n, ws):
    dist.all_reduce(flat)
    return flat


def _cut(flat, r, n):
    return flat[r * n:(r + 1) * n].clone()


no_division = _backward(lambda flat, n, ws: _rs(flat, n, ws) * ws)
divides_twice = _backward(lambda flat, n, ws: _rs(flat / ws, n, ws))
no_reduce = _backward(lambda flat, n, ws: _cut(flat, dist.get_rank(), n))
whole_average = _backward(lambda flat, n, ws: _all_reduced(flat, n, ws) / ws)
all_reduce_then_cut = _backward(lambda flat, n, ws: _cut(_all_reduced(flat, n, ws), dist.get_rank(), n) / ws)
next_ranks_piece = _backward(lambda flat, n, ws: _cut(_all_reduced(flat, n, ws),
                                                      (dist.get_rank() + 1) % ws, n) / ws)


def _every_gradient(flat, n, ws):
    every = flat.new_empty(ws * flat.numel())
    dist.all_gather_single(every, flat)
    return _cut(every.view(ws, -1).sum(0), dist.get_rank(), n) / ws


gathers_whole_gradients = _backward(_every_gradient)


def pads_one_more(fsdp, unit):
    """n = numel // ws + 1: ceil wherever numel does not divide, one too many where it does."""
    ws = fsdp.world_size
    for sp, full in zip(unit.params, unit.fulls):
        if full.grad is None:
            continue
        n = full.grad.numel() // ws + 1
        flat = F.pad(full.grad.reshape(-1), (0, n * ws - full.grad.numel()))
        out = flat.new_empty(n)
        dist.reduce_scatter_single(out, flat)
        sp.shard.grad = out / ws
        full.grad = None
    post_forward(fsdp, unit)


def floor_no_padding(fsdp, unit):
    ws = fsdp.world_size
    for sp, full in zip(unit.params, unit.fulls):
        if full.grad is None:
            continue
        out = torch.empty(full.grad.numel() // ws)
        dist.reduce_scatter_single(out, full.grad.reshape(-1))
        sp.shard.grad = out / ws
        full.grad = None
    post_forward(fsdp, unit)


def grad_kept(fsdp, unit):
    for sp, full in zip(unit.params, unit.fulls):
        if full.grad is not None:
            g = full.grad
            _scatter(fsdp, sp, full, _rs)
            full.grad = g
    post_forward(fsdp, unit)


def not_freed_after_backward(fsdp, unit):
    for sp, full in zip(unit.params, unit.fulls):
        if full.grad is not None:
            _scatter(fsdp, sp, full, _rs)


def no_none_check(fsdp, unit):
    for sp, full in zip(unit.params, unit.fulls):  # also called once reduced: grad None
        _scatter(fsdp, sp, full, _rs)
    post_forward(fsdp, unit)


def assigns_not_adds(fsdp, unit):
    """sp.shard.grad = piece: right once, but it drops what the shard held (accumulation)."""
    ws = fsdp.world_size
    for sp, full in zip(unit.params, unit.fulls):
        if full.grad is not None:
            n = sp.shard.numel()
            piece = torch.empty(n)
            dist.reduce_scatter_single(piece, F.pad(full.grad.reshape(-1), (0, n * ws - sp.numel)))
            sp.shard.grad = piece / ws
            full.grad = None
    post_forward(fsdp, unit)


def frees_in_pre_forward(fsdp, unit):
    """Gathered, swapped in, then freed at once: the forward would read freed memory."""
    pre_forward(fsdp, unit)
    for full in unit.fulls:
        free_storage(full)


def rank0_only_regathers(fsdp, unit):
    if dist.get_rank() == 0:  # the other ranks think the weights are still there
        pre_forward(fsdp, unit)


WRONG = [(hooks("not_written", pre_forward=not_written, post_forward=not_written,
                pre_backward=not_written, post_backward=not_written), NOT_IMPLEMENTED),
         (hooks("post_backward_not_written", post_backward=not_written), NOT_IMPLEMENTED),
         (hooks("keeps_memory", post_forward=keeps_memory), FC.NOT_FREED),
         (hooks("keeps_full_weights_in", post_forward=keeps_full_weights_in), FC.NOT_SWAPPED_BACK),
         (hooks("no_regather", pre_backward=nothing), FC.NOT_REGATHERED),
         (hooks("fresh_tensors", pre_forward=fresh_tensors, pre_backward=fresh_tensors), FC.NEW_TENSORS),
         (hooks("no_view", pre_forward=no_view, pre_backward=no_view), FC.NOT_SHAPED),
         (hooks("padding_left", pre_forward=padding_left, pre_backward=padding_left), FC.PADDING_LEFT),
         (hooks("shard_only", pre_forward=shard_only, pre_backward=shard_only), FC.NOT_GATHERED),
         (hooks("reversed_pieces", pre_forward=reversed_pieces), FC.WRONG_ORDER),
         (hooks("not_swapped_in", pre_forward=not_swapped_in), FC.NOT_SWAPPED_IN),
         (hooks("gather_by_all_reduce", pre_forward=gather_by_all_reduce), FC.GATHER_TOO_MANY_BYTES),
         (hooks("no_division", post_backward=no_division), FC.NO_DIVISION),
         (hooks("divides_twice", post_backward=divides_twice), FC.DIVIDED_TWICE),
         (hooks("no_reduce", post_backward=no_reduce), FC.NOT_REDUCED),
         (hooks("whole_average", post_backward=whole_average), FC.WHOLE_GRADIENT),
         (hooks("all_reduce_then_cut", post_backward=all_reduce_then_cut), FC.ALL_REDUCED),
         (hooks("next_ranks_piece", post_backward=next_ranks_piece), FC.WRONG_PIECE),
         (hooks("gathers_whole_gradients", post_backward=gathers_whole_gradients), FC.GATHERED_GRADIENTS),
         (hooks("pads_one_more", post_backward=pads_one_more), FC.WRONG_PADDING),
         (hooks("grad_kept", post_backward=grad_kept), FC.GRAD_KEPT),
         (hooks("not_freed_after_backward", post_backward=not_freed_after_backward),
          FC.NOT_FREED_AFTER_BACKWARD),
         (hooks("floor_no_padding", post_backward=floor_no_padding), RAISED),
         (hooks("no_none_check", post_backward=no_none_check), RAISED),
         (hooks("no_alloc", pre_forward=no_alloc, pre_backward=no_alloc), RAISED),
         (hooks("copied_under_no_grad", pre_forward=copied_under_no_grad,
                pre_backward=copied_under_no_grad), RAISED),
         (hooks("assigns_not_adds", post_backward=assigns_not_adds), FC.ASSIGNED),
         (hooks("frees_in_pre_forward", pre_forward=frees_in_pre_forward,
                pre_backward=frees_in_pre_forward), FC.FREED_TOO_EARLY),
         (hooks("rank0_only_regathers", pre_backward=rank0_only_regathers), HUNG)]
# at 3 ranks: the correct ways, and the slips whose numbers change with an odd world size
WRONG_3 = [(fn, m) for fn, m in WRONG if fn.__name__ in ("pads_one_more", "reversed_pieces",
                                                         "no_division", "divides_twice",
                                                         "next_ranks_piece", "not_written")]
WRONG_3.append((hooks("rotated_pieces", pre_forward=rotated_pieces), FC.WRONG_ORDER))


def _check(cluster, fn):
    return FC.check_fsdp_hooks(cluster, fn.pre_forward, fn.post_forward, fn.pre_backward,
                               fn.post_backward)


FSDP_HOOKS = {"check": _check, "world": 2, "correct": CORRECT, "wrong": WRONG}
FSDP_HOOKS_3 = {"check": _check, "world": 3, "correct": CORRECT, "wrong": WRONG_3}
