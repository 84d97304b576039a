"""The load test, small and real: 3 learners log in at once to a class that holds 2 (make test-hub).

tools/class_load.py (make load-test) with ``--max-learners 2``: a real hub from
``python -m ddplab classroom``, 3 Unix accounts, PAM log-in over HTTP through the proxy, all at
once. Two servers start and run lab 00's first cell on 2 gloo ranks each (and its all_reduce
check); the third learner gets JupyterHub's 429 page saying "The class is full" with the
instructor's options, and nothing of theirs starts. Each served learner's memory is read from
their cgroup. Afterwards no process of the class's accounts, no account, no cgroup of the class
is left; files the learners left in /tmp are reported (and removed by the tool).

Needs root, writable cgroup v1 and the proxy; skips elsewhere (fails under CI where accounts can
be made). Costs about 2 to 4 minutes on a busy 2-core machine.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddplab.course import accounts, limits

pytestmark = [pytest.mark.slow, pytest.mark.hub, pytest.mark.skipif(
    not os.environ.get("DDPLAB_HUB_TEST"), reason="runs under make test-hub (DDPLAB_HUB_TEST=1)")]
ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "class_load.py"


@pytest.mark.timeout(900)
def test_three_learners_at_once_in_a_class_of_two_two_served_one_told_it_is_full(tmp_path):
    why = accounts.can_create() or (None if set(limits.writable()) == set(limits.CONTROLLERS)
                                    else f"cgroup v1 not writable here: {limits.writable()}")
    if why or not (ROOT / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy").exists():
        message = why or "configurable-http-proxy is missing: npm ci --prefix proxy"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    done = subprocess.run([sys.executable, str(TOOL), "3", "--max-learners", "2", "--mem-gib", "1.5",
                           "--deadline", "600", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=850,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    result = json.loads((tmp_path / "class-load-3.json").read_text())
    said = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{json.dumps(result['learners'], indent=1)[:4000]}"
    assert result["error"] == "" and result["stopped_early"] == "", said
    assert result["limit"] == 2 and result["served"] == 2 and result["refused"] == 1, said
    assert result["failures"] == 0, said
    full = next(w for w in result["learners"] if w["outcome"] == "full")
    assert "The class is full: 2 servers are running" in full["why"] and "--max-learners" in full["why"], full
    assert "spawn" not in full["times"], full  # nothing of theirs started
    for w in result["learners"]:
        if w["outcome"] == "served":
            assert w["times"]["first_cell"] > 0 and w["memory"]["processes"] >= 4, w  # server, kernel, 2 ranks
            assert 100 < w["memory"]["cgroup_peak_mib"] < 1.5 * 1024, w  # within the class's limit
    left = result["left"]
    assert left["processes"] == [] and left["processes_after_hub"] == [], left
    assert left["accounts"] == [] and left["cgroups"] == [], left
    # what a stopped server's kernel leaves in /tmp: its Cluster's rendezvous folder (ddplab-*, the
    # kernel is killed before its atexit runs) and torch's torchinductor_<user>; nothing else
    assert all(Path(p).name.startswith(("ddplab-", "torchinductor_")) for p in left["tmp_files"]), left
    assert not [p for p in left["tmp_files"] if os.path.exists(p)], "the tool did not remove them"
    assert done.returncode == (0 if result["nothing_left"] else 1), said
