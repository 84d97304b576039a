"""``python -m ddplab link`` as a torchrun user runs it: 2 gloo ranks under real torchrun
(``torchrun --standalone --nproc-per-node 2 -m ddplab link``), and without torchrun.

Kept short: 3 sizes (4 KiB to 1 MiB), 2 warm-up and 9 timed all-reduces each; nearly all of
each test's time is starting the ranks (processes importing torch)."""
import datetime
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from test_whatif import recording

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.more]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHERS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
             "OMPI_COMM_WORLD_RANK")


def ddplab(*args, torchrun=True, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHERS}
    env.update(PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    return subprocess.run([*(launch if torchrun else [sys.executable, "-m"]), "ddplab", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def fitted_from_its_own_times(m):
    """The file's fit is the ring model fitted to the file's own times, and its predictions are
    that model's. (How close the model comes to each time is the machine's noise, not the
    command's: on 2 shared cores a size's median moves by tens of percent between runs, so it is
    not asserted here; tests/measure/test_link.py checks that the fit gives back, at 2 and 4
    ranks, the link that made the times.)"""
    from ddplab.measure.link import fit_link

    again = fit_link(m["sizes_bytes"], m["seconds"], m["world_size"])
    fit, p = m["fit"], m["world_size"]
    assert again["latency_s"] == pytest.approx(fit["latency_s"])
    assert again["bandwidth_bytes_per_s"] == pytest.approx(fit["bandwidth_bytes_per_s"])
    ring = [2 * (p - 1) * fit["latency_s"] + 2 * (p - 1) / p * n / fit["bandwidth_bytes_per_s"]
            for n in m["sizes_bytes"]]
    assert ring == pytest.approx(fit["predicted_seconds"])
    assert fit["latency_s"] > 0 and fit["bandwidth_bytes_per_s"] > 0


def test_under_torchrun_it_writes_the_ring_model_fitted_to_what_it_measured(tmp_path):
    from ddplab.measure.link import load_link
    from ddplab.measure.whatif import predict

    out = tmp_path / "link.json"
    done = ddplab("link", "-o", str(out), "--sizes", "4K,64K,1M", "--repeats", "9", "--warmup", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    m = json.loads(out.read_text())
    assert (m["world_size"], m["backend"], m["device"], m["torch"]) == (2, "gloo", "cpu", torch.__version__)
    assert m["hosts"] == [socket.gethostname()] * 2 and m["one_machine"] and "not a network" in m["note"]
    when = datetime.datetime.fromisoformat(m["date"])
    assert abs((datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()) < 600
    assert m["sizes_bytes"] == [4096, 65536, 2 ** 20] and (m["repeats"], m["warmup"]) == (9, 2)
    by_rank = m["seconds_by_rank"]
    assert len(by_rank) == 2 and m["seconds"] == [max(a, b) for a, b in zip(*by_rank)]
    fit, p = m["fit"], 2
    fitted_from_its_own_times(m)
    # the LinkModel the what-if builds from the file says the same
    model, _ = load_link(out)
    assert [model.allreduce_seconds(n, p) for n in m["sizes_bytes"]] == pytest.approx(fit["predicted_seconds"])
    assert "wrote" in done.stdout and "at most" in done.stdout  # rank 0 printed the fit
    # a recording whose all-reduces are all one size: refused alone, predicted with the file
    one_size = recording()
    one_size.meta.clear()
    with pytest.raises(ValueError, match="-m ddplab link"):
        predict(one_size)
    tl = predict(one_size, link=str(out))
    assert tl.meta["labels"][0].count(f"link measured by ddplab link on {socket.gethostname()}, "
                                      f"{m['date'][:10]}") == 1


def test_without_torchrun_it_refuses_in_one_line():
    done = ddplab("link", "-o", "link.json", torchrun=False, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("ddplab link: no process group") and "torchrun --nproc-per-node 2" in lines[0]

