"""Benchmark: step time of every strategy side by side, and what recording costs.

    python benchmarks/strategies.py [--params 2e7] [--steps 30] [--world-size 2]

Prints (1) the compare table for none, manual, bucketed and torch DDP on one
MLP, in ONE run with steps interleaved, and the ratios the docs quote
(bucketed / ddp, manual / bucketed); (2) recording overhead: BucketedDDP
with its recorder on vs off, interleaved in the same processes, as a ratio.
Figures go to docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import statistics
import time


def _recording_overhead(spec):
    import torch.distributed as dist

    from ddplab.measure.runners import StrategyRunner

    rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    on = StrategyRunner("bucketed", spec.replace(record=True), rank, world, backend)
    off = StrategyRunner("bucketed", spec.replace(record=False), rank, world, backend)
    times = {"on": [], "off": []}
    for i in range(spec.warmup + spec.steps):
        pair = [("on", on), ("off", off)] if i % 2 else [("off", off), ("on", on)]
        for name, r in pair:
            dist.barrier()
            t0 = time.perf_counter()
            r.step(i)
            if i >= spec.warmup:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=float, default=2e7)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1,
                   help="repeat the side-by-side run; ratios are reported per run and as a median")
    args = p.parse_args()

    import ddplab
    from ddplab.measure import RunSpec, compare, print_table
    from ddplab.placement.resources import usable_cpus

    with ddplab.Cluster(args.world_size) as c:
        print(f"machine: {usable_cpus()} usable CPUs, {args.world_size} gloo ranks, "
              f"{c.threads_per_rank} thread(s) per rank; MLP {args.params:.3g} params, "
              f"depth {args.depth}, batch {args.batch_size}/rank, {args.steps} steps")
        ratios = {"bucketed / ddp": [], "manual / bucketed": [], "traced ddp / untraced ddp": []}
        # torch's default cap: this benchmark compares with DDP as people run it
        spec = RunSpec("none,manual,bucketed,ddp", steps=args.steps, n_params=args.params,
                       depth=args.depth, batch_size=args.batch_size, bucket_cap_mb=25.0,
                       world_size=args.world_size)
        for k in range(args.repeats):
            r = compare(c, spec=spec)
            print(f"-- run {k + 1} of {args.repeats}")
            print_table(r)
            m = r.metrics
            ratios["bucketed / ddp"].append(m["bucketed"]["step_ms"] / m["ddp"]["step_ms"])
            ratios["manual / bucketed"].append(m["manual"]["step_ms"] / m["bucketed"]["step_ms"])
            ratios["traced ddp / untraced ddp"].append(m["ddp"]["traced_step_ms"] / m["ddp"]["step_ms"])
        for name, xs in ratios.items():
            print(f"{name} step time: median {statistics.median(xs):.3f} "
                  f"(runs: {', '.join(f'{x:.3f}' for x in xs)})")
        rec = c.run(_recording_overhead, spec.replace(strategies=("bucketed",)))[0]
        print(f"recording: bucketed step {rec['on']:.2f} ms with recorder, {rec['off']:.2f} ms "
              f"without: overhead {100 * (rec['on'] / rec['off'] - 1):+.1f}%")


if __name__ == "__main__":
    main()
