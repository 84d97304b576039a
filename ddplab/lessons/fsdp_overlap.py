"""Lab 12's overlap picture: one training step of DDP, the reference FSDP, FSDP with prefetch
and torch's ``fully_shard``, over a simulated link, on one time axis.

Teaches, on the live ranks: ``overlap_on_rank(name)`` builds a strategy from the registry
(``ddp``, ``fsdp``, ``fsdp_overlap``, ``torch_fsdp2``) around ``layers()``, puts a simulated
link under the observing process group (``ddplab.netsim``: the real collectives still run,
each work completes no earlier than the link's model says), trains warm-up steps (FSDP with
prefetch learns the forward order in its first step), then records one step with a
``GroupRecorder``: every collective with its launch and its (modelled) end, beside the
forward, backward and optimizer phases. ``ddplab.widgets.compare.one_axis_figure`` draws the
steps on one time axis, coloured by operation.

What to look at: the reference FSDP launches each layer's all-gather when the layer is
called and waits for it, so the bars follow one another; with prefetch the next all-gather
is launched when the current layer starts computing, so the bars start earlier and the step
ends sooner.

Every collective pays its own ring time on the link for its full size: an all-gather or a
reduce-scatter half an all-reduce's (``ddplab.netsim.link.LinkModel.collective_seconds``),
so a layer's reduce-scatter is charged what its all-gather is (when the link is free).

Leaves out: timing statistics (benchmarks/fsdp_overlap.py interleaves many steps).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ddplab.netsim import LinkModel
from ddplab.netsim.simulated import SimulatedLink
from ddplab.sync import links
from ddplab.sync.registry import build_strategy
from ddplab.timeline.on_group import GroupRecorder
from ddplab.timeline.recorder import Recorder


def layers(width: int = 256, depth: int = 4) -> nn.Module:
    """``depth`` Linear layers of ``width`` with a Tanh between: each one FSDP unit."""
    torch.manual_seed(0)
    body = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]
    return nn.Sequential(*body[:-1])


def overlap_on_rank(name: str, link: str = "1gbe", width: int = 256, depth: int = 4,
                    rows: int = 256, warmup: int = 1) -> dict:
    """One recorded step of strategy ``name`` over a simulated ``link`` (after ``warmup``)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = layers(width, depth)
    built = build_strategy(name, model)
    optimizer = torch.optim.SGD(list(built.model.parameters()), lr=0.01)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rank))
    rec = Recorder(name, rank, ws)
    watch = GroupRecorder(rec, model.parameters())

    def step(recorded: bool):
        quiet = contextlib.nullcontext
        watching = watch.watching if recorded else (lambda phase=None: quiet())
        phase = rec.phase if recorded else (lambda name: quiet())
        with watching(), phase("forward"):
            out = built.model(x)
        with watching(), phase("backward"):
            out.square().mean().backward()
            if built.after_backward is not None:
                built.after_backward()
        with watching(phase="step"), phase("step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    with SimulatedLink(LinkModel.parse(link), ws) as simulated, links.using_link(simulated):
        for _ in range(warmup):
            step(False)
        dist.barrier()
        rec.begin_iteration(0)
        step(True)
        end = watch.end_iteration()
        rec.end_iteration()
    timeline = rec.result()
    timeline.meta["simulated_link"] = simulated.describe()
    return {"calls": end["calls"], "timeline": timeline.to_dict()}

