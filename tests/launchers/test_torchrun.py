"""The same code under torchrun: init_from_env, exported scripts, two "nodes" on one machine.

The multi-node test runs one exported script as a learner with 2 machines
would: two torchrun invocations (here 2 ranks each), one c10d rendezvous.
Both "nodes" are this machine, so they meet on localhost at a port the OS
says is free. With c10d, torch ignores --node-rank (it warns): the rendezvous
orders the nodes, so the test passes ``is_host`` to say which invocation
hosts the rendezvous store, and does not assume which node got ranks 0-1.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

import pytest
import torch

from ddplab.launchers.torchrun import REQUIRED, TorchrunEnvError, init_from_env, read_env
from ddplab.notebook import export

CELL_1 = """import torch
import torch.distributed as dist
t = torch.tensor([float(rank)], device=device)  # cuda:local_rank with nccl
dist.all_reduce(t)
print(f"rank={rank} local_rank={local_rank} world_size={world_size} device={device} sum={t.item():g}")
"""
CELL_2 = 'print(f"pushed {scale * offsets[rank].item():g} {big.sum().item():g}")\n'


def recording(world_size: int, backend: str = "gloo") -> export.Recording:
    """What a notebook session would have recorded: a cell, three pushes, a cell."""
    rec = export.Recording(world_size, backend=backend, timeout=60.0)
    rec.add_cell("<ddp-cell-3>", CELL_1)
    rec.add_push("scale", 3)  # a literal: written as code
    rec.add_push("offsets", torch.arange(4.0))  # a small tensor: written as code
    rec.add_push("big", torch.ones(500))  # too big for code: saved beside the script
    rec.add_cell("<ddp-cell-5>", CELL_2)
    return rec


def free_port() -> int:
    # The OS picks; a tiny window remains before torchrun binds it (never a fixed port).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def by_rank(text: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("[rank "):
            head, _, rest = line.partition("] ")
            out.setdefault(int(head[len("[rank "):]), []).append(rest)
    return out


def torchrun_env() -> dict:
    env = dict(os.environ, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[rank ${rank}] ")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # both "nodes" live on this machine's loopback
    return env


def test_init_from_env_outside_torchrun_names_what_is_missing(monkeypatch):
    for name in REQUIRED:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(TorchrunEnvError) as info:
        init_from_env()
    message = str(info.value)
    assert all(name in message for name in REQUIRED)
    assert "torchrun --nproc-per-node=2" in message and "%ddp_start" in message
    partial = {"RANK": "0", "WORLD_SIZE": "2"}
    with pytest.raises(TorchrunEnvError, match="LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not set"):
        read_env(partial)
    with pytest.raises(TorchrunEnvError, match="RANK='x' is not an integer"):
        read_env(dict(partial, RANK="x", LOCAL_RANK="0", MASTER_ADDR="h", MASTER_PORT="1"))


def test_pushed_values_are_reproduced_or_clearly_marked():
    rec = recording(2)
    rec.add_push("make", lambda x: x)  # no source form
    text, saved = export.script_text(rec, "train.py", "train.pushed.pt")
    assert "scale = 3\n" in text
    assert "offsets = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float32)" in text
    assert "big = _ddp_pushed['big#3']" in text and torch.equal(saved["big#3"], torch.ones(500))
    assert "raise NotImplementedError('make was pushed from the notebook (a function)" in text
    assert text.index(CELL_1.strip()) < text.index("scale = 3") < text.index(CELL_2.strip())
    assert text.rstrip().endswith("ddplab.launchers.torchrun.finish()")


@pytest.mark.slow
@pytest.mark.more
def test_exported_script_on_two_nodes(tmp_path):
    export.write_script(tmp_path / "train.py", recording(2))
    port, job = free_port(), f"ddplab-{uuid.uuid4().hex[:8]}"
    nodes = []
    for is_host in (1, 0):
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}",
             f"--rdzv-conf=is_host={is_host},join_timeout=60", "--tee=3", "train.py"],
            cwd=tmp_path, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [node.communicate(timeout=120) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    seen = {}
    for out, _ in outputs:
        lines = by_rank(out)
        assert len(lines) == 2 and sorted(lines) in ([0, 1], [2, 3])  # one machine, two GPUs' worth
        seen.update(lines)
    assert seen == {r: [f"rank={r} local_rank={r % 2} world_size=4 device=cpu sum=6",
                        f"pushed {3 * r} 500"] for r in range(4)}


@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.gpu(1)),
                               pytest.param(2, marks=pytest.mark.gpu(2))])
def test_exported_script_takes_one_gpu_per_rank_with_nccl(tmp_path, n):
    # n processes need n GPUs: NCCL refuses two ranks on one GPU, so a 1-GPU machine runs n=1
    export.write_script(tmp_path / "train.py", recording(n, backend="auto"))
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
         "--tee=3", "train.py"],
        cwd=tmp_path, env=torchrun_env(), capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    total = sum(range(n))
    assert by_rank(run.stdout) == {r: [f"rank={r} local_rank={r} world_size={n} device=cuda:{r} "
                                       f"sum={total}", f"pushed {3 * r} 500"] for r in range(n)}


# -- nodes agree on one backend (each node counts only its own GPUs) -----------------------------
def test_nodes_that_can_all_run_nccl_take_it_and_a_mixed_cluster_takes_gloo_saying_why():
    from ddplab.launchers.torchrun import agree

    both_gpu = {r: ("auto", "nccl") for r in range(4)}
    assert agree(both_gpu) == ("nccl", None)
    mixed = {0: ("auto", "nccl"), 1: ("auto", "nccl"), 2: ("auto", "gloo"), 3: ("auto", "gloo")}
    backend, note = agree(mixed)
    assert backend == "gloo" and note.startswith("gloo for every rank: ranks 2, 3 have no GPU")
    assert agree({r: ("auto", "gloo") for r in range(4)}) == ("gloo", None)
    assert agree({0: ("gloo", "nccl"), 1: ("auto", "nccl")}) == ("gloo", None)  # asked, kept


def test_nodes_that_ask_for_different_backends_or_nccl_without_gpus_are_refused_in_words():
    from ddplab.launchers.torchrun import agree

    with pytest.raises(TorchrunEnvError, match=r"ranks 0, 1 asked for gloo; ranks 2, 3 asked for "
                                               r"nccl\): pass the same backend"):
        agree({0: ("gloo", "nccl"), 1: ("gloo", "nccl"), 2: ("nccl", "nccl"), 3: ("nccl", "nccl")})
    with pytest.raises(TorchrunEnvError, match=r"backend='nccl' was asked for, but rank 3 has no "
                                               r"GPU of their own"):
        agree({0: ("nccl", "nccl"), 1: ("nccl", "nccl"), 2: ("auto", "nccl"), 3: ("auto", "gloo")})


def test_every_rank_reads_the_same_choices_from_the_store_and_takes_the_same_backend():
    """Four ranks on two "nodes" (threads sharing one store, as torchrun's processes share
    the agent's): the node without GPUs makes every rank take gloo."""
    import datetime
    import threading

    import torch.distributed as dist

    from ddplab.launchers.torchrun import publish_and_agree

    store, results = dist.HashStore(), {}

    def rank(r):
        could = "nccl" if r < 2 else "gloo"  # node 0 has a GPU per rank, node 1 none
        results[r] = publish_and_agree(store, r, 4, "auto", could, datetime.timedelta(seconds=10))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (3, 1, 0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == {0: "gloo", 1: "gloo", 2: "gloo", 3: "gloo"}
