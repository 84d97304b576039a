"""ddplab's reference FSDP against torch's fully_shard on 2 CPU ranks, with an A/A beside it.

    .venv/bin/python benchmarks/fsdp_vs_fully_shard.py            # 5 runs
    .venv/bin/python benchmarks/fsdp_vs_fully_shard.py --runs 7 --steps 30

Each run is one ``python -m ddplab compare --world-size 2 --strategies
ddp,fsdp,torch_fsdp2,torch_fsdp2_again`` (a fresh pair of ranks, steps
interleaved). ``torch_fsdp2_again`` is torch's ``fully_shard`` registered a
second time under another name (below): ``torch_fsdp2_again/torch_fsdp2``
is the A/A control, how far two identical strategies land apart in one run.
Printed: per run, step_ms of each and the ratios; then medians and ranges.
ddplab has no separate full FSDP: the reference is what is timed. Goal:
fsdp / torch_fsdp2 <= 1.10. Figures: docs/benchmarks.md.
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


@register_strategy("torch_fsdp2_again", shape="buckets")
def torch_fsdp2_again(module):
    """torch's fully_shard again: the A/A control"""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    for m in list(module.modules()):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            fully_shard(m)
    return fully_shard(module)


def one_run(steps: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "ddplab", "compare", "--world-size", "2",
           "--strategies", "ddp,fsdp,torch_fsdp2", "--steps", str(steps),
           "--strategy", f"{Path(__file__).resolve()}:torch_fsdp2_again", "--json", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.read_text())["strategies"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    ratios, aa, vs_ddp = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            s = one_run(args.steps, Path(tmp) / f"run{run}.json")
            ms = {k: v["step_ms"] for k, v in s.items()}
            ratios.append(ms["fsdp"] / ms["torch_fsdp2"])
            aa.append(ms["torch_fsdp2_again"] / ms["torch_fsdp2"])
            vs_ddp.append(ms["fsdp"] / ms["ddp"])
            print(f"run {run}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items())
                  + "; bytes/step: " + ", ".join(f"{k} {v.get('comm_bytes_per_step')}"
                                                   for k, v in s.items())
                  + f"; fsdp/torch_fsdp2 {ratios[-1]:.3f}, A/A {aa[-1]:.3f}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for name, xs in [("fsdp/torch_fsdp2", ratios), ("torch_fsdp2_again/torch_fsdp2 (A/A)", aa),
                     ("fsdp/ddp", vs_ddp)]:
        print(f"{name} median {statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f})"
              f" over {args.runs} runs")


if __name__ == "__main__":
    main()
