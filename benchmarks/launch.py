"""What does launching cost? Cluster start, job round trips, %%ddp, a 1 MB all-reduce.

    .venv/bin/python benchmarks/launch.py              # the figures in docs/benchmarks.md
    .venv/bin/python benchmarks/launch.py --quick      # fewer repetitions

Prints, on this machine:
- cluster start for 2 and 4 ranks: ``ddplab.Cluster(n)`` until every rank
  has joined the group (torch already imported in this process, as in a
  kernel that ran ``import torch``); each rank is a fresh interpreter that
  imports torch, which is most of the cost;
- a no-op job's round trip (``cluster.run(noop)``): pickle, two sockets,
  unpickle, and back;
- what ``%%ddp`` adds over a plain ``.run``: both go through IPython's
  ``run_cell``, alternating, on the same ranks; the magic adds argument
  parsing, compiling the cell, linecache and the recording for export;
- a 1 MB all-reduce (262,144 float32) as a job's round trip, and the
  all-reduce alone as timed on the ranks;
- for comparison, ``torchrun --standalone --nproc-per-node=2`` running a
  one-cell exported script, end to end: what every run pays without
  long-lived ranks (the agent and each rank import torch, then rendezvous).

Targets on a 2-core machine: start <= 1.5 s for 2 ranks, no-op <= 1 ms
median, %%ddp overhead <= 20 ms. Other processes on the machine move these
numbers (the load average is printed with them): compare medians of
several runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ddplab  # noqa: E402
from ddplab.placement import resources  # noqa: E402

MB_FLOATS = 2**20 // 4


def noop():
    return None


def all_reduce_1mb():
    import torch
    import torch.distributed as dist

    t = torch.ones(MB_FLOATS)
    t0 = time.perf_counter()
    dist.all_reduce(t)
    return time.perf_counter() - t0


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def start_times(world_size: int, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        cluster = ddplab.Cluster(world_size)
        times.append(time.perf_counter() - t0)
        cluster.shutdown()
    return times


def round_trips(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def torchrun_times(repeats: int) -> list[float]:
    from ddplab.notebook import export

    rec = export.Recording(2, backend="gloo")
    rec.add_cell("<ddp-cell-1>", "import torch.distributed as dist\ndist.barrier()\n")
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "one_cell.py"
        export.write_script(script, rec)
        for _ in range(repeats):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node=2", str(script)], check=True, capture_output=True)
            times.append(time.perf_counter() - t0)
    return times


def magic_overhead(n: int) -> tuple[float, float]:
    """Median cell time of ``%%ddp pass`` and of ``cluster.run(noop)``, alternating."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddplab.notebook.magics")
    shell.run_line_magic("ddp_start", "2")
    magics = shell.magics_manager.registry["DDPMagics"]
    shell.user_ns.update(cluster=magics.cluster, noop=noop)
    cells = {"ddp": "%%ddp\npass\n", "run": "cluster.run(noop);\n"}
    times = {k: [] for k in cells}
    for i in range(2 * n + 20):
        kind = "ddp" if i % 2 else "run"
        t0 = time.perf_counter()
        result = shell.run_cell(cells[kind], store_history=False, silent=True)
        elapsed = time.perf_counter() - t0
        result.raise_error()
        if i >= 20:  # warm-up: first compiles, first imports on the ranks
            times[kind].append(elapsed)
    shell.run_line_magic("ddp_stop", "")
    return statistics.median(times["ddp"]), statistics.median(times["run"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args(argv)
    starts, jobs = (2, 100) if args.quick else (5, 1000)

    import torch
    import torch.distributed  # noqa: F401 - a kernel has paid this import already

    print(f"torch {torch.__version__}, usable CPUs {resources.usable_cpus()}, "
          f"load average {os.getloadavg()[0]:.2f}, python {sys.version.split()[0]}")
    for n in (2, 4):
        t = start_times(n, starts)
        print(f"cluster start, {n} ranks: median {statistics.median(t):.2f} s, "
              f"min {min(t):.2f} s  ({starts} starts)")

    with ddplab.Cluster(2) as cluster:
        cluster.run(noop)
        t = sorted(round_trips(lambda: cluster.run(noop), jobs))
        print(f"no-op job round trip: median {ms(statistics.median(t))}, "
              f"p90 {ms(t[int(0.9 * len(t))])}  ({jobs} jobs)")
        for _ in range(5):
            cluster.run(all_reduce_1mb)  # warm-up: gloo connects, buffers allocate
        on_ranks = []
        t = round_trips(lambda: on_ranks.append(max(cluster.run(all_reduce_1mb))), jobs // 5)
        print(f"1 MB all-reduce, job round trip: median {ms(statistics.median(t))}; "
              f"all-reduce alone on the ranks: median {ms(statistics.median(on_ranks))}")

    ddp, run = magic_overhead(jobs // 5)
    print(f"%%ddp cell: median {ms(ddp)}; plain .run cell: median {ms(run)}; "
          f"%%ddp overhead: {ms(ddp - run)}")
    t = torchrun_times(starts)
    print(f"torchrun --standalone, 2 ranks, one-cell script end to end: median "
          f"{statistics.median(t):.2f} s, min {min(t):.2f} s  ({starts} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
