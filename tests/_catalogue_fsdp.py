"""Mutation catalogue, FSDP's two collectives (ddplab.checks.fsdp): a gather-before-use and a
gradient reduce-scatter, as a learner might write them. Each solution is a class holding the
pair, ``gather_full(shard, numel, shape, group=None)`` and ``reduce_scatter_grad(full_grad,
group=None)``.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddplab.checks import fsdp as FC
from ddplab.checks.mistakes import RAISED


def _gather(shard, numel, shape, group=None):
    out = shard.new_empty(dist.get_world_size(group) * shard.numel())
    dist.all_gather_single(out, shard, group=group)
    return out[:numel].view(shape)


def _padded(full_grad, group=None):
    ws = dist.get_world_size(group)
    n = -(-full_grad.numel() // ws)
    return F.pad(full_grad.reshape(-1), (0, n * ws - full_grad.numel())), n, ws


def _reduce_scatter(full_grad, group=None):
    flat, n, ws = _padded(full_grad, group)
    out = flat.new_empty(n)
    dist.reduce_scatter_single(out, flat, group=group)
    return out / ws


class fsdp_ok_single:
    gather_full = staticmethod(_gather)
    reduce_scatter_grad = staticmethod(_reduce_scatter)


class fsdp_ok_old_names_divide_first:
    @staticmethod
    def gather_full(shard, numel, shape, group=None):
        out = torch.empty(dist.get_world_size(group) * len(shard), dtype=shard.dtype)
        dist.all_gather_into_tensor(out, shard, group=group)
        return out.narrow(0, 0, numel).reshape(shape)

    @staticmethod
    def reduce_scatter_grad(full_grad, group=None):
        flat, n, _ = _padded(full_grad / dist.get_world_size(group), group)
        out = torch.zeros(n)
        dist.reduce_scatter_tensor(out, flat.contiguous(), group=group)
        return out


class fsdp_ok_list_gather:
    @staticmethod
    def gather_full(shard, numel, shape, group=None):
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard, group=group)
        return torch.cat(parts)[:numel].reshape(shape)

    @staticmethod
    def reduce_scatter_grad(full_grad, group=None):
        flat, n, ws = _padded(full_grad, group)
        out = torch.empty(n)
        dist.reduce_scatter_single(out, flat.view(ws, n).reshape(-1), group=group)
        return out.div_(ws)


# -- planted mistakes ----------------------------------------------------------------------------
class fsdp_gathers_nothing:
    gather_full = staticmethod(lambda shard, numel, shape, group=None: shard)
    reduce_scatter_grad = staticmethod(_reduce_scatter)


class fsdp_keeps_padding:
    @staticmethod
    def gather_full(shard, numel, shape, group=None):
        out = shard.new_empty(dist.get_world_size(group) * shard.numel())
        dist.all_gather_single(out, shard, group=group)
        return out
    reduce_scatter_grad = staticmethod(_reduce_scatter)


class fsdp_gathers_by_all_reduce:
    @staticmethod
    def gather_full(shard, numel, shape, group=None):
        rank, n = dist.get_rank(group), shard.numel()
        full = shard.new_zeros(dist.get_world_size(group) * n)
        full[rank * n:(rank + 1) * n] = shard
        dist.all_reduce(full, group=group)
        return full[:numel].view(shape)
    reduce_scatter_grad = staticmethod(_reduce_scatter)


class fsdp_gathers_reversed:
    @staticmethod
    def gather_full(shard, numel, shape, group=None):
        ws = dist.get_world_size(group)
        out = shard.new_empty(ws * shard.numel())
        dist.all_gather_single(out, shard, group=group)
        return out.view(ws, -1).flip(0).reshape(-1)[:numel].view(shape)
    reduce_scatter_grad = staticmethod(_reduce_scatter)


class fsdp_no_division:
    gather_full = staticmethod(_gather)

    @staticmethod
    def reduce_scatter_grad(full_grad, group=None):
        return _reduce_scatter(full_grad, group) * dist.get_world_size(group)


class fsdp_no_reduce:
    gather_full = staticmethod(_gather)

    @staticmethod
    def reduce_scatter_grad(full_grad, group=None):
        flat, n, _ = _padded(full_grad, group)
        rank = dist.get_rank(group)
        return flat[rank * n:(rank + 1) * n].clone()


class fsdp_returns_whole_average:
    gather_full = staticmethod(_gather)

    @staticmethod
    def reduce_scatter_grad(full_grad, group=None):
        flat, _, ws = _padded(full_grad, group)
        dist.all_reduce(flat, group=group)
        return flat / ws


class fsdp_all_reduce_then_cut:
    gather_full = staticmethod(_gather)

    @staticmethod
    def reduce_scatter_grad(full_grad, group=None):
        flat, n, ws = _padded(full_grad, group)
        dist.all_reduce(flat, group=group)
        rank = dist.get_rank(group)
        return flat[rank * n:(rank + 1) * n] / ws


class fsdp_next_ranks_piece:
    gather_full = staticmethod(_gather)

    @staticmethod
    def reduce_scatter_grad(full_grad, group=None):
        flat, n, ws = _padded(full_grad, group)
        dist.all_reduce(flat, group=group)
        r = (dist.get_rank(group) + 1) % ws
        return flat[r * n:(r + 1) * n] / ws


class fsdp_no_padding:
    gather_full = staticmethod(_gather)

    @staticmethod
    def reduce_scatter_grad(full_grad, group=None):
        ws = dist.get_world_size(group)
        out = torch.empty(full_grad.numel() // ws)
        dist.reduce_scatter_single(out, full_grad.reshape(-1), group=group)
        return out / ws


class fsdp_divides_twice:
    gather_full = staticmethod(_gather)

    @staticmethod
    def reduce_scatter_grad(full_grad, group=None):
        return _reduce_scatter(full_grad / dist.get_world_size(group), group)


class fsdp_pads_one_more:
    """n = numel // world_size + 1: ceil wherever numel does not divide (every odd weight at
    2 ranks), one too many where it does."""
    gather_full = staticmethod(_gather)

    @staticmethod
    def reduce_scatter_grad(full_grad, group=None):
        ws = dist.get_world_size(group)
        n = full_grad.numel() // ws + 1
        flat = F.pad(full_grad.reshape(-1), (0, n * ws - full_grad.numel()))
        out = flat.new_empty(n)
        dist.reduce_scatter_single(out, flat, group=group)
        return out / ws


class fsdp_gathers_whole_gradients:
    """Right values, world_size times the bytes: every rank's whole gradient to every rank."""
    gather_full = staticmethod(_gather)

    @staticmethod
    def reduce_scatter_grad(full_grad, group=None):
        flat, n, ws = _padded(full_grad, group)
        every = flat.new_empty(ws * flat.numel())
        dist.all_gather_single(every, flat, group=group)
        rank = dist.get_rank(group)
        return every.view(ws, -1).sum(0)[rank * n:(rank + 1) * n] / ws


FSDP_COLLECTIVES = {
    "check": lambda cluster, fn: FC.check_fsdp_collectives(cluster, fn.gather_full,
                                                           fn.reduce_scatter_grad),
    "world": 2,
    "correct": [fsdp_ok_single, fsdp_ok_old_names_divide_first, fsdp_ok_list_gather],
    "wrong": [(fsdp_gathers_nothing, FC.NOT_GATHERED), (fsdp_keeps_padding, FC.PADDING_LEFT),
              (fsdp_gathers_by_all_reduce, FC.GATHER_TOO_MANY_BYTES),
              (fsdp_gathers_reversed, FC.WRONG_ORDER), (fsdp_no_division, FC.NO_DIVISION),
              (fsdp_no_reduce, FC.NOT_REDUCED), (fsdp_returns_whole_average, FC.WHOLE_GRADIENT),
              (fsdp_all_reduce_then_cut, FC.ALL_REDUCED), (fsdp_next_ranks_piece, FC.WRONG_PIECE),
              (fsdp_no_padding, RAISED), (fsdp_divides_twice, FC.SCATTER_WRONG),
              (fsdp_pads_one_more, FC.WRONG_PADDING),
              (fsdp_gathers_whole_gradients, FC.GATHERED_GRADIENTS)],
}
