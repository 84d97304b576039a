"""What only a machine with two or more GPUs can show: a prepared run, never run yet.

    python3 tools/gpu_check_multi.py --wheels DIR     # or --python PY where the packages are there
    python3 tools/gpu_check_multi.py --dry-run

One GPU allows one NCCL rank (NCCL refuses two ranks on one GPU), so at world
size 1 every all-reduce is a local no-op and ``make gpu-check`` times the hook
and bucket machinery only. With N >= 2 GPUs (N = min(4, GPUs seen)) this run
shows, one step at a time, each under its own limit, in one table like
``tools/gpu_check.py`` (logs under ``$OUT`` when set):

1. ``gpu tests``: ``pytest -m gpu tests``, now with the tests that need 2 GPUs;
2. ``labs ws2``: every lab under nbval at ``DDPLAB_WORLD_SIZE=2`` over NCCL;
3. ``transfers``: ``compare`` at world size N over NCCL: real transfers between
   ranks, device-timed, each longer than zero, with the bytes and bus bandwidth;
4. ``overlap``: the same run's ``overlap_pct`` for ``bucketed`` and ``ddp`` (how much of
   the transfer time backward's compute hid) and ``exposed_comm_ms``;
5. ``straggler``: ``compare --straggler 1:2.0``: the other ranks' wait grows while
   rank 1 computes twice as long (``wait_ms_by_rank``);
6. ``record``: ``examples/record_my_run.py`` under torchrun on N GPUs;
7. ``ring``: lab 00's ring on 3 NCCL ranks (needs 3 GPUs): ddplab's batched ring
   graded for NCCL, then, under plain torch with eager init (``device_id``), a
   ring of separately called ``isend``/``irecv`` (the form lab 00 says is not safe
   on NCCL) with a 60 s limit: does torch print its eager-init serialization
   warning, and does the ring finish or hang? The row says which; lab 00's claim
   (docs/facts.md, cell-10w) is then measured, not only read.

Leaves out: several nodes, NVLink against PCIe (``nvidia-smi topo -m`` says
which this machine has: the log records it), and bandwidth sweeps.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import ROOT, Runner, Step, install  # noqa: E402
from gpu_check_judge import judge_transfers, pytest_figure  # noqa: E402
from gpu_check_steps import judge_trace  # noqa: E402

PLAN = [
    Step("install", 40, "as make gpu-check: venv over the system's torch, wheels only"),
    Step("gpu tests", 150, "DDPLAB_REQUIRE_DEVICE_GRADS=1 pytest -m gpu tests (2-GPU tests included)"),
    Step("labs ws2", 300, "DDPLAB_WORLD_SIZE=2 pytest --nbval-lax labs/*.ipynb"),
    Step("transfers", 60, "compare --world-size N --backend nccl: device-timed transfers between ranks"),
    Step("overlap", 5, "the same run: overlap_pct and exposed_comm_ms of bucketed and ddp"),
    Step("straggler", 60, "compare --straggler 1:2.0: the others' wait grows"),
    Step("record", 40, "torchrun --nproc-per-node N examples/record_my_run.py"),
    Step("ring", 120, "lab 00's ring on 3 NCCL ranks; unbatched isend/irecv under eager init"),
]

# A ring of separately called isend/irecv on plain torch with eager init, one process per GPU.
UNBATCHED_RING = r'''
import os, torch, torch.distributed as dist
rank, p = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)  # eager init, as docs/pitfalls.md recommends
t = torch.full((1 << 22,), float(rank + 1), device=dev)  # 16 MiB: more than NCCL buffers
chunks = torch.tensor_split(t, p)
for phase in (0, 1):
    for s in range(p - 1):
        out, into = chunks[(rank - s + phase) % p], chunks[(rank - s - 1 + phase) % p]
        buf = torch.empty_like(into)
        works = [dist.isend(out.contiguous(), (rank + 1) % p), dist.irecv(buf, (rank - 1) % p)]
        for w in works:
            w.wait()
        into.copy_(buf) if phase else into.add_(buf)
torch.cuda.synchronize()
assert torch.all(t == p * (p + 1) / 2), t[:4]
print(f"UNBATCHED-RING rank {rank}: finished, sum right")
dist.destroy_process_group()
'''

BATCHED_RING_GRADED = r'''
import ddplab
from ddplab import checks
from ddplab.lessons import ring
with ddplab.Cluster(3, backend="nccl", timeout=10) as cluster:
    assert cluster.backend == "nccl", cluster.backend
    checks.check_ring_all_reduce(cluster, ring.ring_all_reduce, backend="nccl")
    print("BATCHED-RING passed on 3 NCCL ranks")
'''


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", default=os.environ.get("WHEELS"))
    ap.add_argument("--python", default=None, help="use this python as it is: no venv, no install")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--budget", type=float, default=sum(s.limit_s for s in PLAN))
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        for s in PLAN:
            print(f"  {s.name:10s} <= {s.limit_s:3d} s  {s.what}")
        return 0
    python = args.python or sys.executable
    probe = subprocess.run([python, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True)
    gpus = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
    if gpus < 2:
        print(f"gpu_check_multi needs 2 or more GPUs; {python} sees {gpus}. One GPU: make gpu-check.",
              file=sys.stderr)
        return 2
    if not args.python and not args.wheels:
        print("pass --wheels DIR (tools/gpu_check.py --requirements) or --python PY", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    runner = Runner(python, out, Path(tempfile.mkdtemp(prefix="ddplab-gpu-multi-")), args.budget)
    steps = {s.name: s for s in PLAN}
    if not args.python and not runner.step(steps["install"], lambda lim: install(runner, Path(args.wheels), lim)):
        print(runner.table())
        return 1
    n = min(4, gpus)
    runner.sh(["nvidia-smi", "topo", "-m"], 10)  # NVLink or PCIe: in the log
    work = runner.work
    py = lambda: runner.python  # noqa: E731
    result = {}

    def gpu_tests(limit):
        rc, text = runner.sh([py(), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu", "tests"],
                             limit, env={"DDPLAB_REQUIRE_DEVICE_GRADS": "1"})
        return rc == 0, pytest_figure(text)

    def labs(limit):
        notebooks = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "labs").glob("*.ipynb"))
        rc, text = runner.sh([py(), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                              "--nbval-current-env", "--nbval-sanitize-with", "labs/nbval-sanitize.cfg",
                              *notebooks], limit, env={"DDPLAB_WORLD_SIZE": "2", "DDPLAB_REQUIRE_DEVICE_GRADS": "1"})
        return rc == 0, pytest_figure(text)

    def compare(name, extra, limit):
        js, trace = work / f"{name}.json", work / f"{name}.trace.json"
        rc, _ = runner.sh([py(), "-m", "ddplab", "compare", "--world-size", str(n), "--backend", "nccl",
                           "--strategies", "none,manual,bucketed,ddp", "--steps", "10", "--params", "5e7",
                           "--json", str(js), "--trace", str(trace), *extra], limit)
        if rc != 0:
            return None, None
        if out:
            (out / f"{name}.json").write_text(js.read_text())
        return json.loads(js.read_text()), json.loads(trace.read_text())

    def transfers(limit):
        doc, trace = compare("transfers", [], limit)
        if doc is None:
            return False, "compare failed"
        result["transfers"] = doc
        ok, figure = judge_trace(trace)
        bus = doc["strategies"]["ddp"].get("busbw_GBps")
        return ok, f"{n} ranks: {figure}; ddp bus bandwidth {bus} GB/s"

    def overlap(limit):
        doc = result.get("transfers")
        if doc is None:
            return False, "no transfers run"
        rows = {k: doc["strategies"][k] for k in ("bucketed", "ddp")}
        return all((r.get("overlap_pct") or 0) > 0 for r in rows.values()), "; ".join(
            f"{k} overlap {r.get('overlap_pct')}%, exposed {r.get('exposed_comm_ms')} ms" for k, r in rows.items())

    def straggler(limit):
        doc, _ = compare("straggler", ["--straggler", "1:2.0"], limit)
        if doc is None:
            return False, "compare failed"
        waits = doc["strategies"]["ddp"].get("wait_ms_by_rank")
        base = result.get("transfers", {}).get("strategies", {}).get("ddp", {}).get("wait_ms_by_rank")
        grew = bool(waits and base) and waits[0] > base[0]
        return grew, f"ddp wait by rank {waits} (without the straggler {base})"

    def record(limit):
        rc, _ = runner.sh([py(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                           "examples/record_my_run.py", "--out", str(work / "run")], limit)

        if rc != 0 or not (work / "run.json").exists():
            return False, f"torchrun exited {rc}"
        return judge_transfers(json.loads((work / "run.json").read_text()), need_after_ready=True)

    def ring(limit):
        if gpus < 3:
            return False, f"needs 3 GPUs, {gpus} here: not run"
        rc, text = runner.sh([py(), "-c", BATCHED_RING_GRADED], limit / 2)
        batched = rc == 0 and "BATCHED-RING passed" in text
        script = work / "unbatched_ring.py"
        script.write_text(UNBATCHED_RING)
        rc, text = runner.sh([py(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                              str(script)], min(60, limit / 2))
        warned = "serialized with all other ops" in text
        state = "hung (ended at 60 s)" if rc is None else ("finished" if text.count("sum right") == 3 else f"exit {rc}")
        return batched, (f"batched ring graded for NCCL: {'passed' if batched else 'FAILED'}; unbatched "
                         f"isend/irecv ring under eager init: {state}, serialization warning "
                         f"{'printed' if warned else 'not printed'}")

    for name, fn in [("gpu tests", gpu_tests), ("labs ws2", labs), ("transfers", transfers),
                     ("overlap", overlap), ("straggler", straggler), ("record", record), ("ring", ring)]:
        runner.step(steps[name], fn)
    text = runner.table()
    print(text)
    if out:
        (out / "gpu-check-multi.txt").write_text(text + "\n")
    return 0 if all(r[1] == "ok" for r in runner.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
