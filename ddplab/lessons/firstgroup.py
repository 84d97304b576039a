"""What torchrun sets up: two "nodes" on this machine, launched for real from a notebook.

Teaches: a process group is a set of processes that each know their ``rank``
(0 .. world_size-1), the ``world_size``, and where to meet (a rendezvous
store). ``torchrun`` is one way to give them that: on every machine ("node")
it starts ``--nproc-per-node`` processes and tells each, through environment
variables, its RANK (global), LOCAL_RANK (on this node: the GPU to use),
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (the node's index), and
MASTER_ADDR/MASTER_PORT (the store). With ``--rdzv-backend=c10d`` the nodes
meet at ``--rdzv-endpoint`` and the rendezvous decides which node gets which
ranks (``--node-rank`` is ignored, with a warning).

``two_nodes(script)`` runs ``script`` as two torchrun invocations on this
machine (two "nodes" meeting on 127.0.0.1 at a port the OS says is free,
never a fixed one), waits for both and returns each rank's printed lines.

Leaves out: real second machines (then HOST must be an address the other
machine can reach, and firewalls matter), elastic restarts, SLURM/MPI
launchers. The c10d store torchrun starts listens on every interface for
the few seconds the demo runs (torch's TCPStore does; docs/pitfalls.md):
ddplab's Cluster itself rendezvouses through a private file instead.

References: https://docs.pytorch.org/docs/stable/elastic/run.html;
tests/launchers/test_torchrun.py (the same launch, tested).
"""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import uuid

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")

# What each rank of the demo runs: print what torchrun told it, join, all-reduce its rank.
SHOW_ENV = '''import os
import torch
import torch.distributed as dist

names = {names!r}
dist.init_process_group("gloo")  # env:// : reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print(" ".join(f"{{k}}={{os.environ.get(k)}}" for k in names) + f" sum_of_ranks={{t.item():g}}",
      flush=True)
dist.barrier()
dist.destroy_process_group()
'''


def free_port() -> int:
    """A port free now, taken from BELOW the range the OS hands out by itself.

    Why below: the OS gives every ``bind(0)`` and every outgoing connection a port from
    ``/proc/sys/net/ipv4/ip_local_port_range`` (32768-60999 by default). A port from that
    range that is free now can be handed to any other process's next socket (another learner's
    ranks, a test's) before torchrun binds it; the node holding the store then cannot, and the
    two nodes wait for each other until the timeout (seen beside the graders' catalogue, whose
    ranks open sockets all the time). A port below that range is only ever taken by a process
    that asks for it by number. 10000-19999: Slurm job ports here are 20000 + job id % 12000
    (ddplab.launchers.schedulers)."""
    low = 32768
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    top = min(20000, low)
    for _ in range(200) if top > 10000 else ():
        port = random.randrange(10000, top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: try another
            return port
    with socket.socket() as s:  # no room below the OS's range: one of its own
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(script: str, port: int, job: str, nnodes: int, nproc_per_node: int,
                     is_host: bool) -> list:
    """The command one "node" runs (what you would type on each machine)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}",
            f"--rdzv-conf=is_host={int(is_host)},join_timeout=60", "--tee=3", script]


def two_nodes(script: str | None = None, nproc_per_node: int = 2, timeout: float = 120.0) -> dict:
    """Run ``script`` (source text; default: print torchrun's variables) on 2 local "nodes".

    Returns ``{"ranks": {rank: [lines]}, "commands": [...], "port": ...}``; raises
    ``RuntimeError`` with the nodes' stderr if either torchrun fails or times out.
    """
    source = script if script is not None else SHOW_ENV.format(names=TORCHRUN_VARS)
    port, job = free_port(), f"ddplab-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[rank ${rank}] ",
               OMP_NUM_THREADS="1")  # 2*nproc processes share this machine's cores
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # both "nodes" live on the loopback interface
    with tempfile.TemporaryDirectory(prefix="ddplab-torchrun-") as tmp:
        path = os.path.join(tmp, "show_env.py")
        with open(path, "w") as f:
            f.write(source)
        # is_host says which invocation holds the rendezvous store (the other joins it)
        commands = [torchrun_command(path, port, job, 2, nproc_per_node, is_host)
                    for is_host in (True, False)]
        nodes = [subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for cmd in commands]
        try:
            outputs = _wait_printing(nodes, timeout)
        finally:
            for node in nodes:  # ours only; a no-op once they exited
                node.kill()
                node.wait()
    for i, (node, (_, err)) in enumerate(zip(nodes, outputs)):
        if node.returncode != 0:
            raise RuntimeError(f"node {i}'s torchrun exited with {node.returncode}:\n{err[-3000:]}")
    ranks: dict = {}
    for out, _ in outputs:
        for line in out.splitlines():
            if line.startswith("[rank "):
                head, _, rest = line.partition("] ")
                ranks.setdefault(int(head[len("[rank "):]), []).append(rest)
    shown = ["torchrun " + " ".join(c[3:-1]) + " show_env.py" for c in commands]
    return {"ranks": dict(sorted(ranks.items())), "commands": shown, "port": port,
            "per_node": [sorted(int(l.partition("] ")[0][6:]) for l in out.splitlines()
                                if l.startswith("[rank ")) for out, _ in outputs]}


def _wait_printing(nodes, timeout: float) -> list:
    """Each node's (stdout, stderr), saying every few seconds that it is still waiting (a
    torchrun launch takes 10-25 s on a busy 2-core machine: a cell should not look stuck)."""
    t0 = time.monotonic()
    print(f"starting {len(nodes)} torchrun nodes (each imports torch, then they meet)...", flush=True)
    outputs = []
    for node in nodes:
        while True:
            try:
                outputs.append(node.communicate(timeout=5.0))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - t0 > timeout:
                    # a node that already failed says why the other is still waiting
                    failed = "".join(f"\nnode {i}'s torchrun exited with {n.returncode}:\n{err[-2000:]}"
                                     for i, (n, (_, err)) in enumerate(zip(nodes, outputs)) if n.returncode)
                    raise RuntimeError(f"torchrun did not finish within {timeout:g} s (a node could "
                                       f"not join the rendezvous?){failed}") from None
                print(f"  still waiting for torchrun ({time.monotonic() - t0:.0f} s)", flush=True)
    print(f"torchrun finished in {time.monotonic() - t0:.0f} s", flush=True)
    return outputs


def parse_vars(line: str) -> dict:
    """``"RANK=0 LOCAL_RANK=0 ..."`` -> ``{"RANK": "0", ...}``."""
    return dict(part.split("=", 1) for part in line.split() if "=" in part)
