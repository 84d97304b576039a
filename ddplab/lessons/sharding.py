"""Lab 12's experiments: what each rank holds under FSDP, and what travels when.

Teaches, on the live ranks: ``holds_on_rank`` wraps one model in the
reference FSDP (``ddplab.sync.core.fsdp``) and reports the parameter bytes a
rank holds between layers against the full model's; ``flat_shards_on_rank``
shows what flat pieces change (``p.ndim``, torch's ``clip_grad_norm_``) and
what the FSDP's own methods give instead; ``precision_on_rank`` what
``compute_dtype`` changes (the gathered weights, the compute, the gradients
before the float32 reduce-scatter) and what it leaves float32; ``traffic_on_rank``
runs one training step of a registered strategy (``ddp``, ``zero1``,
``torch_zero``, ``fsdp``, ``torch_fsdp2``), its optimizer's step included,
while a ``GroupRecorder`` watches the observing group, and returns every
collective it saw (op, its phase: forward, backward or step, payload bytes),
each rank's ring bytes and the step's timeline; ``one_axis_figure`` draws
those steps, strategy by strategy, on one shared time axis (the panels of
``ddplab.widgets.compare``, as labs 02 and 03 compare strategies).

Leaves out: memory peaks and optimizer state (the memory-per-rank picture),
compute_dtype (tested in tests/sync/test_fsdp.py), timing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddplab.sync.core.fsdp import FSDP
from ddplab.sync.registry import build_strategy
from ddplab.timeline.on_group import GroupRecorder
from ddplab.timeline.recorder import Recorder


def stack(width: int = 12, depth: int = 3) -> nn.Module:
    """Linear layers whose weights and biases divide by 2 and 3: no shard is padded."""
    torch.manual_seed(0)
    layers = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, width // 2))


def holds_on_rank() -> dict:
    model = stack()
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    fsdp = FSDP(model)
    held = sum(p.numel() * p.element_size() for p in fsdp.module.parameters())
    shapes = {n: tuple(p.shape) for n, p in fsdp.module.named_parameters()}
    gathered = {n: tuple(t.shape) for n, t in fsdp.full_parameters().items()}
    return {"full_bytes": full, "held_bytes": held, "shard_shapes": shapes,
            "full_shapes": gathered}


def flat_shards_on_rank() -> dict:
    """One backward of ``stack()`` under ddplab's FSDP, whose pieces are flat: what ``p.ndim``
    and torch's ``clip_grad_norm_`` over the pieces say, against ``full_shape``,
    ``FSDP.clip_grad_norm_`` and one process training on every rank's batch."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    batches = [torch.randn(8, 12, generator=torch.Generator().manual_seed(r)) for r in range(ws)]
    fsdp = FSDP(stack())
    fsdp(batches[rank]).square().mean().backward()
    fsdp.finish_gradient_synchronization()
    pieces = float(torch.nn.utils.get_total_norm([p.grad for p in fsdp.parameters()]))
    norm = float(fsdp.clip_grad_norm_(float("inf")))  # max_norm inf: measures, scales nothing
    one = stack()
    (sum(one(x).square().mean() for x in batches) / ws).backward()
    single = float(torch.nn.utils.clip_grad_norm_(one.parameters(), float("inf")))
    plain = stack()
    plain.load_state_dict(fsdp.full_state_dict())  # raises if a shape does not fit
    return {"ndim": {n: p.ndim for n, p in fsdp.module.named_parameters()},
            "full_ndim": {n: len(fsdp.full_shape(p)) for n, p in fsdp.module.named_parameters()},
            "pieces_norm": pieces, "norm": norm, "one_process": single,
            "loads_unwrapped": all(torch.equal(plain.state_dict()[n], t)
                                   for n, t in one.state_dict().items())}


def precision_on_rank(compute_dtype=None) -> dict:
    """One backward of ``stack()`` under ddplab's FSDP with ``compute_dtype``: the dtype of the
    shards, of what the first layer computes with, of the gradients reduce-scattered and of
    the pieces that come back, and the bytes all-gathered (the full weights, both gathers)."""
    seen = {"all_gather_bytes": 0}

    class Watched(FSDP):
        def all_gather(self, unit):
            fulls = super().all_gather(unit)
            seen["all_gather_bytes"] += sum(t.numel() * t.element_size() for t in fulls)
            return fulls

        def reduce_scatter(self, unit, grads):
            seen["grad_reduced_from"] = next(g.dtype for g in grads if g is not None)
            pieces = super().reduce_scatter(unit, grads)
            seen["piece"] = next(q.dtype for q in pieces if q is not None)
            return pieces

    fsdp = Watched(stack(), compute_dtype=compute_dtype)
    first = fsdp.module[0]  # after FSDP's own pre-hook: the full weight is in, the input cast
    first.register_forward_pre_hook(
        lambda m, args: seen.update(weight=m.weight.dtype, input=args[0].dtype))
    fsdp.module[1].register_forward_hook(lambda m, args, out: seen.update(output=out.dtype))
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(dist.get_rank()))
    fsdp(x).float().square().mean().backward()
    return {**seen, "shard": first.weight.dtype, "shard_grad": first.weight.grad.dtype}


def traffic_on_rank(name: str) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = stack()
    built = build_strategy(name, model)
    rec = Recorder(name, rank, ws)
    watch = GroupRecorder(rec, model.parameters(), broadcasts=True)  # ZeRO-1's step
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(rank))
    # the ZeRO rows bring their sharded optimizer (it broadcasts in its step); the others SGD.
    # Built and stepped once (no gradients yet: no update) before the recorded step: torch's
    # ZeroRedundancyOptimizer's first import and first step take hundreds of milliseconds,
    # which would squeeze every other panel of the shared time axis.
    make_optimizer = getattr(built, "optimizer", None) or torch.optim.SGD
    optimizer = make_optimizer(list(built.model.parameters()), lr=0.1)
    optimizer.step()
    rec.begin_iteration(0)
    with watch.watching(), rec.phase("forward"):
        out = built.model(x)
    with watch.watching(), rec.phase("backward"):
        out.square().mean().backward()
        if built.after_backward is not None:
            built.after_backward()
    with watch.watching(phase="step"), rec.phase("step"):
        optimizer.step()
    end = watch.end_iteration()
    rec.end_iteration()
    return {"calls": end["calls"], "ring_bytes": end["ring_bytes"], "nbytes": end["nbytes"],
            "timeline": rec.result().to_dict()}
