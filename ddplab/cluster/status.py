"""Cluster.status() and %ddp_status: which rank is where, using what, doing what.

Teaches: a rank is an ordinary process. Its pid is what ``ps`` and ``top``
show; its resident memory (VmRSS in /proc/PID/status) is the host memory its
model, optimizer state and tensors take; under NCCL each rank also owns one
GPU, whose memory only that rank can ask torch about. The kernel reads
/proc itself, so status works while a job runs; the GPU figures come from
the ranks and only while they are idle.

Leaves out: per-thread CPU use (see ``top -H -p PID``), NCCL communicator
state, and nvidia-smi's view of other processes on the same GPU.

References: proc(5) (VmRSS); torch.cuda.memory_allocated/memory_reserved.
"""
from __future__ import annotations

import html
import time


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024  # kB -> MiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpu_memory():
    """Run on a rank: (allocated, reserved) MiB on its current GPU, or None on CPU."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    d = torch.cuda.current_device()
    return (torch.cuda.memory_allocated(d) / 2**20, torch.cuda.memory_reserved(d) / 2**20)


class ClusterStatus:
    """What ``Cluster.status()`` returns: ``.ranks`` (a dict per rank) and the
    cluster's ``backend``, ``timeout``, ``generation``; shown as a table."""

    def __init__(self, world_size, backend, timeout, generation, ranks, closed=False):
        self.world_size, self.backend, self.timeout = world_size, backend, timeout
        self.generation, self.ranks, self.closed = generation, ranks, closed

    def _head(self) -> str:
        if self.closed:
            return f"Cluster shut down (world_size={self.world_size}, backend {self.backend})"
        return (f"Cluster: {self.world_size} ranks, backend {self.backend}, collective timeout "
                f"{self.timeout:g} s, generation {self.generation} (ranks started "
                f"{self.generation + 1} time(s)), meeting on a private FileStore")

    COLUMNS = ("rank", "pid", "alive", "device", "host_mib", "gpu_mib", "job")

    def _cells(self, r: dict) -> list[str]:
        gpu = r["gpu_mib"]
        gpu_text = "-" if gpu is None else (gpu if isinstance(gpu, str) else
                                            f"{gpu[0]:.0f} alloc / {gpu[1]:.0f} reserved")
        host = "?" if r["host_mib"] is None else f"{r['host_mib']:.0f}"
        return [str(r["rank"]), str(r["pid"]), "yes" if r["alive"] else "NO", r["device"], host,
                gpu_text, r["job"]]

    def __repr__(self) -> str:
        rows = [list(self.COLUMNS)] + [self._cells(r) for r in self.ranks]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self.COLUMNS))]
        lines = [self._head()] + ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                                  for row in rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{c}</th>" for c in self.COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in self._cells(r)) + "</tr>"
                       for r in self.ranks)
        return (f"<div class='ddplab-status'><p>{html.escape(self._head())}</p>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


def cluster_status(cluster) -> ClusterStatus:
    """Read a Cluster's state; asks idle NCCL ranks for their GPU memory."""
    live = cluster._gens.ranks
    closed = cluster._gens.closed or live is None
    running = cluster.running  # read once: another thread may end the job meanwhile
    pids = cluster.pids
    gpu = [None] * cluster.world_size
    if not closed and running is None and cluster.backend == "nccl":
        try:
            gpu = cluster.run_job(_gpu_memory, show_ranks=())
        except Exception as exc:  # status must not fail because a rank did
            gpu = [f"unknown ({type(exc).__name__})"] * cluster.world_size
    ranks = []
    for r in range(cluster.world_size):
        pid = pids[r] if r < len(pids) else None
        alive = pid is not None and live is not None and live.alive(r)
        if running is None:
            job = "idle"
        elif r in running["pending"]:
            job = (f"running job {running['id']} ({running['name']}) for "
                   f"{time.monotonic() - running['start']:.1f} s")
        elif r not in running["ranks"]:
            job = f"idle (job {running['id']} runs on ranks {sorted(running['ranks'])} only)"
        else:
            job = f"done with job {running['id']}, waiting for the others"
        # the GPU the Cluster chose for this rank (numbered as the kernel sees them)
        device = f"cuda:{cluster.gpus[r]}" if cluster.backend == "nccl" else "cpu"
        gpu_r = gpu[r] if cluster.backend == "nccl" else None
        if cluster.backend == "nccl" and running is not None:
            gpu_r = "busy (ask when idle)"
        ranks.append({"rank": r, "pid": pid, "alive": alive, "device": device,
                      "host_mib": _rss_mib(pid) if pid else None, "gpu_mib": gpu_r, "job": job})
    return ClusterStatus(cluster.world_size, cluster.backend, cluster.timeout,
                         cluster.generation, ranks, closed)
