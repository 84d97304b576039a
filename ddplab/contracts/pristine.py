"""Torch's process-wide state as a rank found it at start, and what a learner's cell changed since.

A rank lives across cells: ``torch.set_grad_enabled(False)``,
``torch.set_default_dtype(torch.float64)`` or ``dist.broadcast = my_version``
run once in a cell stays in force for every later cell, the graders' included,
and makes correct code fail (no gradient; float64 weights against float32
references; a collective that is not torch's). The worker calls ``capture()``
right after it joins its process group, before any learner code; a grader
calls ``changes()`` first and refuses, in words, to grade on a changed rank.

Leaves out: state that is not process-wide (a model's own flags), and torch
functions the graders do not call. References: torch.is_grad_enabled,
torch.get_default_dtype (torch/__init__.py), torch/distributed/distributed_c10d.py.
"""
from __future__ import annotations

# the torch.distributed functions the graders and the reference code call
DIST_NAMES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "barrier",
              "broadcast", "get_rank", "get_world_size", "irecv", "isend", "new_group", "recv",
              "reduce_scatter", "reduce_scatter_tensor", "send")
# functions newer than some torch versions: looked up only where they exist
OPTIONAL = ("all_gather_single", "reduce_scatter_single")
TORCH_NAMES = ("equal", "allclose", "cat", "zeros", "empty")

_ORIGINAL: dict = {}


def capture() -> None:
    """Note torch's own functions and defaults (once per process: a later call keeps the first)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if _ORIGINAL:
        return
    for name in DIST_NAMES + OPTIONAL:
        for where, module in (("dist", dist), ("c10d", c10d)):
            if hasattr(module, name):
                _ORIGINAL[(where, name)] = getattr(module, name)
    for name in TORCH_NAMES:
        _ORIGINAL[("torch", name)] = getattr(torch, name)
    _ORIGINAL["grad"] = torch.is_grad_enabled()
    _ORIGINAL["dtype"] = torch.get_default_dtype()


def changes() -> list[str]:
    """What differs from the captured state, each in words (empty: nothing, or never captured)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not _ORIGINAL:
        return []
    out = []
    if torch.is_grad_enabled() != _ORIGINAL["grad"]:
        out.append(f"grad mode is {'on' if torch.is_grad_enabled() else 'off'} "
                   "(torch.set_grad_enabled(...) outside a with block): torch.set_grad_enabled(True)")
    if torch.get_default_dtype() != _ORIGINAL["dtype"]:
        out.append(f"the default dtype is {torch.get_default_dtype()} "
                   f"(torch.set_default_dtype): torch.set_default_dtype({_ORIGINAL['dtype']})")
    modules = {"dist": ("torch.distributed", dist), "c10d": ("torch.distributed.distributed_c10d", c10d),
               "torch": ("torch", torch)}
    for key, original in _ORIGINAL.items():
        if not isinstance(key, tuple):
            continue
        label, module = modules[key[0]]
        now = getattr(module, key[1], None)
        if now is not original:
            what = getattr(now, "__qualname__", type(now).__name__)
            out.append(f"{label}.{key[1]} is not torch's own function (it is {what}, set by a cell)")
    return out
