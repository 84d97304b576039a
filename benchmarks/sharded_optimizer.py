"""ShardedOptimizer against torch's ZeroRedundancyOptimizer on 2 CPU ranks, with an A/A.

    .venv/bin/python benchmarks/sharded_optimizer.py             # 7 runs of 30 steps
    .venv/bin/python benchmarks/sharded_optimizer.py --runs 9 --steps 40

One pair of gloo ranks (a ``ddplab.Cluster``) trains three copies of the
same model under torch DDP with Adam, side by side in the same run and
interleaved step by step (so load hits all three alike): one with
``ddplab.ShardedOptimizer``, one with torch's ``ZeroRedundancyOptimizer``
(its defaults: one broadcast per parameter), and a second
``ZeroRedundancyOptimizer``, the A/A control: how far two identical
optimizers land apart in the same run, the noise floor the ratio must be
read against. Timed per step on each rank: the optimizer's ``step()`` (local
step and broadcasts) and the whole training step; the slower rank counts.
Printed: per run, the medians and the two ratios; then the median of each
ratio over the runs. Goal: sharded/torch_zero <= 1.05. Figures:
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIDTH, DEPTH, BATCH = 256, 6, 32
NAMES = ("sharded", "torch_zero", "torch_zero_again")


def _ranks_run(steps: int, warmup: int) -> dict:
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from ddplab.sync.core import ShardedOptimizer

    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    base = nn.Sequential(*layers)
    runs = {}
    for name in NAMES:
        model = nn.parallel.DistributedDataParallel(
            nn.Sequential(*[type(m)(WIDTH, WIDTH) if isinstance(m, nn.Linear) else m
                            for m in layers]))
        model.module.load_state_dict(base.state_dict())
        opt = (ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
               if name == "sharded" else
               ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3))
        runs[name] = (model, opt, [], [])
    g = torch.Generator().manual_seed(rank)
    for step in range(warmup + steps):
        x = torch.randn(BATCH, WIDTH, generator=g)
        order = NAMES if step % 2 == 0 else NAMES[::-1]
        for name in order:
            model, opt, step_s, total_s = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if step >= warmup:
                step_s.append(t2 - t1)
                total_s.append(t2 - t0)
    weights = [torch.cat([p.detach().reshape(-1) for p in runs[n][0].parameters()])
               for n in NAMES]
    return {"same_weights": all(torch.equal(w, weights[0]) for w in weights),
            **{n: (runs[n][2], runs[n][3]) for n in NAMES}}


def one_run(cluster, steps: int, warmup: int) -> dict:
    per_rank = cluster.run(_ranks_run, steps, warmup)
    assert all(r["same_weights"] for r in per_rank), "the three copies trained apart"
    out = {}
    for n in NAMES:  # per step, the slower rank's time
        step_s = [max(r[n][0][i] for r in per_rank) for i in range(steps)]
        total_s = [max(r[n][1][i] for r in per_rank) for i in range(steps)]
        out[n] = (statistics.median(step_s) * 1e3, statistics.median(total_s) * 1e3)
    return out


def main(argv=None):
    import ddplab

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f}; model: {DEPTH} x Linear({WIDTH}, "
          f"{WIDTH}), Adam, batch {BATCH} per rank, 2 gloo ranks")
    ratio = {"step": [], "total": []}
    aa = {"step": [], "total": []}
    with ddplab.Cluster(world_size=2) as cluster:
        for run in range(args.runs):
            ms = one_run(cluster, args.steps, args.warmup)
            for i, what in enumerate(("step", "total")):
                ratio[what].append(ms["sharded"][i] / ms["torch_zero"][i])
                aa[what].append(ms["torch_zero_again"][i] / ms["torch_zero"][i])
            print(f"run {run}: optimizer.step() ms " + ", ".join(
                f"{n} {ms[n][0]:.2f}" for n in NAMES) + "; whole step ms " + ", ".join(
                f"{n} {ms[n][1]:.2f}" for n in NAMES) +
                f"; sharded/torch_zero step {ratio['step'][-1]:.3f} whole "
                f"{ratio['total'][-1]:.3f}; A/A step {aa['step'][-1]:.3f} whole "
                f"{aa['total'][-1]:.3f}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for what, label in (("step", "optimizer.step()"), ("total", "whole training step")):
        r, a = ratio[what], aa[what]
        print(f"{label}: sharded/torch_zero median {statistics.median(r):.3f} "
              f"(min {min(r):.3f}, max {max(r):.3f}); A/A torch_zero_again/torch_zero median "
              f"{statistics.median(a):.3f} (min {min(a):.3f}, max {max(a):.3f}) over "
              f"{args.runs} runs")


if __name__ == "__main__":
    main()
