"""FSDP with prefetch against the reference FSDP and torch's fully_shard, on a simulated link.

    .venv/bin/python benchmarks/fsdp_overlap.py            # 5 runs of 10 steps, batch 128
    .venv/bin/python benchmarks/fsdp_overlap.py --runs 7 --steps 20 --link 10gbe

Each run is one ``python -m ddplab compare --world-size 2 --link 1gbe --strategies
fsdp,fsdp_overlap,torch_fsdp2`` plus ``fsdp_overlap_again`` (registered below: the same
OverlapFSDP under a second name, the A/A control): a fresh pair of gloo ranks, the four
strategies' steps interleaved, over a SIMULATED 1 Gb Ethernet link (ddplab.netsim: the real
collectives run, each all-gather and reduce-scatter completes no earlier than the link's
ring model says for its full size, one queue per rank).

Why batch 128 on 1 GbE. Overlap can hide at most the smaller of a unit's link time and its
compute. The link's time per all-gather of a big layer (1e6 parameters, 4 MB) is about 15 ms
on 1 GbE; the layer's forward at batch 32 computes in about 3 ms (traced on this machine), so
at batch 32 the forward is link-bound and prefetch hides almost nothing there. The ratio of
link to compute is roughly (CPU FLOP/s) / (batch x link bytes/s) and does not change with
depth; at batch 128 a big layer's forward (23 ms traced, load 8) is no shorter than its
all-gather's 15 ms, so the next layer's weights arrive while it computes.
A faster link (10gbe: 1.5 ms an all-gather) balances at a batch of about 16, but then the
whole step's link time is about 10 ms out of a step of hundreds of ms on this shared machine:
the effect would sit inside the A/A's spread. Printed: per run, step_ms of each and the
ratios; then medians and ranges, with the load average before and after. Targets:
fsdp_overlap / torch_fsdp2 <= 1.10 and fsdp_overlap / fsdp < 1. Figures: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

try:
    from ddplab.sync.registry import register_strategy
except ImportError:  # run as a script from elsewhere: the ranks load this file by value
    sys.path.insert(0, str(ROOT))
    from ddplab.sync.registry import register_strategy


@register_strategy("fsdp_overlap_again", shape="buckets")
def fsdp_overlap_again(module, process_group=None):
    """ddplab's OverlapFSDP again: the A/A control"""
    from ddplab.sync.fsdp_overlap import OverlapFSDP

    model = OverlapFSDP(module, process_group=process_group)
    return model, model.finish_gradient_synchronization


def one_run(args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "ddplab", "compare", "--world-size", "2",
           "--strategies", "fsdp,fsdp_overlap,torch_fsdp2", "--steps", str(args.steps),
           "--link", args.link, "--params", str(args.params), "--depth", str(args.depth),
           "--batch-size", str(args.batch_size),
           "--strategy", f"{Path(__file__).resolve()}:fsdp_overlap_again", "--json", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.read_text())["strategies"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--link", default="1gbe")
    ap.add_argument("--params", default="2e6")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=128)
    args = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f}; link {args.link}, "
          f"{args.params} parameters in {args.depth} layers, batch {args.batch_size}")
    ratios = {"fsdp_overlap/torch_fsdp2": [], "fsdp_overlap/fsdp": [],
              "fsdp_overlap_again/fsdp_overlap (A/A)": [], "fsdp/torch_fsdp2": []}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            s = one_run(args, Path(tmp) / f"run{run}.json")
            ms = {k: v["step_ms"] for k, v in s.items()}
            for name, xs in ratios.items():
                a, b = name.split(" ")[0].split("/")
                xs.append(ms[a] / ms[b])
            print(f"run {run}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()) + "; "
                  + ", ".join(f"{k} {v[-1]:.3f}" for k, v in ratios.items())
                  + f"; load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for name, xs in ratios.items():
        print(f"{name} median {statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f})"
              f" over {args.runs} runs")


if __name__ == "__main__":
    main()
