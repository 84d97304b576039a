
"""A strategy defined HERE, in a test file, runs everywhere strategies run: compare() on
live ranks, the ControlPanel and the command line, without a line of ddplab changing."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddplab.measure import RunSpec, compare
from ddplab.sync import comm
from ddplab.sync.registry import (
    Built,
    build_strategy,
    get_strategy,
    register_strategy,
    strategy_names,
    unregister_strategy,
)

ROOT = Path(__file__).resolve().parents[2]


def summed_once(module, process_group=None, recorder=None):
    """after backward, ONE all-reduce of every gradient flattened (written outside ddplab)"""
    def after_backward():
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, process_group, bucket=0, params=["every gradient"], recorder=recorder)
        flat /= dist.get_world_size(process_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return module, after_backward


# What a notebook cell does: the function's module is __main__, which the ranks
# cannot import, so it must travel with the job by value.
NOTEBOOK_CELL = '''
def halved_after_backward(module, recorder=None):
    """average_gradients written in a notebook cell"""
    import torch.distributed as dist
    from ddplab.sync import comm
    def after():
        for i, p in enumerate(module.parameters()):
            comm.all_reduce(p.grad, bucket=i, recorder=recorder)
            p.grad /= dist.get_world_size()
    return module, after
'''


@pytest.fixture
def cluster(cluster2):
    return cluster2  # shared for the session (conftest.py)


@pytest.fixture
def registered():
    register_strategy("summed_once", summed_once)
    cell = {"__name__": "__main__"}
    exec(NOTEBOOK_CELL, cell)  # noqa: S102 - a stand-in for a notebook cell
    register_strategy("halved", cell["halved_after_backward"])
    yield
    unregister_strategy("summed_once")
    unregister_strategy("halved")


def test_a_strategy_from_a_test_file_and_one_from_a_notebook_cell_run_on_live_ranks(cluster, registered):
    r = compare(cluster, "manual,summed_once,halved", steps=2, n_params=2e5)
    m = r.metrics
    assert m["summed_once"]["ranks_agree"] and m["halved"]["ranks_agree"]
    payload = m["manual"]["comm_bytes_per_step"]
    assert payload > 0 and m["summed_once"]["comm_bytes_per_step"] == payload
    assert m["halved"]["comm_bytes_per_step"] == payload
    assert m["summed_once"]["n_buckets"] == 1 and m["halved"]["n_buckets"] > 1


def test_the_control_panel_lists_and_runs_a_registered_strategy(cluster, registered):
    from ddplab.widgets import ControlPanel

    panel = ControlPanel(cluster=cluster, strategies=("summed_once",), n_params=200_000, steps=1,
                         link=None)
    assert "summed_once" in panel.strategy_boxes and "halved" in panel.strategy_boxes
    assert panel.run() is not None, panel.last_error
    assert panel.result["metrics"]["summed_once"]["ranks_agree"]


@pytest.mark.slow
@pytest.mark.more
def test_the_command_line_runs_a_strategy_defined_in_a_file(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "ddplab", "compare", "--strategies", "manual", "--strategy",
         f"{Path(__file__).resolve()}:summed_once", "--steps", "1", "--params", "2e5",
         "--json", str(tmp_path / "m.json")], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    m = json.loads((tmp_path / "m.json").read_text())["strategies"]
    assert set(m) == {"manual", "summed_once"} and m["summed_once"]["ranks_agree"]
    bad = subprocess.run([sys.executable, "-m", "ddplab", "compare", "--strategy", "nowhere.py:x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no such file 'nowhere.py'" in bad.stderr


def test_the_registry_says_what_is_wrong():
    assert {"none", "manual", "manual_flat", "overlap", "bucketed", "ddp"} <= set(strategy_names())
    with pytest.raises(ValueError, match="unknown strategy 'fast': choose any of none, manual"):
        get_strategy("fast")
    with pytest.raises(ValueError, match="already registered"):
        register_strategy("manual", summed_once)
    with pytest.raises(TypeError, match="'manual' takes no option 'flat'; it takes: process_group"):
        build_strategy("manual", torch.nn.Linear(2, 2), flat=True)
    # engine options go only where they mean something: a cap for manual is dropped
    built = build_strategy("none", torch.nn.Linear(2, 2), bucket_cap_mb=1.0, recorder=None)
    assert isinstance(built, Built) and built.after_backward is None
    with pytest.raises(ValueError, match="FILE.py:NAME"):
        get_strategy(":x")


def test_run_spec_is_frozen_checked_and_normalized():
    spec = RunSpec("none, ddp", steps=2, warmup=0, link="1gbe", straggler="1:2")
    assert spec.strategies == ("none", "ddp") and spec.warmup == 2  # DDP's first two never count
    assert spec.link.bandwidth_gbps == 1.0 and spec.straggler == (1, 2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.steps = 3  # frozen
    assert spec.replace(steps=3).steps == 3
    assert json.loads(json.dumps(spec.to_dict()))["link"]["simulated"] is True
    for bad, match in [(dict(steps=0), "steps must be"), (dict(bucket_cap_mb=float("nan")), "bucket_cap_mb"),
                       (dict(straggler="3:2"), "not a rank"), (dict(strategies=""), "no strategy"),
                       (dict(link="5g"), "unknown link preset")]:
        with pytest.raises(ValueError, match=match):
            RunSpec(**bad)
