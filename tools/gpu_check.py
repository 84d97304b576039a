"""``make gpu-check``: the one prepared run for a machine with one GPU and no package registry.

    python3 tools/gpu_check.py --wheels DIR     # make gpu-check WHEELS=DIR
    python3 tools/gpu_check.py --dry-run        # the plan, its limits, and what it would run
    python3 tools/gpu_check.py --requirements   # what the wheel folder must hold (besides torch)

It uses the CUDA build of torch already on the machine (never the CPU pin),
makes a venv over the system's packages (``.venv-gpu``), installs ddplab and
its lab and test packages from the wheel folder only (``pip --no-index
--find-links DIR``; nothing else is installed by hand), then runs, ONE STEP
AT A TIME (one GPU, one lock: two ddplab Clusters never share it), each
step under its own time limit, all within ``--budget`` seconds (8 minutes):

1. ``doctor``: what ddplab sees (GPUs, backend, who holds which GPU);
2. ``gpu tests``: ``pytest -m gpu tests`` (world size 1 over NCCL);
3. ``labs ws1``: every lab under nbval at ``DDPLAB_WORLD_SIZE=1`` (NCCL where
   a lab's Cluster fits the GPU; cells that need 2 ranks skip saying so);
4. ``compare``: ``python -m ddplab compare`` at world size 1 over NCCL; its
   timelines must hold device-timed transfers (CUDA event or NCCL timing)
   longer than zero;
5. ``record``: ``examples/record_my_run.py`` under torchrun on the GPU; every
   recorded bucket's device duration must be > 0 and end after its ready time;
6. ``view``: ``python -m ddplab view`` of that run;
7. ``hang``: a planted hang on CUDA (a learner's ``agreed_steps`` whose
   all-reduce is queued behind a long GPU sleep) must be named HUNG by lab
   06's grader within the Cluster's limit, and afterwards no rank may be
   killed (NCCL's watchdog aborts a rank about a minute after a timeout it
   saw; the step waits that long, then runs a job on the same ranks);
8. ``bench``: ``benchmarks/gpu_step_time.py``, the step-time benchmark.

It prints ONE table (step, result, seconds, figure) and, when ``$OUT`` (or
``--out``) is set, writes there: ``gpu-check.txt`` (the table),
``gpu-check.log`` (every step's command and output), ``bench.json``,
``compare.json`` and ``run.json``. Exit status 0 only if every step passed.
A machine without CUDA is refused at once, saying so.

Leaves out: two or more GPUs (``tools/gpu_check_multi.py``), and the CPU
suites (``make check`` runs those). What has never run on a GPU is listed in
docs/gpu-check.md.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_check_judge import DEVICE_SOURCES, bucket_records, device_durations, judge_transfers, pytest_figure  # noqa: F401 - the checks' names, public here too

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 480
GPU_VENV = ROOT / ".venv-gpu"
# The packages ddplab, its labs and its GPU tests need beside torch (pyproject: dependencies + [gpu]).
REQUIREMENTS = ("numpy", "cloudpickle", "ipywidgets", "plotly", "anywidget", "pytest", "pytest-timeout",
                "nbval", "nbclient", "nbformat", "ipykernel", "jupyter_client", "pyyaml")


@dataclass
class Step:
    name: str
    limit_s: int
    what: str


PLAN = [
    Step("install", 40, "venv over the system's torch; pip --no-index --find-links WHEELS -e .[gpu]"),
    Step("doctor", 20, "python -m ddplab doctor --world-size 1"),
    Step("gpu tests", 90, "DDPLAB_REQUIRE_DEVICE_GRADS=1 pytest -m gpu tests"),
    Step("labs ws1", 125, "DDPLAB_WORLD_SIZE=1 pytest --nbval-lax labs/*.ipynb"),
    Step("compare", 25, "python -m ddplab compare --world-size 1 --backend nccl; device-timed transfers > 0"),
    Step("record", 25, "torchrun examples/record_my_run.py; each bucket's device time > 0, ends after ready"),
    Step("view", 10, "python -m ddplab view run.json --html"),
    Step("hang", 100, "a planted CUDA hang named HUNG within its limit; no rank killed afterwards"),
    Step("bench", 45, "benchmarks/gpu_step_time.py: ratios to torch DDP, medians"),
]


class Runner:
    def __init__(self, python: str, out: Path | None, work: Path, budget_s: float):
        self.python, self.out, self.work = python, out, work
        self.deadline = time.monotonic() + budget_s
        self.rows: list = []
        self.log = open(out / "gpu-check.log", "w") if out else None

    def note(self, text: str) -> None:
        if self.log:
            self.log.write(text + "\n")
            self.log.flush()

    def sh(self, cmd: list, limit: float, env: dict | None = None) -> tuple[int | None, str]:
        """Run ``cmd`` in the repository; (exit status or None when it ran past ``limit``, output)."""
        self.note(f"$ {' '.join(map(str, cmd))}   (limit {limit:.0f} s)")
        full = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # a session of its own, so that a step is ended with everything it started (ranks, torchrun's
        # workers): at its limit, and after it returns (nothing of it may hold the GPU for the next)
        p = subprocess.Popen(cmd, cwd=ROOT, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        try:
            text, _ = p.communicate(timeout=limit)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            _kill_session(p.pid)
            text, _ = p.communicate()
            rc = None
        _kill_session(p.pid)
        self.note(text or "")
        return rc, text or ""

    def step(self, step: Step, fn) -> bool:
        left = self.deadline - time.monotonic()
        limit = min(step.limit_s, left)
        t0 = time.monotonic()
        if limit < 5:
            self.rows.append((step.name, "SKIP", 0.0, "the 8-minute budget is spent"))
            return False
        self.note(f"\n== {step.name}: {step.what}")
        try:
            ok, figure = fn(limit)
        except Exception as exc:  # a step's own failure is a row, never the end of the run
            ok, figure = False, f"{type(exc).__name__}: {exc}"[:200]
        took = time.monotonic() - t0
        self.rows.append((step.name, "ok" if ok else "FAIL", took, figure))
        self.note(f"-> {'ok' if ok else 'FAIL'} in {took:.1f} s: {figure}")
        return ok

    def table(self) -> str:
        lines = ["| step | result | seconds | figure |", "|---|---|---|---|"]
        lines += [f"| {n} | {r} | {s:.1f} | {f} |" for n, r, s, f in self.rows]
        return "\n".join(lines)


def _kill_session(pid: int) -> None:
    """End what is left of the process session a step started (its leader had pid ``pid``)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left


def install(runner: Runner, wheels: Path | None, limit: float) -> tuple[bool, str]:
    """Make .venv-gpu over this interpreter's CUDA torch and install ``.[gpu]`` into it, from
    the folder ``wheels`` only (None: from the package index, for ``make test-gpu``)."""
    if not GPU_VENV.joinpath("bin", "python").exists():
        rc, _ = runner.sh([sys.executable, "-m", "venv", "--system-site-packages", str(GPU_VENV)], limit)
        if rc != 0:
            return False, "could not make .venv-gpu"
    py = str(GPU_VENV / "bin" / "python")
    if sys.prefix != sys.base_prefix:
        # python3 is itself a venv (the GPU image's torch lives in one): --system-site-packages
        # would see the base interpreter's packages, not this venv's torch. A .pth file puts this
        # interpreter's site-packages after .venv-gpu's own, so torch is found and pip counts it.
        rc, own = runner.sh([py, "-c", "import site; print(site.getsitepackages()[0])"], 10)
        if rc != 0:
            return False, "could not read .venv-gpu's site-packages"
        import site

        Path(own.strip().splitlines()[-1], "ddplab-parent-env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    rc, text = runner.sh([py, "-c", "import torch; assert torch.cuda.is_available(); print(torch.__version__)"], 30)
    if rc != 0:
        return False, ".venv-gpu does not see the machine's CUDA torch (see the log)"
    source = ["--no-index", "--find-links", str(wheels)] if wheels else []
    rc, text = runner.sh([py, "-m", "pip", "install", "-q", *source,
                          "--no-build-isolation", "-e", ".[gpu]"], limit)
    if rc != 0:
        missing = re.findall(r"No matching distribution found for (\S+)", text)
        return False, f"pip failed{': missing ' + ', '.join(missing) if missing else ''} (see the log)"
    runner.python = py
    return True, f"from {wheels or 'the package index'}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", default=os.environ.get("WHEELS"), help="folder of wheels (or WHEELS=)")
    ap.add_argument("--python", default=None, help="use this python as it is: no venv, no install")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the logs (default $OUT)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for every step together")
    ap.add_argument("--after-hang-s", type=float, default=65.0,
                    help="how long the hang step waits before checking that no rank was killed")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--install-only", action="store_true",
                    help="make .venv-gpu and install into it (from --wheels, else the index), then exit "
                         "(make test-gpu)")
    ap.add_argument("--requirements", action="store_true", help="print the packages the wheel folder needs")
    args = ap.parse_args(argv)
    if args.requirements:
        print("\n".join(REQUIREMENTS))
        return 0
    if args.dry_run:
        print(f"gpu-check plan ({args.budget:.0f} s in all, one step at a time):")
        for s in PLAN:
            print(f"  {s.name:10s} <= {s.limit_s:3d} s  {s.what}")
        print(f"  total of the limits: {sum(s.limit_s for s in PLAN)} s; wheels: {args.wheels or '(none given)'}"
              f"; logs: {args.out or '(no $OUT: none written)'}")
        return 0
    python = args.python or sys.executable
    cuda = subprocess.run([python, "-c", "import torch, sys; print(torch.__version__); "
                           "sys.exit(0 if torch.cuda.is_available() else 3)"],
                          capture_output=True, text=True)
    if cuda.returncode != 0:
        print(f"gpu-check needs a CUDA build of torch and a GPU; {python} has torch "
              f"{cuda.stdout.strip() or '(none: ' + cuda.stderr.strip()[-200:] + ')'} and sees no GPU. "
              "Run it on the GPU machine (make gpu-check WHEELS=DIR).", file=sys.stderr)
        return 2
    if args.install_only:
        runner = Runner(python, None, Path(tempfile.gettempdir()), args.budget)
        runner.log = sys.stdout  # make test-gpu shows what pip said
        ok = runner.step(PLAN[0], lambda limit: install(runner, Path(args.wheels) if args.wheels else None,
                                                        max(limit, 600.0)))
        print(runner.table())
        return 0 if ok else 1
    if not args.python and not args.wheels:
        print("gpu-check installs from a folder of wheels only: pass --wheels DIR (make gpu-check "
              "WHEELS=DIR); tools/gpu_check.py --requirements lists what it must hold; or --python PY "
              "to use an environment that has them already.", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ddplab-gpu-check-"))
    runner = Runner(python, out, work, args.budget)
    try:
        run_steps(runner, args, out, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = runner.table()
    print(text)
    if runner.log:
        runner.log.close()
    if out:
        (out / "gpu-check.txt").write_text(text + "\n")
    return 0 if all(r[1] == "ok" for r in runner.rows) else 1


def run_steps(runner: Runner, args, out: Path | None, work: Path) -> None:
    from gpu_check_steps import steps  # beside this file: each step's command and its judgement

    plan = {s.name: s for s in PLAN}
    if args.python:
        runner.rows.append(("install", "ok", 0.0, f"skipped: --python {args.python}"))
    elif not runner.step(plan["install"], lambda limit: install(runner, Path(args.wheels), limit)):
        return  # nothing else can run without the packages
    for name, fn in steps(runner, args, out, work):
        runner.step(plan[name], fn)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
