"""Models, data and training loops the sync tests run on every rank.

Everything here runs inside a rank (through ``Cluster.run``), in float64 so
that "equal" can mean equal to ~1e-12: the only differences between the
strategies, torch DDP and one process on the union of the data are the
order of additions and where the division by the world size happens, a few
ulps per step.
"""
from __future__ import annotations

import inspect
import time

import torch
import torch.distributed as dist
from torch import nn

from ddplab.sync import broadcast_parameters, comm
from ddplab.sync.registry import build_strategy

IN, OUT = 6, 3


class MLP(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.fc1 = nn.Linear(IN, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, OUT)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class FrozenTied(nn.Module):
    """A frozen weight (its bias still trains) and a weight used by two layers."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, 8)
        self.hidden = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.weight.requires_grad_(False)
        self.again = nn.Linear(8, 8, bias=False)
        self.again.weight = self.hidden.weight  # tied: one tensor, two uses
        self.head = nn.Linear(8, OUT)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.hidden(h))
        h = torch.tanh(self.frozen(h))
        h = torch.tanh(self.again(h))
        return self.head(h)


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, OUT)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: makes "the first layer's backward is slow"."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SlowFirstLayer(MLP):
    def __init__(self, seconds=0.3):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        h = SlowBackward.apply(torch.tanh(self.fc1(x)), self.seconds)
        return self.fc3(torch.tanh(self.fc2(h)))


MODELS = {"mlp": MLP, "frozen_tied": FrozenTied, "batchnorm": WithBatchNorm}


def make_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]().double()


def union_batch(step: int, rows: int):
    """The same batch on every rank (seeded by the step); each rank takes a slice."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, IN, generator=g, dtype=torch.float64)
    y = torch.randn(rows, OUT, generator=g, dtype=torch.float64)
    return x, y


def my_slice(t, rank, world_size):
    n = t.shape[0] // world_size
    return t[rank * n:(rank + 1) * n]


def wrap(strategy: str, model: nn.Module, **kw):
    """``(forward_model, after_backward)`` for a strategy name, built by ddplab's registry.

    ``"bucketed:CAP"`` is shorthand for ``bucketed`` with ``bucket_cap_mb=CAP``.
    """
    name, _, cap = strategy.partition(":")
    if cap:
        kw["bucket_cap_mb"] = float(cap)
    if name.startswith("manual"):  # by hand, the start is ours to broadcast
        broadcast_parameters(model)
    built = build_strategy(name, model, **kw)
    return built.model, built.after_backward or (lambda: None)


def torch_ddp(model: nn.Module, broadcast_buffers: bool = True):
    """torch's DDP, buffers synced at every forward or only at construction.

    torch 2.13 renamed ``broadcast_buffers`` to ``forward_sync_buffers`` (the
    old name warns, and when False also skips the buffer sync at construction).
    """
    kw = {}
    if not broadcast_buffers:
        params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
        kw = ({"forward_sync_buffers": False} if "forward_sync_buffers" in params
              else {"broadcast_buffers": False})
    return nn.parallel.DistributedDataParallel(model, **kw)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


def train_and_compare(strategy, kind, steps=4, per_rank=4, micro_steps=1, broadcast_buffers=True):
    """Train ``strategy``, torch DDP and (where it is comparable) one process
    on the union of the data side by side; after every step return how far
    the strategy's parameters and buffers are from each.

    Ranks start from DIFFERENT weights: the wrappers' broadcast from rank 0
    is part of what is checked. With ``micro_steps`` K > 1, each step is K
    micro-batches, the first K-1 inside ``no_sync()``, losses scaled by 1/K;
    the reference takes all K x world_size slices as one batch.
    """
    rank, ws = dist.get_rank(), dist.get_world_size()
    manual = strategy.startswith("manual")
    if manual:  # by hand there is no forward to hook: buffers are synced once, at the start
        broadcast_buffers = False
    ours_model = make_model(kind, seed=10 + rank)
    ours, after_backward = wrap(strategy, ours_model,
                                **({} if manual else {"broadcast_buffers": broadcast_buffers}))
    ddp = torch_ddp(make_model(kind, seed=10 + rank), broadcast_buffers)
    ref = make_model(kind, seed=10)  # rank 0's initial weights
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, ddp, ref)]
    loss_fn = nn.MSELoss()
    vs_ref, vs_ddp, grad_calls_inside = [], [], []
    for step in range(steps):
        x, y = union_batch(step, per_rank * ws * micro_steps)
        for k in range(micro_steps):
            chunk = slice(k * per_rank * ws, (k + 1) * per_rank * ws)
            xl, yl = my_slice(x[chunk], rank, ws), my_slice(y[chunk], rank, ws)
            last = k == micro_steps - 1
            with comm.counting() as c:
                ctx_ours = ours.no_sync() if not last else _null()
                ctx_ddp = ddp.no_sync() if not last else _null()
                with ctx_ours:
                    (loss_fn(ours(xl), yl) / micro_steps).backward()
                with ctx_ddp:
                    (loss_fn(ddp(xl), yl) / micro_steps).backward()
            if not last:
                grad_calls_inside.append(c.grad_calls)
        after_backward()
        loss_fn(ref(x), y).backward()
        for o in opts:
            o.step()
            o.zero_grad()
        vs_ddp.append(max_diff(ours_model, ddp.module))
        vs_ref.append(None if kind == "batchnorm" else max_diff(ours_model, ref))
    return {"vs_ref": vs_ref, "vs_ddp": vs_ddp, "grad_calls_inside_no_sync": grad_calls_inside}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def buffer_sync_per_forward(strategy: str, pattern: str) -> list:
    """Which forwards copied rank 0's buffers to this rank.

    Before every forward each rank poisons its BatchNorm running mean with
    ``100 * rank``; after the forward a value far below 90 on rank 1 means
    the forward started by broadcasting rank 0's buffers. ``pattern`` gives
    one letter per forward: ``n`` inside ``no_sync()``, ``s`` outside.
    """
    rank = dist.get_rank()
    model = make_model("batchnorm", seed=10)
    wrapped = torch_ddp(model) if strategy == "ddp" else wrap(strategy, model)[0]
    synced = []
    for i, mode in enumerate(pattern):
        x, _ = union_batch(i, 8)
        with torch.no_grad():
            model.bn.running_mean.fill_(100.0 * rank)
        with (wrapped.no_sync() if mode == "n" else _null()):
            wrapped(x).sum().backward()
        synced.append(bool(model.bn.running_mean.max().item() < 45.0))
    return synced
