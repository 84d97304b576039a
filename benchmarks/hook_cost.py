"""What do the synchronization hooks cost per training step?

Runs the same MLP training step (forward, backward, synchronize, SGD) under
every strategy and prints the median step time per strategy and its ratio
to compute only ("none") and to torch's DDP:

    .venv/bin/python benchmarks/hook_cost.py                 # 1 and 2 ranks
    .venv/bin/python benchmarks/hook_cost.py --world-sizes 2 --width 1024 --layers 4

With ONE rank an all-reduce has nobody to talk to and returns at once, so
"strategy minus none" is the cost of the machinery itself: Python hooks,
copies into and out of bucket buffers, the division by the world size.
With two ranks it adds the real gloo all-reduce, which on a 2-core machine
shares the cores with backward (in flight is not the same as free).

Each step starts after a barrier so that the ranks start together; a step's
time is the slowest rank's; the first --warmup steps (torch DDP rebuilds
its buckets after its first iteration) are not counted. Strategies take
turns in rounds, so background load does not favour one of them.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ddplab  # noqa: E402

STRATEGIES = ["none", "manual", "manual_flat", "overlap", "bucketed", "ddp"]  # registry names


def _mlp(width, layers):
    import torch
    from torch import nn

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


def _setup(strategy, width, layers):
    """(module to call, function to run after backward, optimizer), built by ddplab's registry
    with each strategy's own defaults (BucketedDDP: 25 MB; torch DDP: torch's default)."""
    import torch

    from ddplab.sync.registry import build_strategy

    built = build_strategy(strategy, _mlp(width, layers))
    return built.model, built.after_backward, torch.optim.SGD(built.model.parameters(), lr=1e-3)


def _time_steps(strategies, width, layers, batch, warmup, steps, rounds):
    """Step times per strategy. Strategies take turns in ``rounds`` blocks,
    so a burst of background load hits them all alike."""
    import torch
    import torch.distributed as dist
    from torch import nn

    setups = {s: _setup(s, width, layers) for s in strategies}
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, width, generator=g)
    times = {s: [] for s in strategies}
    for r in range(rounds):
        for s, (net, after, opt) in setups.items():
            n_warm = warmup if r == 0 else 1
            for i in range(n_warm + steps):
                dist.barrier()
                t0 = time.perf_counter()
                nn.functional.mse_loss(net(x), y).backward()
                if after is not None:
                    after()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i >= n_warm:
                    times[s].append(time.perf_counter() - t0)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="rows per rank")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    a = ap.parse_args(argv)
    strategies = a.strategies.split(",")
    n_params = a.layers * (a.width * a.width + a.width)
    print(f"MLP {a.layers} x Linear({a.width}, {a.width}): {n_params / 1e6:.2f} M params, "
          f"{n_params * 4 / 2**20:.1f} MiB of float32 gradients; batch {a.batch} per rank; "
          f"median of {a.steps * a.rounds} steps in {a.rounds} interleaved rounds")
    for ws in (int(w) for w in a.world_sizes.split(",")):
        with ddplab.Cluster(world_size=ws) as c:
            per_rank = c.run(_time_steps, strategies, a.width, a.layers, a.batch, a.warmup,
                             a.steps, a.rounds)
            med = {}
            for s in strategies:
                slowest = [max(ts) for ts in zip(*(r[s] for r in per_rank))]
                med[s] = 1000 * statistics.median(slowest)
        print(f"\n{ws} rank(s), {c.threads_per_rank} thread(s) per rank"
              + ("  (one rank: no real communication)" if ws == 1 else ""))
        print(f"{'strategy':<12} {'step ms':>8} {'x none':>7} {'x ddp':>7} {'- none ms':>10}")
        for s in strategies:
            print(f"{s:<12} {med[s]:8.2f} {med[s] / med['none']:7.2f} "
                  f"{med[s] / med['ddp']:7.2f} {med[s] - med['none']:10.2f}")


if __name__ == "__main__":
    main()
