"""BucketedDDP against torch's DDP on compare's default run, with the A/A spread beside it.

    .venv/bin/python benchmarks/bucketed_vs_ddp.py            # 7 interleaved runs
    .venv/bin/python benchmarks/bucketed_vs_ddp.py --runs 9 --steps 30

Each run is one ``python -m ddplab compare --world-size 2 --strategies
none,manual,bucketed,ddp,ddp_again --steps 30`` (a fresh pair of ranks).
``ddp_again`` is torch's DDP built a second time under another name
(defined below), so ``ddp_again/ddp`` shows how far two identical
strategies land apart in the same run: the noise floor any ratio must be
read against. Printed: per run, step_ms of each strategy and the two
ratios; then the median of each ratio and the A/A range. Both wrappers get
compare's default cap (2 MB), and BucketedDDP now lays its buckets out as
torch does (``ddplab.sync.bucket``), so ``n_buckets`` is printed too:
unequal counts would mean unlike layouts. Figures: docs/benchmarks.md.
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
    from ddplab.sync.registry import Built, register_strategy
except ImportError:  # run as a script from elsewhere: the ranks load this file by value
    sys.path.insert(0, str(ROOT))
    from ddplab.sync.registry import Built, register_strategy


@register_strategy("ddp_again", shape="torch_ddp", time_unrecorded=True)
def ddp_again(module, bucket_cap_mb=None, process_group=None, device_ids=None):
    """torch's DistributedDataParallel again: the A/A control"""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return Built(DDP(module, bucket_cap_mb=bucket_cap_mb, device_ids=device_ids,
                     process_group=process_group))


def one_run(steps: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "ddplab", "compare", "--world-size", "2",
           "--strategies", "none,manual,bucketed,ddp", "--steps", str(steps),
           "--strategy", f"{Path(__file__).resolve()}:ddp_again", "--json", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.read_text())["strategies"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    ratios, aa = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            s = one_run(args.steps, Path(tmp) / f"run{run}.json")
            ms = {k: v["step_ms"] for k, v in s.items()}
            ratios.append(ms["bucketed"] / ms["ddp"])
            aa.append(ms["ddp_again"] / ms["ddp"])
            print(f"run {run}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items())
                  + f"; buckets: bucketed {s['bucketed'].get('n_buckets')}, "
                  f"ddp {s['ddp'].get('n_buckets')}; bucketed/ddp {ratios[-1]:.3f}, "
                  f"ddp_again/ddp {aa[-1]:.3f}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"bucketed/ddp median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {args.runs} runs")
    print(f"ddp_again/ddp (A/A) median {statistics.median(aa):.3f} "
          f"(min {min(aa):.3f}, max {max(aa):.3f})")


if __name__ == "__main__":
    main()
