"""One process group for CPU and GPU tensors, one name for its backend, one device.

Teaches: a GPU rank still has CPU tensors to reduce: the clock alignment that
lines the ranks' timelines up, a used-parameter map, counters, a learner's
first ``all_reduce(torch.ones(1))``. A group started as ``"nccl"`` refuses all
of them ("No backend type associated with device type cpu"). torch can give
one group a backend per device type: ``"cpu:gloo,cuda:nccl"`` sends CPU
tensors through gloo and CUDA tensors through NCCL, so the same rank code runs
whatever the tensors' device. Gradients on the GPU still travel over NCCL:
that is what the lab times and names ``nccl``.

A plain group then answers ``dist.get_backend()`` with ``'cpu:gloo,cuda:nccl'``. Rank code asks
``backend_name()`` instead, which says ``'nccl'`` or ``'gloo'``, and
``device()`` for where its model and data belong (``cuda:N`` on an NCCL rank,
``cpu`` on a gloo rank); the Cluster's ranks, ``%%ddp`` cells and scripts
under torchrun all get the same answers. ``backend_description()`` gives the whole
description, for the doctor and the ``process_group`` field of a result.

The ranks' group is the observing one (``pg/group.py``): it wraps these real
groups, so ``dist.get_backend()`` answers ``'ddplab_gloo'`` or ``'ddplab_nccl'``.

Leaves out: other device types (xpu, mps), MPI and UCC backends, and a
separate CPU group (which would need its own rendezvous and doubles every
connection).

References: torch.distributed.init_process_group (backend strings of the form
"cpu:gloo,cuda:nccl", ``device_id``); docs/pitfalls.md, "GPUs and NCCL".
"""
from __future__ import annotations

import datetime

NCCL_GROUP = "cpu:gloo,cuda:nccl"
# The observing group (pg/group.py) wraps the real groups under these backend names.
OBSERVED = {"gloo": "ddplab_gloo", "nccl": "ddplab_nccl"}


def init_string(backend: str) -> str:
    """What ``init_process_group`` is given for a Cluster or torchrun backend name: the
    observing group (pg/group.py) around gloo, or around gloo and NCCL.

    Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` the ranks join the plain groups instead:
    torch checks collectives for mismatches by wrapping its own C++ groups
    (``_create_process_group_wrapper`` in torch/distributed/distributed_c10d.py) and
    leaves a Python group unwrapped, so DETAIL would name nothing. Such a Cluster is
    not observed: graders and recordings need one without DETAIL.
    """
    import os

    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
    return OBSERVED.get(backend, backend)


def gradient_backend(description: str) -> str:
    """``'cpu:gloo,cuda:nccl'`` -> ``'nccl'``: the backend that carries the gradients."""
    from ddplab.pg.group import BACKENDS

    description = BACKENDS.get(description, description)
    parts = dict(p.split(":", 1) for p in description.split(",") if ":" in p)
    if parts:
        return parts.get("cuda", parts.get("cpu", description))
    return description


def init_group(backend: str, *, rank: int, world_size: int, timeout: float | None = None,
               gpu: int | None = None, store=None, init_method: str | None = None) -> None:
    """Join the group: select this rank's GPU first (nccl), then one group for both devices."""
    import torch
    import torch.distributed as dist

    from ddplab.pg.group import register

    register()
    kwargs = {}
    if backend == "nccl":
        # Select the GPU before any CUDA work, or every rank would make a context on
        # GPU 0. No device_id: init_process_group would ask the group for its CUDA
        # backend to connect eagerly, and a Python group (pg/group.py) has none to give;
        # the observing group connects its NCCL half itself, on this GPU (inner.nccl_group).
        torch.cuda.set_device(gpu)
    if timeout is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout)
    if store is not None:
        kwargs["store"] = store
    if init_method is not None:
        kwargs["init_method"] = init_method
    dist.init_process_group(init_string(backend), rank=rank, world_size=world_size, **kwargs)


def backend_name(group=None) -> str:
    """``'nccl'`` or ``'gloo'`` for this rank's group (never the device-mapped string)."""
    import torch.distributed as dist

    return gradient_backend(str(dist.get_backend(group)))


def backend_description(group=None) -> str:
    """The group's full backend description, e.g. ``'cpu:gloo,cuda:nccl'``."""
    import torch.distributed as dist

    from ddplab.pg.group import BACKENDS

    name = str(dist.get_backend(group))
    return BACKENDS.get(name, name)


def device(group=None):
    """Where this rank's model and data belong: its GPU under nccl, else the CPU.

    The one device helper of the package. Outside a process group (one process, a test,
    the kernel) it is the CPU.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return torch.device("cpu")
    if backend_name(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
