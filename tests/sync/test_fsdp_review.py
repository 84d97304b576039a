"""ddplab's FSDP and ZeRO-2 on what a reviewer brought: attention, mismatched ranks, no group.

On 2 gloo ranks whose models start from different weights: a transformer block
(nn.MultiheadAttention, LayerNorm, Linear) and nn.TransformerEncoderLayer,
wrapped with FSDP's default ``shard=`` (and the block with
``shard=(nn.MultiheadAttention,)``), train equal to one process and to
torch's ``fully_shard`` after every step (within 1e-6): MultiheadAttention is
one unit, out_proj in it. A module that reads a sharded child's weight without
calling it is named at the first forward, with the ``shard=`` to pass. Ranks
holding different models get a ValueError before any collective (gloo used to
abort a rank), in FSDP and ZeroTwo; a model with nothing to shard warns; no
process group is refused in words. ZeroTwo drives torch's StepLR equal to one
process, and its state dict loads back.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from _dtensor import full_tensor as _full_tensor
from torch import nn

from ddplab.sync import core
from ddplab.sync.core.zero2 import ZeroTwo

DIM, SEQ, ROWS, STEPS = 6, 3, 4, 3


class Block(nn.Module):
    """A pre-norm transformer block: attention and a Linear, each behind a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.ff = nn.Linear(DIM, DIM)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + torch.tanh(self.ff(self.norm2(x)))


def _model(kind, seed):
    torch.manual_seed(seed)
    if kind == "block":
        return Block()
    return nn.TransformerEncoderLayer(DIM, 2, dim_feedforward=5, dropout=0.0, batch_first=True)


def _batch(step, rank=None, world_size=None):
    g = torch.Generator().manual_seed(300 + step)
    x, y = torch.randn(ROWS, SEQ, DIM, generator=g), torch.randn(ROWS, SEQ, DIM, generator=g)
    if rank is None:
        return x, y
    n = ROWS // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _sgd(params):
    return torch.optim.SGD(list(params), lr=0.1, momentum=0.9)


DEFAULT = (nn.Linear, nn.Embedding, nn.MultiheadAttention)


def _three_runs(kind, shard=None):
    from torch.distributed.fsdp import fully_shard

    rank, ws = dist.get_rank(), dist.get_world_size()
    # the default shard= unless given; rank 0's weights win
    fsdp = core.FSDP(_model(kind, rank), **({"shard": shard} if shard else {}))
    units = sorted(type(u.module).__name__ for u in fsdp.units)
    one, theirs = _model(kind, 0), _model(kind, 0)
    for m in list(theirs.modules()):  # torch's units: the same ones, attention whole
        inside = any(m is c for a in theirs.modules() if isinstance(a, nn.MultiheadAttention)
                     for c in a.modules() if c is not a)
        if isinstance(m, shard or DEFAULT) and not inside:
            fully_shard(m)
    fully_shard(theirs)
    opts = [_sgd(fsdp.parameters()), _sgd(one.parameters()), _sgd(theirs.parameters())]
    worst_one = worst_torch = 0.0
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        x, y = _batch(step, rank, ws)
        nn.functional.mse_loss(fsdp(x), y).backward()
        fsdp.finish_gradient_synchronization()
        nn.functional.mse_loss(one(_batch(step)[0]), _batch(step)[1]).backward()
        nn.functional.mse_loss(theirs(x), y).backward()
        for opt in opts:
            opt.step()
        ours = fsdp.full_parameters()
        single = {n: p.detach() for n, p in one.named_parameters()}
        torch_ = {n: _full_tensor(p) for n, p in theirs.named_parameters()}
        assert ours.keys() == single.keys() == torch_.keys()
        for n in single:
            worst_one = max(worst_one, (ours[n] - single[n]).abs().max().item())
            worst_torch = max(worst_torch, (ours[n] - torch_[n]).abs().max().item())
    moved = max((single[n] - p).abs().max().item() for n, p in _model(kind, 0).named_parameters())
    return units, worst_one, worst_torch, moved


@pytest.mark.more
@pytest.mark.parametrize("kind, shard", [("block", None), ("encoder", None),
                                         ("block", (nn.MultiheadAttention,))])
def test_attention_models_train_equal_to_one_process_and_fully_shard(cluster2, kind, shard):
    for units, worst_one, worst_torch, moved in cluster2.run(_three_runs, kind, shard):
        assert units.count("MultiheadAttention") == 1 and (shard is None or units == [
            "MultiheadAttention"])
        assert "NonDynamicallyQuantizableLinear" not in units  # out_proj is inside attention
        assert moved > 1e-3  # the model trained
        assert worst_one <= 1e-6, worst_one
        assert worst_torch <= 1e-6, worst_torch


class ReadsChild(nn.Module):
    """Uses its child's weight without calling the child, as MultiheadAttention does."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x @ self.proj.weight.t()


def _misuses():
    rank, ws = dist.get_rank(), dist.get_world_size()
    out = {}
    fsdp = core.FSDP(nn.Sequential(ReadsChild(), nn.Linear(DIM, 2)))
    try:
        fsdp(torch.randn(2, DIM))
    except RuntimeError as e:
        out["read"] = str(e)
    try:
        core.FSDP(nn.Linear(DIM, 3 + rank))
    except ValueError as e:
        out["fsdp_models"] = str(e)
    try:
        ZeroTwo(nn.Linear(DIM, 3 + rank).parameters(), torch.optim.SGD, lr=0.1)
    except ValueError as e:
        out["zero2_models"] = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        core.FSDP(nn.Sequential(nn.Conv1d(2, 2, 1), nn.ReLU()))
    out["nothing"] = [str(w.message) for w in caught]
    # what needs no collective survived: the ranks are still in step
    dist.barrier()
    return ws, out


@pytest.mark.more
def test_misuses_are_refused_in_words_and_no_rank_aborts(cluster2):
    for ws, out in cluster2.run(_misuses):
        assert ws == 2
        assert "0.proj (Linear)" in out["read"] and "shard=(..., ReadsChild)" in out["read"]
        assert "different models" in out["fsdp_models"] and "weight" in out["fsdp_models"]
        assert "different models" in out["zero2_models"]
        assert len(out["nothing"]) == 1 and "sharded nothing" in out["nothing"][0]
        assert "shard=" in out["nothing"][0]


def test_no_process_group_is_refused_in_words():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"start one first \(dist.init_process_group"):
        core.FSDP(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"start one first \(dist.init_process_group"):
        ZeroTwo(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)


def _scheduled():
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    torch.manual_seed(0)
    one = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = ZeroTwo(model.parameters(), torch.optim.Adam, lr=0.1)
    ref = torch.optim.Adam(one.parameters(), lr=0.1)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.1) for o in (opt, ref)]
    worst, n, lrs = 0.0, 8 // ws, []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        opt.step()
        ref.zero_grad()
        nn.functional.mse_loss(one(x), y).backward()
        ref.step()
        lrs.append(opt.optim.param_groups[0]["lr"])  # the rate this step used
        for s in scheds:
            s.step()
        worst = max(worst, max((p - q).abs().max().item()
                               for p, q in zip(model.parameters(), one.parameters())))
    saved = opt.state_dict()
    again = ZeroTwo(model.parameters(), torch.optim.Adam, lr=0.5)
    again.load_state_dict(saved)
    same = (torch.equal(again.optim.state[again.master_slice]["exp_avg"],
                        opt.optim.state[opt.master_slice]["exp_avg"])
            and again.param_groups[0]["lr"] == opt.param_groups[0]["lr"])
    return worst, lrs, same


@pytest.mark.more
def test_zero2_follows_a_step_lr_schedule_equal_to_one_process(cluster2):
    for worst, lrs, same in cluster2.run(_scheduled):
        assert lrs == pytest.approx([0.1, 0.01, 0.001])  # the schedule reached the slice
        assert worst <= 1e-6, worst
        assert same
