"""FSDP: every rank keeps a shard of each layer's weights and gathers a layer only to use it.

What it teaches. DDP keeps a whole model on every rank. FSDP keeps
1/world_size of each sharded parameter per rank (its shard) and, per layer:

1. before its forward (a forward pre-hook) ALL-GATHERS the shards into full
   weights, cast to ``compute_dtype`` BEFORE the gather (float16 halves the
   bytes), swaps them into the layer, and after the forward swaps the shards
   back and FREES the full weights (autograd keeps the tensors, not memory);
2. before its backward (a hook on its output's gradient) ALL-GATHERS AGAIN;
3. when its weight gradients are ready (the backward of the gather)
   REDUCE-SCATTERS them in float32: each rank gets the average of its shard's
   gradient. Parameters outside sharded layers (a norm) are replicated and
   all-reduced by ``finish_gradient_synchronization()``, as in DDP.

The shards ARE ``.module``'s parameters (float32 master weights, flat, padded
with zeros to a multiple of world_size; rank r holds piece r): the optimizer
steps 1/world_size of the model. ``full_parameters()`` gathers it by name.

    model = FSDP(net, compute_dtype=torch.bfloat16)  # shards nn.Linear, nn.Embedding
    opt = torch.optim.AdamW(model.parameters())      # the shards
    loss_fn(model(x), y).backward()                  # gathers, reduce-scatters
    model.finish_gradient_synchronization()          # the replicated parameters
    opt.step()

Leaves out, next to FSDP2's ``fully_shard``: DTensor shards on dim 0 (here flat
pieces); prefetching and overlap (each collective is waited for); ``reduce_dtype``
(float32 here), ``reshard_after_forward=False``, offload, hybrid sharding, no_sync;
buffers are broadcast once. As in torch, ranks must run the same layers in order.

References: torch/distributed/fsdp/_fully_shard/: _fsdp_param_group.py
(``pre_forward``, ``post_forward``, ``pre_backward``, ``post_backward``),
_fsdp_param.py (``to_unsharded``, ``to_sharded``, ``free_storage``),
_fsdp_collectives.py; Zhao et al., "PyTorch FSDP" (VLDB 2023).
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist
from torch import nn


class ShardedParameter:
    """One sharded weight: its full shape, and this rank's piece (an nn.Parameter)."""

    def __init__(self, param: nn.Parameter, rank: int, world_size: int):
        self.shape, self.numel = param.shape, param.numel()
        self.shard_numel = -(-self.numel // world_size)  # ceil: the last piece is padded
        padded = pad(param.detach().reshape(-1), self.shard_numel * world_size)
        self.shard = nn.Parameter(padded.view(world_size, -1)[rank].clone(),  # piece ``rank``
                                  requires_grad=param.requires_grad)


@dataclasses.dataclass
class Unit:
    """A layer of a ``shard`` class: what it gathers in ONE all-gather and where it goes."""
    module: nn.Module
    slots: list  # (submodule, attribute name, ShardedParameter) for every use of a weight
    params: list  # the distinct ShardedParameters (a weight tied within the layer once)


class _GatherUnit(torch.autograd.Function):
    """Forward: all-gather a layer's shards. Backward: reduce-scatter their gradients."""

    @staticmethod
    def forward(ctx, fsdp, unit, *shards):
        ctx.fsdp, ctx.unit = fsdp, unit
        return tuple(fsdp.all_gather(unit))

    @staticmethod
    def backward(ctx, *grads):
        for ref in getattr(ctx, "fulls", ()):  # its layer's backward is done: free them
            if ref() is not None:
                ref().untyped_storage().resize_(0)
        return (None, None, *ctx.fsdp.reduce_scatter(ctx.unit, grads))


class FSDP(nn.Module):
    def __init__(self, module: nn.Module, compute_dtype=None, shard=(nn.Linear, nn.Embedding),
                 process_group=None, **unsupported):
        super().__init__()
        if unsupported:
            raise TypeError(
                f"ddplab.sync.core.FSDP does not take {', '.join(sorted(unsupported))}: it is the "
                "reference to read; for prefetching, no_sync or CPU offload use torch's "
                "torch.distributed.fsdp.fully_shard")
        _check(module, compute_dtype, shard)
        self.module, self.process_group = module, process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.compute_dtype = compute_dtype or torch.float32
        with torch.no_grad():  # like DDP: every rank starts from rank 0's weights and buffers
            src = dist.get_global_rank(process_group, 0) if process_group else 0
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src, group=process_group)
        self.units, self.sharded = self._shard(module, shard)
        ids = {id(sp.shard) for sp in self.sharded.values()}
        self.replicated = [p for p in module.parameters() if id(p) not in ids and p.requires_grad]
        for unit in self.units:
            unit.module.register_forward_pre_hook(self._pre_forward(unit))
            unit.module.register_forward_hook(self._post_forward(unit), always_call=True)

    def _shard(self, module, classes):
        """A module of a ``shard`` class is a unit: it owns its parameters and those of its
        submodules that are no units themselves. Each owned weight is replaced by its shard."""
        owner, uses, sharded, by_id, outside = {}, {}, {}, {}, {}
        for name, m in module.named_modules():
            parent = owner.get(name.rpartition(".")[0]) if name else None
            owner[name] = m if isinstance(m, classes) else parent
            for pname, p in m.named_parameters(recurse=False):
                fqn = f"{name}.{pname}" if name else pname
                if owner[name] is None:
                    outside.setdefault(id(p), fqn)
                    continue
                if id(p) not in by_id:
                    by_id[id(p)] = sharded[fqn] = ShardedParameter(p, self.rank, self.world_size)
                uses.setdefault(owner[name], []).append((m, pname, by_id[id(p)]))
        tied = [fqn for i, fqn in outside.items() if i in by_id]
        if tied:
            raise ValueError(f"{tied[0]} is shared by a sharded layer and a module that is not "
                             "sharded: add that module's class to shard=, or untie the weight")
        for m, pname, sp in [slot for slots in uses.values() for slot in slots]:
            m._parameters[pname] = sp.shard  # the module now holds this rank's piece
        return [Unit(u, slots, list({id(sp): sp for _, _, sp in slots}.values()))
                for u, slots in uses.items()], sharded

    def all_gather(self, unit: Unit) -> list:
        """This rank's pieces, cast, concatenated, gathered in ONE call, cut into full weights."""
        pieces = torch.cat([sp.shard.detach().to(self.compute_dtype) for sp in unit.params])
        gathered = pieces.new_empty(self.world_size * pieces.numel())
        dist.all_gather_single(gathered, pieces, group=self.process_group)
        columns = gathered.view(self.world_size, -1).split(  # row r: rank r's pieces
            [sp.shard_numel for sp in unit.params], dim=1)
        return [c.reshape(-1)[:sp.numel].view(sp.shape).clone()
                for sp, c in zip(unit.params, columns)]

    def reduce_scatter(self, unit: Unit, grads) -> list:
        """Full gradients in, this rank's averaged float32 piece of each out (ONE call)."""
        sizes = [sp.shard_numel for sp in unit.params]
        rows = torch.cat([  # each gradient float32, padded, cut in pieces: row r goes to rank r
            pad(sp.shard[:0] if g is None else g.reshape(-1).float(), n * self.world_size)
            .view(self.world_size, n) for sp, n, g in zip(unit.params, sizes, grads)], dim=1)
        mine = rows.new_empty(sum(sizes))
        dist.reduce_scatter_single(mine, rows.reshape(-1), group=self.process_group)
        mine /= self.world_size
        return [None if g is None else piece.clone() for g, piece in zip(grads, mine.split(sizes))]

    def _pre_forward(self, unit: Unit):
        def hook(module, args):
            args = tuple(a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point()
                         else a for a in args)  # inputs in compute_dtype, as FSDP2 casts them
            if torch.is_grad_enabled():
                fulls = _GatherUnit.apply(self, unit, *[sp.shard for sp in unit.params])
            else:  # no backward will follow: nothing for autograd to record
                fulls = self.all_gather(unit)
            unit.fulls = fulls
            for m, pname, sp in unit.slots:  # swap the full weights in, as FSDP2 does
                m._parameters[pname] = fulls[unit.params.index(sp)]
            return args
        return hook

    def _post_forward(self, unit: Unit):
        def hook(module, args, output):
            for m, pname, sp in unit.slots:  # the shards go back
                m._parameters[pname] = sp.shard
            fulls, unit.fulls = unit.fulls, []
            for full in fulls:  # autograd still holds the tensors; free their memory
                full.untyped_storage().resize_(0)
            outputs = [t for t in _tensors(output) if t.requires_grad]
            if fulls and fulls[0].grad_fn is not None and outputs:
                fulls[0].grad_fn.fulls = [weakref.ref(f) for f in fulls]  # for its backward
                done = []

                def pre_backward(grad):
                    if not done:  # once per forward call, at the first output's gradient
                        done.append(True)  # the same storage again: autograd saved these tensors
                        for full, again in zip(fulls, self.all_gather(unit)):
                            full.untyped_storage().resize_(again.numel() * again.element_size())
                            full.data.copy_(again)  # .data: the saved version is not bumped
                    return grad
                for t in outputs:
                    t.register_hook(pre_backward)
            return output
        return hook

    def forward(self, *args, **kwargs):
        if self.compute_dtype == torch.float32:
            return self.module(*args, **kwargs)
        mine = {id(p) for p in self.replicated}  # replicated weights are used cast, too:
        cast = {n: p.to(self.compute_dtype)  # .to() is differentiable, grads come back float32
                for n, p in self.module.named_parameters() if id(p) in mine}
        return torch.func.functional_call(self.module, cast, args, kwargs, strict=False)

    def finish_gradient_synchronization(self) -> None:
        """Average the replicated parameters' gradients (the sharded ones were reduce-scattered
        during backward). A gradient that exists on any rank is averaged on every rank."""
        if not self.replicated:
            return
        used = torch.stack([torch.tensor(p.grad is not None, device=p.device, dtype=p.dtype)
                            for p in self.replicated])
        dist.all_reduce(used, group=self.process_group)
        for p in [p for p, u in zip(self.replicated, used.tolist()) if u]:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            dist.all_reduce(p.grad, group=self.process_group)
            p.grad /= self.world_size

    @torch.no_grad()
    def full_parameters(self) -> dict:
        """Every parameter of ``.module`` by name, full size, float32 (gathered: every rank
        must call it). A tied weight appears once, under its first name."""
        pieces, out = {id(sp.shard): sp for sp in self.sharded.values()}, {}
        for name, p in self.module.named_parameters():
            sp = pieces.get(id(p))
            if sp is None:  # replicated: every rank holds all of it
                out[name] = p.detach().clone()
                continue
            gathered = sp.shard.new_empty(self.world_size * sp.shard_numel)
            dist.all_gather_single(gathered, sp.shard.detach(), group=self.process_group)
            out[name] = gathered[:sp.numel].view(sp.shape)
        return out


def _check(module, compute_dtype, shard) -> None:
    """What this reference cannot do, refused with what to do instead."""
    if compute_dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"compute_dtype must be None, float16 or bfloat16, not {compute_dtype}")
    if not isinstance(shard, tuple) or not all(isinstance(c, type) for c in shard):
        raise TypeError("shard must be a tuple of module classes, e.g. (nn.Linear, MyBlock)")
    for name, p in module.named_parameters():
        if p.dtype != torch.float32:
            raise ValueError(f"FSDP keeps float32 master weights: {name} is {p.dtype}; call "
                             "module.float() and pass compute_dtype= for lower precision")
    if any(isinstance(m, nn.Embedding) and m.sparse for m in module.modules()):
        raise ValueError("FSDP cannot shard an nn.Embedding with sparse=True (its gradient "
                         "is not a dense tensor to reduce-scatter): use sparse=False")


def pad(flat, size):
    """``flat`` followed by zeros up to ``size`` elements."""
    return torch.cat([flat, flat.new_zeros(size - flat.numel())])


def _tensors(output) -> list:
    """The tensors in a layer's output: a tensor, or (nested) tuples and lists of them."""
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    return [output] if isinstance(output, torch.Tensor) else []
