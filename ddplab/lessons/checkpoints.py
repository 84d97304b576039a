"""Checkpoints and BatchNorm under DDP: what to save, where, and what the buffers do.

Teaches (lab 05), each run on live ranks:

- save on rank 0 only (every rank holds the same weights), with a barrier so
  no rank reads the file before it is complete; load with ``map_location`` so
  a tensor saved from ``cuda:0`` lands on this rank's device;
- ``ddp_model.state_dict()`` names every key ``module.<name>``;
  ``ddp_model.module.state_dict()`` does not, and is what a plain model loads;
- a resumed run equals an uninterrupted one only if the optimizer state (and
  the epoch, for the sampler) is saved too (``resume_gap``);
- ``torch.distributed.checkpoint`` (DCP): every rank saves and loads its
  part in parallel (files ``__<rank>_0.distcp`` and ``.metadata``), what
  sharded models (FSDP) need; replicated tensors are written once;
- BatchNorm's running statistics are BUFFERS, not gradients: DDP copies rank
  0's buffers to every rank at each forward (``broadcast_buffers``, renamed
  ``forward_sync_buffers`` in torch 2.13), else every rank keeps its own.

Leaves out: saving the RNG states of DataLoader workers, async and sharded
DCP planners, FSDP's state-dict types.

References: the PyTorch DDP tutorial's checkpointing section;
torch.distributed.checkpoint docs; torch/nn/parallel/distributed.py.
"""
from __future__ import annotations

import inspect


def sync_buffers_kwarg(enabled: bool) -> dict:
    """DDP's keyword for the per-forward buffer broadcast, in the installed torch's name."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    names = inspect.signature(DDP.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in names else "broadcast_buffers": enabled}


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def _batch(rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64)
    return x, x.sum(1, keepdim=True).sin()


def _train(model, opt, steps: range):
    import torch
    import torch.distributed as dist

    for step in steps:
        x, y = _batch(dist.get_rank(), step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(model.module[0].weight.device)),
                                     y.to(model.module[0].weight.device)).backward()
        opt.step()


def resume_on_rank(path: str, total: int = 6, stop: int = 3, save_optimizer: bool = True) -> dict:
    """Run on every rank: train ``total`` steps straight, and again stopping at ``stop``,
    saving (rank 0, then a barrier), rebuilding everything and loading; compare."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.pg.backend import device

    def fresh():
        model = DDP(_model().to(device()))
        return model, torch.optim.Adam(model.parameters(), lr=0.05)

    model, opt = fresh()
    _train(model, opt, range(total))
    straight = [p.detach().cpu().clone() for p in model.module.parameters()]

    model, opt = fresh()
    _train(model, opt, range(stop))
    if dist.get_rank() == 0:  # every rank holds the same weights: one writer is enough
        state = {"model": model.module.state_dict(), "step": stop}
        if save_optimizer:
            state["optimizer"] = opt.state_dict()
        torch.save(state, path)
    dist.barrier()  # nobody reads a half-written file
    keys_wrapper, keys_module = list(model.state_dict()), list(model.module.state_dict())

    model, opt = fresh()  # as a new process would: nothing left from before
    state = torch.load(path, map_location=device())
    model.module.load_state_dict(state["model"])
    if "optimizer" in state:
        opt.load_state_dict(state["optimizer"])
    _train(model, opt, range(state["step"], total))
    resumed = [p.detach().cpu().clone() for p in model.module.parameters()]
    gap = max(float((a - b).abs().max()) for a, b in zip(straight, resumed))
    return {"gap": gap, "keys_wrapper": keys_wrapper, "keys_module": keys_module}


def dcp_on_rank(directory: str) -> dict:
    """Run on every rank: save a DDP model with torch.distributed.checkpoint, load it back
    into a fresh model with other weights; which files were written, and are they equal?"""
    import os

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ddplab.pg.backend import device

    model = _model().to(device())
    dcp.save({"model": model.state_dict()}, checkpoint_id=directory)  # every rank takes part
    other = _model().to(device())
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    state = {"model": other.state_dict()}
    dcp.load(state, checkpoint_id=directory)  # in place, into the tensors given
    other.load_state_dict(state["model"])
    dist.barrier()
    equal = all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    return {"files": sorted(os.listdir(directory)), "equal": equal}


def bn_buffers_on_rank(sync: bool, steps: int = 3) -> dict:
    """Run on every rank: a BatchNorm net under torch DDP, each rank's data from its own
    distribution; return the running mean (a buffer) as BatchNorm's last forward found it,
    and the weights after ``steps``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.pg.backend import device

    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).double().to(device())
    model = DDP(net, **sync_buffers_kwarg(sync))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {}
    # what BatchNorm holds when its forward starts: after DDP's copy from rank 0, if any
    net[1].register_forward_pre_hook(lambda mod, args: seen.update(mean=mod.running_mean.clone()))
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = (torch.randn(8, 4, generator=g, dtype=torch.float64) + 3.0 * rank).to(device())
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return {"running_mean": seen["mean"].cpu(), "weight": net[0].weight.detach().cpu().clone()}


def syncbn_refusal() -> str:
    """What SyncBatchNorm says to a CPU tensor (run on a rank of a gloo group)."""
    import torch

    bn = torch.nn.SyncBatchNorm(3).double()
    try:
        bn(torch.randn(4, 3, dtype=torch.float64))
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def syncbn_eval_gap() -> float:
    """On a CPU rank of a gloo group: in eval, SyncBatchNorm synchronizes nothing and runs as a
    BatchNorm (torch 2.13 syncs only in training): the largest gap between the two outputs."""
    import torch

    torch.manual_seed(0)
    sync, plain = torch.nn.SyncBatchNorm(3).double(), torch.nn.BatchNorm1d(3).double()
    for bn in (sync, plain):
        bn.running_mean.fill_(0.5)
        bn.eval()
    x = torch.randn(4, 3, dtype=torch.float64)
    return float((sync(x) - plain(x)).abs().max())


def syncbn_on_gpu_rank() -> dict:
    """Run on every GPU rank: SyncBatchNorm normalizes with the statistics of ALL ranks' batches."""
    import torch
    import torch.distributed as dist

    from ddplab.pg.backend import device

    rank, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(5 + rank, 3, generator=g) + rank
    everyone = [torch.randn(5 + r, 3, generator=torch.Generator().manual_seed(r)) + r for r in range(p)]
    bn = torch.nn.SyncBatchNorm(3, momentum=1.0).to(device())
    bn.train()
    bn(x.to(device()))
    full = torch.cat(everyone)
    return {"running_mean": bn.running_mean.cpu(), "mean_of_all": full.mean(0)}
