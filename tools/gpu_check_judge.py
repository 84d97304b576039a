"""What ``tools/gpu_check.py``'s steps wrote, judged: plain JSON, tested on CPU with made-up records.

The step modules (``gpu_check_steps``, ``gpu_check_multi``) read their results through these
functions; ``gpu_check`` runs the steps and prints the table.
"""
from __future__ import annotations

import re

DEVICE_SOURCES = ("cuda_event", "nccl_timing")  # ddplab.timeline.records.SOURCES measured on the device


def bucket_records(doc) -> list:
    """Every per-bucket record in a saved JSON document (a compare result, a recorded run):
    the dicts that carry ``comm_end`` and ``sources``, wherever they are nested."""
    found = []
    stack = [doc]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if "comm_end" in x and "sources" in x:
                found.append(x)
            else:
                stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return found


def device_durations(records) -> list:
    """Seconds each bucket's transfer took on the device: comm_end - (comm_start or launch), for
    the records whose end was timed on the device (a CUDA event or NCCL's own timing)."""
    out = []
    for r in records:
        if r.get("sources", {}).get("comm_end") not in DEVICE_SOURCES:
            continue
        start = r.get("comm_start") if r.get("comm_start") is not None else r.get("launch")
        if start is not None and r.get("comm_end") is not None:
            out.append(r["comm_end"] - start)
    return out


def judge_transfers(doc, *, need_after_ready: bool) -> tuple[bool, str]:
    """(passed, figure): some device-timed buckets, each longer than zero (and, for a recorded
    run, ending after its gradients were ready)."""
    records = bucket_records(doc)
    timed = [r for r in records if r.get("sources", {}).get("comm_end") in DEVICE_SOURCES]
    if not timed:
        sources = sorted({str(r.get("sources", {}).get("comm_end")) for r in records})
        return False, f"no device-timed bucket among {len(records)} (comm_end sources: {sources})"
    durations = device_durations(timed)
    zero = sum(1 for d in durations if not d > 0)
    early = [r for r in timed if need_after_ready and r.get("grads_ready") is not None
             and not r["comm_end"] > r["grads_ready"]]
    figure = (f"{len(timed)} device-timed buckets, min {min(durations) * 1e3:.3f} ms"
              if durations else f"{len(timed)} device-timed buckets, none with a start")
    if zero or early or not durations:
        return False, figure + f"; {zero} of zero length, {len(early)} ending before ready"
    return True, figure


def pytest_figure(text: str) -> str:
    """pytest's last summary line, shortened: '9 passed, 1 skipped in 42s'."""
    lines = [ln.strip("= ") for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return lines[-1] if lines else "no pytest summary"


# -- running the steps ---------------------------------------------------------------------------
