"""Eight cases where the strategies once parted from torch DDP, as models and training steps that run on every rank.

Each case is a model and a step (what the learner's loop does with it). ``train``
runs a strategy, torch's DistributedDataParallel and one process side by
side, in float64, ranks starting from DIFFERENT weights, SGD with momentum,
and after every step returns how far the strategy is from each and every
rank's parameters (so a test can see replicas drift apart). A strategy or
torch that raises is recorded with the step it raised at.

The one-process reference runs each rank's slice through the model
separately and averages the losses: the same gradient as the union batch
for these models, and also right when the data decides the graph (case 3)
or when a BatchNorm normalizes per slice (cases 5 and 6).
"""
from __future__ import annotations

import contextlib
import dataclasses

import _sync_helpers as H
import torch
import torch.distributed as dist
import torch.utils.checkpoint as cp
from torch import nn

from ddplab.netsim import LinkModel
from ddplab.netsim.simulated import SimulatedLink
from ddplab.sync import comm

IN, OUT = H.IN, H.OUT
# Slow enough that every all-reduce of a step is still in flight when the
# next one starts: 20 ms latency, 1 Mbit/s (a few hundred bytes take ms).
SLOW_LINK = LinkModel(0.001, 20_000.0, "slow test link")


# -- 1: a parameter whose gradient hook fires twice in one backward ---------------------
class ReusedInCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 8)
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, OUT)

    def _inner(self, h):
        return torch.tanh(self.shared(h))

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = cp.checkpoint(self._inner, h, use_reentrant=True)  # nested backward: hook 1
        h = torch.tanh(self.shared(h))  # the same layer outside: hook 2
        return self.head(h)


# -- 2: an exception inside backward, caught, then training goes on ---------------------
class Boom(torch.autograd.Function):
    """Identity whose backward raises when ``fail`` is True."""

    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise ValueError("boom inside backward")
        return grad, None


class FailsMidBackward(H.MLP):
    fail = False

    def forward(self, x):
        h = Boom.apply(torch.tanh(self.fc1(x)), self.fail)  # fc3, fc2 have launched by then
        return self.fc3(torch.tanh(self.fc2(h)))


class FailsBeforeAnyHook(H.MLP):
    """The exception comes before any parameter's gradient: nothing was launched."""
    fail = False

    def forward(self, x):
        return Boom.apply(super().forward(x), self.fail)


# -- 3: the data decides the order of two same-shaped layers ----------------------------
class DataDependentOrder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, OUT)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        first, second = (self.a, self.b) if x[:, 0].sum() > 0 else (self.b, self.a)
        return self.head(torch.tanh(second(torch.tanh(first(h)))))


# -- 4: reentrant activation checkpointing around the last layers ------------------------
class CheckpointedTail(H.MLP):
    def _tail(self, h):
        return self.fc3(torch.tanh(self.fc2(h)))

    def forward(self, x):
        return cp.checkpoint(self._tail, torch.tanh(self.fc1(x)), use_reentrant=True)


# -- 7: find_unused_parameters with a dataclass output -----------------------------------
@dataclasses.dataclass
class Prediction:
    value: torch.Tensor
    aux: torch.Tensor


class DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(IN, 8)
        self.head = nn.Linear(8, OUT)
        self.branch = nn.Linear(8, OUT)  # used on some steps only
        self.aux_head = nn.Linear(8, 1)

    def forward(self, x, use_branch=True):
        h = torch.tanh(self.trunk(x))
        out = self.head(h) + (self.branch(h) if use_branch else 0)
        return Prediction(value=out, aux=self.aux_head(h))


# -- 8: nn.Embedding(sparse=True) ---------------------------------------------------------
class SparseEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.head = nn.Linear(4, OUT)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x).mean(dim=1)))


MODELS = {"reused_in_checkpoint": ReusedInCheckpoint, "fails_mid_backward": FailsMidBackward,
          "fails_before_any_hook": FailsBeforeAnyHook,
          "data_dependent_order": DataDependentOrder, "checkpointed_tail": CheckpointedTail,
          "batchnorm": H.WithBatchNorm, "dataclass_out": DataclassOut, "sparse": SparseEmbedding}


def batch(case, step, rows, ws):
    x, y = H.union_batch(step, rows)
    if case == "data_dependent_order":  # even ranks' slices one order, odd ranks' the other
        n = rows // ws
        for r in range(ws):
            x[r * n:(r + 1) * n, 0] = x[r * n:(r + 1) * n, 0].abs() * (1 if r % 2 == 0 else -1)
    if case == "sparse":  # 3 token ids per row, drawn from 20
        g = torch.Generator().manual_seed(500 + step)
        x = torch.randint(0, 20, (rows, 3), generator=g)
    return x, y


def step_loss(case, model, x, y, step, rank):
    """The learner's forward(s) for one step; returns the loss to call backward on."""
    mse = nn.functional.mse_loss
    if case == "batchnorm":  # case 5: two forwards before one backward
        half = x.shape[0] // 2
        return mse(model(x[:half]), y[:half]) + mse(model(x[half:]), y[half:])
    if case == "dataclass_out":
        out = model(x, use_branch=(step + rank) % 2 == 0)
        return mse(out.value, y) + out.aux.pow(2).mean()
    return mse(model(x), y)


def evaluate(case, model, x, rank):
    """Case 6: a different number of no_grad evaluation forwards on each rank."""
    if case != "batchnorm_eval":
        return None
    outs = []
    model.eval()
    with torch.no_grad():
        for _ in range(3 if rank == 0 else 2):
            outs.append(model(x))
    model.train()
    return outs[0]


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _attempt(fn):
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return None, f"{type(e).__name__}: {e}"


def train(case, strategy, steps=4, ours_kw=None, torch_kw=None, slow_link=False, lr=0.1):
    """Train ``strategy`` (a name for ``_sync_helpers.wrap``), torch DDP and one
    process on ``case`` side by side; see the module docstring."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    kind = "batchnorm" if case == "batchnorm_eval" else case
    momentum = 0.0 if case == "sparse" else 0.9

    def build(seed):
        torch.manual_seed(seed)
        return MODELS[kind]().double()

    ours_model = build(10 + rank)
    ours, after_backward = H.wrap(strategy, ours_model, **(ours_kw or {}))
    ddp = nn.parallel.DistributedDataParallel(build(10 + rank), **(torch_kw or {}))
    ref = build(10)
    models = {"ours": ours, "ddp": ddp, "ref": ref}
    opts = {k: torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum)
            for k, m in models.items()}
    out = {"errors": {}, "vs_ddp": [], "vs_ref": [], "params": [], "eval_diff": []}
    per_rank = 4
    # the link lives in the choke point (comm.using_link), as compare() puts it; close() ends its thread
    link = SimulatedLink(SLOW_LINK, ws) if slow_link else None
    with link or contextlib.nullcontext(), comm.using_link(link):
        for step in range(steps):
            x, y = batch(case, step, per_rank * ws, ws)
            xl, yl = H.my_slice(x, rank, ws), H.my_slice(y, rank, ws)
            failing = case.startswith("fails_")
            if failing:  # every rank raises inside backward at step 1
                for m in (ours_model, ddp.module, ref):
                    m.fail = step == 1
            for who in ("ours", "ddp"):
                if who in out["errors"]:
                    continue
                m = models[who]

                def one_step(m=m, who=who):
                    step_loss(case, m, xl, yl, step, rank).backward()  # noqa: B023 (called at once)
                    if who == "ours":
                        after_backward()

                _, err = _attempt(one_step)
                if err is not None:
                    out["errors"][who] = (step, err)
                    if "boom inside backward" in err:  # the learner catches it and goes on
                        del out["errors"][who]
            if not failing or step != 1:
                ref_loss = sum(step_loss(case, ref, H.my_slice(x, r, ws), H.my_slice(y, r, ws),
                                         step, r) for r in range(ws)) / ws
                ref_loss.backward()
            for k, o in opts.items():
                if k not in out["errors"] and not (failing and step == 1):
                    o.step()
                o.zero_grad()
            if "ours" in out["errors"]:
                break
            eval_ours = evaluate(case, ours, xl, rank)
            eval_ddp = None if "ddp" in out["errors"] else evaluate(case, ddp, xl, rank)
            if eval_ours is not None and eval_ddp is not None:
                out["eval_diff"].append((eval_ours - eval_ddp).abs().max().item())
            out["vs_ddp"].append(float("nan") if "ddp" in out["errors"]
                                 else H.max_diff(ours_model, ddp.module))
            vs_ref = (_flat(ours_model) - _flat(ref)).abs().max().item()  # parameters only
            out["vs_ref"].append(vs_ref)
            out["params"].append(_flat(ours_model))
    return out
