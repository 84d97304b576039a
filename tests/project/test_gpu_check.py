"""``make gpu-check`` without a GPU: its plan, its refusal, its judgements, and what it collects.

No GPU here, so the script is exercised where it can be: the dry run lists every
step inside the 8-minute budget; without CUDA it refuses at once in words; the
checks it makes on compare's trace and a recorded run pass and fail on made-up
records as they must; ``pytest -m gpu`` collects with nbgrader, jupyterhub and
playwright unimportable (a GPU machine has none of them); the wheel folder's
list matches pyproject; the step-time benchmark runs end to end on gloo.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_check as G  # noqa: E402
import gpu_check_steps as S  # noqa: E402


def run(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_the_dry_run_lists_every_step_within_eight_minutes():
    p = run("tools/gpu_check.py", "--dry-run", "--wheels", "/some/wheels")
    assert p.returncode == 0, p.stderr
    for step in ("install", "doctor", "gpu tests", "labs ws1", "compare", "record", "view", "hang", "bench"):
        assert f"  {step} " in p.stdout
    assert sum(s.limit_s for s in G.PLAN) <= 480 and G.BUDGET_S == 480
    assert "wheels: /some/wheels" in p.stdout
    # every step after the install has its function, in the plan's order
    names = [name for name, _ in S.steps(None, None, None, Path("."))]
    assert names == [s.name for s in G.PLAN[1:]]


@pytest.mark.slow  # subprocesses importing torch, or a 3 s limit run out
def test_without_cuda_it_refuses_at_once_saying_why(tmp_path):
    import time

    p_started = time.time()
    p = run("tools/gpu_check.py", "--wheels", str(tmp_path), "--out", str(tmp_path / "out"))
    assert p.returncode == 2
    assert "needs a CUDA build of torch and a GPU" in p.stderr and "+cpu" in p.stderr
    assert not (tmp_path / "out").exists()  # nothing ran
    p = run("tools/gpu_check.py", "--install-only")  # make test-gpu's first line
    assert p.returncode == 2 and "needs a CUDA build of torch and a GPU" in p.stderr
    assert not (ROOT / ".venv-gpu").exists() or (ROOT / ".venv-gpu").stat().st_mtime < p_started


def test_the_wheel_list_is_pyprojects_dependencies_and_gpu_extra():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [d.split(">")[0].split("=")[0].strip() for d in
             meta["dependencies"] + meta["optional-dependencies"]["gpu"]]
    assert sorted(n for n in names if n != "torch") == sorted(G.REQUIREMENTS)
    assert not {"nbgrader", "jupyterhub", "playwright"} & set(names)


def bucket(comm_end, source="cuda_event", ready=1.0, launch=1.1, start=None):
    return {"rank": 0, "iteration": 2, "index": 0, "nbytes": 4, "grads_ready": ready, "launch": launch,
            "comm_start": start, "comm_end": comm_end,
            "sources": {"grads_ready": "cpu", "launch": "cpu", "comm_end": source}}


def test_a_recorded_run_passes_only_with_device_timed_buckets_that_end_after_ready():
    good = {"backend": "nccl", "buckets": [bucket(1.5), bucket(1.3, start=1.2)]}
    assert G.judge_transfers(good, need_after_ready=True) == (True, "2 device-timed buckets, min 100.000 ms")
    cpu_only = {"buckets": [bucket(1.5, source="cpu")]}
    ok, figure = G.judge_transfers(cpu_only, need_after_ready=True)
    assert not ok and "no device-timed bucket among 1" in figure and "'cpu'" in figure
    zero = {"buckets": [bucket(1.1), bucket(1.5)]}  # ends when launched: a zero-length transfer
    ok, figure = G.judge_transfers(zero, need_after_ready=True)
    assert not ok and "1 of zero length" in figure
    early = {"buckets": [bucket(0.9, launch=0.5)]}  # ends before its gradients were ready
    ok, figure = G.judge_transfers(early, need_after_ready=True)
    assert not ok and "1 ending before ready" in figure
    assert G.judge_transfers(early, need_after_ready=False)[0]


def test_compares_trace_passes_only_with_device_timed_transfers_longer_than_zero():
    def event(dur, source):
        return {"ph": "X", "cat": "communication", "name": "bucket 0", "dur": dur,
                "args": {"sources": {"comm_end": source}}}
    forward = {"ph": "X", "cat": "compute", "name": "forward", "dur": 5.0, "args": {"source": "cuda_event"}}
    assert S.judge_trace({"traceEvents": [forward, event(12.5, "nccl_timing"), event(3.0, "cuda_event")]}) \
        == (True, "2 device-timed transfers, min 3.0 us")
    ok, figure = S.judge_trace({"traceEvents": [forward, event(12.5, "cpu")]})
    assert not ok and "no device-timed transfer among 1" in figure
    ok, figure = S.judge_trace({"traceEvents": [event(0.0, "cuda_event"), event(2.0, "cuda_event")]})
    assert not ok and "1 of zero length" in figure


def test_pytest_figure_is_the_summary_line():
    text = "....\n= 9 passed, 1 skipped in 42.10s =\n"
    assert G.pytest_figure(text) == "9 passed, 1 skipped in 42.10s"
    assert G.pytest_figure("Traceback ...") == "no pytest summary"


BLOCKER = '''
import sys

BLOCKED = ("nbgrader", "jupyterhub", "playwright")


class Blocked:
    """As on a GPU machine that has none of them: importing one fails."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, Blocked())
'''


@pytest.mark.slow
def test_the_gpu_tests_collect_without_nbgrader_jupyterhub_or_playwright(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {"PYTHONPATH": str(tmp_path)}
    probe = run("-c", "import nbgrader", env=env)
    assert probe.returncode != 0 and "blocked by the test" in probe.stderr  # the block works
    p = run("-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests",
            env=env, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "error" not in p.stdout.lower().split("collected")[-1]
    collected = [ln for ln in p.stdout.splitlines() if "::" in ln]
    assert len(collected) >= 8 and all(ln.startswith("tests/") for ln in collected)
    assert any("test_sync_gpu.py" in ln for ln in collected)


@pytest.mark.slow
def test_the_step_time_benchmark_runs_end_to_end_on_gloo(tmp_path):
    out = tmp_path / "bench.json"
    p = run("benchmarks/gpu_step_time.py", "--device", "cpu", "--small", "--rounds", "2", "--steps", "1",
            "--json", str(out), timeout=280)
    assert p.returncode == 0, p.stderr[-2000:]
    import json

    res = json.loads(out.read_text())
    assert res["backend"] == "gloo" and set(res["models"]) == {"transformer", "mlp"}
    for row in res["models"].values():
        assert row["ratio_to_ddp"]["ddp"] == 1.0
        assert set(row["ratio_to_ddp"]) == {"bucketed", "manual_flat", "manual", "overlap", "ddp", "ddp_aa"}
        assert all(v > 0 for v in row["step_ms"].values())
    assert "| model | bucketed | manual_flat | manual | overlap | ddp_aa |" in p.stdout


@pytest.mark.slow  # subprocesses importing torch, or a 3 s limit run out
def test_the_multi_gpu_run_has_its_plan_and_refuses_one_gpu_or_none():
    p = run("tools/gpu_check_multi.py", "--dry-run")
    assert p.returncode == 0, p.stderr
    for step in ("gpu tests", "labs ws2", "transfers", "overlap", "straggler", "record", "ring"):
        assert f"  {step} " in p.stdout
    p = run("tools/gpu_check_multi.py", "--python", sys.executable)
    assert p.returncode == 2 and "needs 2 or more GPUs" in p.stderr and "sees 0" in p.stderr


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # dead, waiting for init to reap it


@pytest.mark.slow  # subprocesses importing torch, or a 3 s limit run out
def test_a_step_past_its_limit_is_ended_with_everything_it_started(tmp_path):
    import time

    runner = G.Runner(sys.executable, tmp_path, tmp_path, budget_s=60)
    spawn = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(120)']); print('child', c.pid, flush=True); time.sleep(120)")
    t0 = time.monotonic()
    rc, text = runner.sh([sys.executable, "-c", spawn], limit=3)
    assert rc is None and time.monotonic() - t0 < 20
    child = int(text.split("child")[1].split()[0])
    deadline = time.monotonic() + 5
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child)  # the grandchild did not outlive its step
    assert runner.step(G.Step("ok", 10, "a step that passes"), lambda limit: (True, f"limit {limit:.0f}"))
    assert not runner.step(G.Step("raises", 10, "a step that raises"), lambda limit: 1 / 0)
    runner.deadline = time.monotonic()  # the budget is spent: the next step is skipped, saying so
    assert not runner.step(G.Step("late", 10, "too late"), lambda limit: (True, ""))
    rows = {name: (result, figure) for name, result, _, figure in runner.rows}
    assert rows == {"ok": ("ok", "limit 10"), "raises": ("FAIL", "ZeroDivisionError: division by zero"),
                    "late": ("SKIP", "the 8-minute budget is spent")}
    log = (tmp_path / "gpu-check.log").read_text()
    assert "(limit 3 s)" in log and "-> FAIL" in log
    assert runner.table().splitlines()[0] == "| step | result | seconds | figure |"
