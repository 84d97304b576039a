"""The steps of ``tools/gpu_check.py`` after the install: each one's command and its judgement.

Every step runs in a process of its own (``Runner.sh``), one after the other, so
that a step that hangs or dies is ended at its limit and the next one still gets
the GPU. Each returns (passed, figure) for the table.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from gpu_check_judge import DEVICE_SOURCES, judge_transfers, pytest_figure

ROOT = Path(__file__).resolve().parents[1]

# A planted hang on CUDA, run by the hang step in a fresh process: lab 06's grader gets a
# learner's agreed_steps whose all-reduce is queued behind a long GPU sleep, on a Cluster of one
# NCCL rank with a 3 s limit. The grader must name HUNG within the limit (plus start-up and
# margin); then, once NCCL's watchdog would have acted on that timeout, the same ranks must still
# answer a job (pids unchanged: nothing killed them). Prints one JSON line for the step.
HANG = r'''
import json, os, sys, time
import torch
import ddplab
from ddplab import checks
from ddplab.checks.mistakes import HUNG

LIMIT, AFTER = 3.0, float(sys.argv[1])

def agreed_steps_stuck(n_local):
    import torch, torch.distributed as dist
    t = torch.tensor([n_local], device="cuda")
    torch.cuda._sleep(40_000_000_000)  # tens of seconds of GPU time before the all-reduce can run
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())

out = {}
with ddplab.Cluster(1, backend="nccl", timeout=LIMIT) as cluster:
    out["backend"] = cluster.backend
    t0 = time.monotonic()
    try:
        checks.check_agreed_steps(cluster, agreed_steps_stuck, train=False)
        out["mistake"] = None
    except checks.CheckFailed as failed:
        out["mistake"] = failed.mistake
    except Exception as exc:
        out["mistake"] = f"raw {type(exc).__name__}: {str(exc)[:200]}"
    out["named_after_s"] = round(time.monotonic() - t0, 1)
    out["hung"] = out["mistake"] == HUNG
    try:  # the ranks as the Cluster keeps them after the hang (it may have replaced them)
        before = cluster.run_job(os.getpid, job_timeout=60)
        time.sleep(AFTER)  # NCCL's watchdog aborts a rank about a minute after a timeout it saw
        after = cluster.run_job(os.getpid, job_timeout=30)
        out["same_ranks"] = after == before
    except Exception as exc:
        out["same_ranks"] = False
        out["after_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
print("HANG-RESULT " + json.dumps(out))
'''


def steps(runner, args, out: Path | None, work: Path):
    """(name, fn(limit) -> (passed, figure)) for every step after the install, in order."""
    py = lambda: runner.python  # noqa: E731 - the install step may have changed it

    def doctor(limit):
        rc, text = runner.sh([py(), "-m", "ddplab", "doctor", "--world-size", "1"], limit)
        gpu = re.search(r"(NVIDIA[^\n,;]*|H100[^\n,;]*|H200[^\n,;]*)", text)
        return rc == 0, gpu.group(1).strip()[:60] if gpu else f"exit {rc}"

    def gpu_tests(limit):
        rc, text = runner.sh([py(), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu",
                              "tests"], limit, env={"DDPLAB_REQUIRE_DEVICE_GRADS": "1"})
        return rc == 0, pytest_figure(text) if rc is not None else "ran past its limit"

    def labs(limit):
        notebooks = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "labs").glob("*.ipynb"))
        rc, text = runner.sh([py(), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                              "--nbval-current-env", "--nbval-sanitize-with", "labs/nbval-sanitize.cfg",
                              *notebooks], limit,
                             env={"DDPLAB_WORLD_SIZE": "1", "DDPLAB_REQUIRE_DEVICE_GRADS": "1"})
        return rc == 0, (pytest_figure(text) if rc is not None else "ran past its limit") + \
            f" ({len(notebooks)} labs)"

    def compare(limit):
        json_path, trace = work / "compare.json", work / "compare.trace.json"
        rc, _ = runner.sh([py(), "-m", "ddplab", "compare", "--world-size", "1", "--backend", "nccl",
                              "--strategies", "manual,bucketed,overlap,ddp", "--steps", "5",
                              "--json", str(json_path), "--trace", str(trace),
                              "--html", str(work / "compare.html")], limit)
        if rc != 0 or not trace.exists():
            return False, f"compare exited {rc}"
        if out:
            shutil.copy(json_path, out / "compare.json")
        backend = json.loads(json_path.read_text()).get("backend")
        ok, figure = judge_trace(json.loads(trace.read_text()))
        return ok and "nccl" in str(backend), f"{backend}: {figure}"

    def record(limit):
        rc, _ = runner.sh([py(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                              "examples/record_my_run.py", "--out", str(work / "run")], limit)
        run = work / "run.json"
        if rc != 0 or not run.exists():
            return False, f"torchrun exited {rc}"
        if out:
            shutil.copy(run, out / "run.json")
        doc = json.loads(run.read_text())
        ok, figure = judge_transfers(doc, need_after_ready=True)
        return ok and "nccl" in str(doc.get("backend")), f"{doc.get('backend')}: {figure}"

    def view(limit):
        page = work / "view.html"
        rc, _ = runner.sh([py(), "-m", "ddplab", "view", str(work / "run.json"), "--html", str(page)], limit)
        size = page.stat().st_size if page.exists() else 0
        return rc == 0 and size > 0, f"{size / 1e3:.0f} kB page"

    def hang(limit):
        rc, text = runner.sh([py(), "-c", HANG, str(args.after_hang_s)], limit)
        line = next((ln for ln in text.splitlines() if ln.startswith("HANG-RESULT ")), None)
        if line is None:
            return False, f"no result (exit {rc})"
        res = json.loads(line.split(" ", 1)[1])
        ok = res["hung"] and res["named_after_s"] <= 3.0 + 30 and res.get("same_ranks") is True
        kept = "kept" if res.get("same_ranks") else "NOT kept: " + res.get("after_error", "pids changed")
        return ok, (f"{res['mistake']!r} after {res['named_after_s']} s on {res.get('backend')}; "
                    f"ranks {kept} {args.after_hang_s:.0f} s later")

    def bench(limit):
        path = work / "bench.json"
        rc, _ = runner.sh([py(), "benchmarks/gpu_step_time.py", "--json", str(path)], limit)
        if rc != 0 or not path.exists():
            return False, f"exited {rc}"
        if out:
            shutil.copy(path, out / "bench.json")
        res = json.loads(path.read_text())
        return True, "; ".join(f"{m}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["ratio_to_ddp"].items()
                                                    if k != "ddp") for m, row in res["models"].items())

    return [("doctor", doctor), ("gpu tests", gpu_tests), ("labs ws1", labs), ("compare", compare),
            ("record", record), ("view", view), ("hang", hang), ("bench", bench)]


def judge_trace(trace) -> tuple[bool, str]:
    """compare's Chrome trace: its communication events timed on the device, each longer than 0."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    comm = [e for e in events if e.get("cat") == "communication"]
    timed = [e for e in comm if (e.get("args") or {}).get("sources", {}).get("comm_end") in DEVICE_SOURCES]
    if not timed:
        sources = sorted({str((e.get("args") or {}).get("sources", {}).get("comm_end")) for e in comm})
        return False, f"no device-timed transfer among {len(comm)} (comm_end sources: {sources})"
    zero = [e for e in timed if not e.get("dur", 0) > 0]
    figure = f"{len(timed)} device-timed transfers, min {min(e.get('dur', 0) for e in timed):.1f} us"
    return not zero, figure + (f"; {len(zero)} of zero length" if zero else "")
