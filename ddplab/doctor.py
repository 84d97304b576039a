"""``python -m ddplab doctor``: what this machine gives a data-parallel job.

Teaches: the four facts that decide how a DDP run starts here: the torch
build, which backends it has (gloo is always there; nccl needs a CUDA build
and GPUs), how many GPUs this process may see (CUDA_VISIBLE_DEVICES), and how
many CPUs it may use (affinity mask and cgroup quota, not os.cpu_count()).
It never creates a CUDA context.
"""
from __future__ import annotations

import os
import platform

from .cluster import resources


def report(world_sizes=(1, 2, 4, 8)) -> dict:
    import torch
    import torch.distributed as dist

    gpus = resources.visible_gpus()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "backends": {name: bool(getattr(dist, f"is_{name}_available")())
                     for name in ("gloo", "nccl", "mpi")},
        "gpus_visible": gpus,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cpu_count": os.cpu_count(),
        "usable_cpus": resources.usable_cpus(),
        "auto": {ws: {"backend": resources.choose_backend("auto", ws, gpus),
                      "threads_per_rank": resources.threads_per_rank(ws),
                      "oversubscribed": ws > resources.usable_cpus() and
                      resources.choose_backend("auto", ws, gpus) == "gloo"}
                 for ws in world_sizes},
    }


def main(world_sizes=(1, 2, 4, 8)) -> int:
    r = report(world_sizes)
    print(f"python          {r['python']}")
    print(f"torch           {r['torch']} (CUDA build: {r['cuda_build'] or 'no, CPU only'})")
    print("backends        " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in r["backends"].items()))
    cvd = r["cuda_visible_devices"]
    print(f"GPUs visible    {r['gpus_visible']}" + (f" (CUDA_VISIBLE_DEVICES={cvd})" if cvd is not None else ""))
    print(f"usable CPUs     {r['usable_cpus']} (os.cpu_count()={r['cpu_count']})")
    print("backend='auto' by world size:")
    for ws, a in r["auto"].items():
        note = "  (more ranks than CPUs: oversubscribed)" if a["oversubscribed"] else ""
        print(f"  world_size={ws}: {a['backend']}, {a['threads_per_rank']} thread(s) per rank{note}")
    return 0
