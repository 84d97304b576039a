"""ZeRO stage 2 (ddplab.sync.core.zero2): the paper's reduce-scatter, step, all-gather.

After EVERY step, on 2 and 3 gloo ranks whose models start from different
weights and whose parameter count does not divide by the world size (a
padded slice): the weights equal single-process Adam on the union of the
ranks' batches (float64 off: float32, within 1e-6). On the ranks of
``memory.measure``: what a rank holds (parameters whole; gradients, state and
its float32 copy a 1/N slice) and what it hands the group equal ``fits``'s
predictions exactly, the peak within 10 %, and its ring bytes equal DDP's
(torch's ZeroRedundancyOptimizer behind DDP sends 1.5x).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddplab.measure import fits
from ddplab.measure.memory import default_model, measure_on
from ddplab.sync.core.zero2 import ZeroTwo

pytestmark = [pytest.mark.slow, pytest.mark.more]
STEPS = 4


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3))  # 35 + 24 = 59 elements


def _batch(step):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(12, 4, generator=g), torch.randn(12, 3, generator=g)


def _zero2_and_one_process():
    rank, ws = dist.get_rank(), dist.get_world_size()
    model, one = _model(rank), _model(0)
    opt = ZeroTwo(model.parameters(), torch.optim.Adam, lr=0.05)
    ref = torch.optim.Adam(one.parameters(), lr=0.05)
    worst, n = 0.0, 12 // ws
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        opt.step()
        ref.zero_grad()
        nn.functional.mse_loss(one(x), y).backward()
        ref.step()
        worst = max(worst, max((p - q).abs().max().item()
                               for p, q in zip(model.parameters(), one.parameters())))
    padded = opt.n * ws != sum(p.numel() for p in model.parameters())
    return worst, padded, all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("world", ["cluster2", "cluster3"])
def test_zero2_equals_one_process_after_every_step(world, request):
    for worst, padded, freed in request.getfixturevalue(world).run(_zero2_and_one_process):
        assert padded  # 59 elements: the last slice is padded at 2 and 3 ranks
        assert worst <= 1e-6, worst
        assert freed  # a rank keeps its slice's gradient only


def test_zero2_holds_and_sends_what_fits_predicts_and_ring_bytes_equal_ddps(cluster2):
    rows = ("ddp", "zero2")  # zero1's measured rows: tests/measure/test_fits.py and lab 11
    measured = {(m["row"], m["rank"]): m for m in measure_on(cluster2, rows)}
    model, ws = default_model(), 2
    ring = {row: fits.ring_bytes(fits.predict_calls(model, ws, row), ws)
            for row in ("ddp", "zero1", "zero2")}
    for row in rows:
        for rank in range(ws):
            m = measured[row, rank]
            assert m["sent_by_op"] == fits.predict_bytes(model, ws, row), row
            pred = fits.predict_memory(model, ws, torch.randn(16, 256), row, rank=rank)
            for f in ("params", "grads", "optimizer_state"):
                assert m[f] == pred[f], (row, f, m[f], pred[f])
            assert abs(pred["peak"] / m["peak"] - 1) <= 0.10, (row, pred["peak"], m["peak"])
    assert ring["zero2"] == ring["ddp"] and ring["zero1"] == 1.5 * ring["ddp"]
    ddp, z2 = measured["ddp", 0], measured["zero2", 0]
    assert z2["grads"] * ws == ddp["grads"] and z2["params"] == ddp["params"]
