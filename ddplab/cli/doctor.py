"""``python -m ddplab doctor``: what this machine gives a data-parallel job.

Teaches: the facts that decide how a DDP run starts here: the torch build,
which backends it has (gloo is always there; nccl needs a CUDA build and
GPUs), which GPUs this process may see (CUDA_VISIBLE_DEVICES) and who else is
using each of them, how many CPUs it may use (affinity mask and cgroup quota,
not os.cpu_count()), and how loaded the machine is: on a server shared by a
class, other learners' ranks take cores and GPUs too. Last, what a class's hub
could enforce here per learner (``ddplab.course.limits.enforced``): cgroup v1
memory, processes, CPUs and GPU devices, a private /tmp, grading in a cgroup,
or only rlimits per process.

It never creates a CUDA context: GPUs are read through nvidia-smi (NVML).
"""
from __future__ import annotations

import os
import platform

from ddplab.placement import gpus as gpu_info
from ddplab.placement import resources


def ranks_on_machine() -> dict[int, int]:
    """ddplab ranks running on this machine, by user id (read from /proc)."""
    owners: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return owners
    for pid in filter(str.isdigit, entries):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            uid = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            continue
        if b"ddplab.cluster.worker" in cmd:
            owners[uid] = owners.get(uid, 0) + 1
    return owners


def report(world_sizes=(1, 2, 4, 8), found=None) -> dict:
    import torch
    import torch.distributed as dist

    found = gpu_info.discover() if found is None else found
    cpus = resources.usable_cpus()
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = None
    auto = {}
    for ws in world_sizes:
        placed = gpu_info.place(ws, "auto", found=found)
        auto[ws] = {"backend": placed.backend, "gpus": list(placed.gpus), "notes": list(placed.notes),
                    "threads_per_rank": resources.threads_per_rank(ws),
                    "oversubscribed": resources.oversubscribed(ws, placed.backend, cpus)}
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "backends": {name: bool(getattr(dist, f"is_{name}_available")())
                     for name in ("gloo", "nccl", "mpi")},
        "gpus_visible": len(found),
        "gpus": [{"index": g.index, "name": g.name, "total_mib": g.total_mib, "free_mib": g.free_mib,
                  "pids": None if g.pids is None else list(g.pids), "busy": g.busy_reason(),
                  "note": g.note} for g in found],
        "process_group": "cpu:gloo,cuda:nccl (CPU tensors via gloo, CUDA tensors via NCCL)"
                         if found else "gloo",
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cpu_count": os.cpu_count(),
        "usable_cpus": cpus,
        "load_1min": load1,
        "ddplab_ranks_by_uid": ranks_on_machine(),
        "auto": auto,
        "class_limits": class_limits(),
    }


def class_limits() -> dict[str, str]:
    from ddplab.course import limits

    return limits.enforced()


def main(world_sizes=(1, 2, 4, 8)) -> int:
    r = report(world_sizes)
    print(f"python          {r['python']}")
    print(f"torch           {r['torch']} (CUDA build: {r['cuda_build'] or 'no, CPU only'})")
    print("backends        " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in r["backends"].items()))
    cvd = r["cuda_visible_devices"]
    print(f"GPUs visible    {r['gpus_visible']}" + (f" (CUDA_VISIBLE_DEVICES={cvd})" if cvd is not None else ""))
    for g in r["gpus"]:
        mem = (f"{g['free_mib']} of {g['total_mib']} MiB free" if g["free_mib"] is not None
               else "memory unknown")
        users = ("users unknown" if g["pids"] is None else
                 f"used by pid(s) {', '.join(map(str, g['pids']))}" if g["pids"] else "no processes")
        warn = f"  <- busy: {g['busy']}" if g["busy"] else ""
        print(f"  GPU {g['index']}: {g['name']}, {mem}, {users}{warn}" + (f" ({g['note']})" if g["note"] else ""))
    if r["gpus"]:
        print(f"process group   nccl ranks join {r['process_group']}")
    print(f"usable CPUs     {r['usable_cpus']} (os.cpu_count()={r['cpu_count']})")
    by_uid = r["ddplab_ranks_by_uid"]
    n_ranks = sum(by_uid.values())
    load = f"{r['load_1min']:.1f}" if r["load_1min"] is not None else "unknown"
    print(f"load            1-min load {load} on {r['usable_cpus']} CPU(s); {n_ranks} ddplab rank(s) "
          f"running here, of {len(by_uid)} user(s)")
    if r["load_1min"] is not None and r["load_1min"] > r["usable_cpus"] * 0.75:
        print("                the machine is busy: pass Cluster(..., threads=1) so your ranks share "
              "the cores, and expect noisier timings")
    print("backend='auto' by world size:")
    for ws, a in r["auto"].items():
        note = "  (more ranks than CPUs: oversubscribed)" if a["oversubscribed"] else ""
        where = f" on GPUs {a['gpus']}" if a["gpus"] else ""
        print(f"  world_size={ws}: {a['backend']}{where}, {a['threads_per_rank']} thread(s) per rank{note}")
        for n in a["notes"]:
            print(f"    {n}")
    print("class limits    what `python -m ddplab classroom`'s hub enforces per learner here:")
    for what, how in r["class_limits"].items():
        print(f"  {what}: {how}")
    return 0
