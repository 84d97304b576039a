"""Unused parameters: which gradients will never come, known before backward starts.

Teaches why a model with a branch that sits out some iterations (or runs on
some ranks only) hangs or fails under plain bucketed DDP, and how torch's
reducer fixes it with ``find_unused_parameters=True``:

- a bucket leaves only when every gradient in it is ready; a parameter that
  took no part in the forward gets no gradient, so its bucket, and every
  bucket after it (they leave in index order), would never leave;
- so at the end of forward, walk the autograd graph back from the
  forward's outputs (``unused_parameters``): every parameter whose
  gradient-accumulator node is not reached will get no gradient in this
  backward. At backward's first hook those are marked ready at once, with
  zeros (or with the ``.grad`` they already hold, e.g. from ``no_sync``
  micro-steps), so their buckets can leave;
- "unused here" is not "unused everywhere": one more, tiny all-reduce of a
  0/1 "used" map (``UsedMap``) tells each rank which parameters got a
  gradient on SOME rank. Those get the average like any other (this rank
  contributed zeros); a parameter used on no rank keeps its ``.grad``
  untouched (``None`` stays ``None``), so the optimizer skips it as it
  would in one process.

The walk costs one visit per autograd node at every forward, in Python here
(in C++ in torch), which is why torch warns when it finds nothing unused,
and why ``static_graph=True`` (see ``bucketed.py``) learns the unused set
once and stops walking.

Leaves out, compared with torch: outputs that are in the graph but not used
by the loss (torch handles hooks that fire with no gradient; here such a
parameter counts as used and its missing gradient is reported as an
error), torch's lazy wait on the used map (it waits only if some parameter
was unused on this rank; here the small all-reduce, queued behind the last
bucket, is always waited for, so no work is left pending: on NCCL that wait
is a stream wait, and the map is read back to the host, as in torch, only
when some parameter sat out on this rank), and the warning when nothing
was unused.

References: torch/csrc/distributed/c10d/reducer.cpp
(``search_unused_parameters``, ``autograd_hook``, ``all_reduce_local_used_map``,
``finalize_bucket_dense``); torch/nn/parallel/distributed.py
(``_find_tensors``); torch.autograd.graph.Node (``next_functions``).
"""
from __future__ import annotations

import dataclasses

import torch

from ddplab.sync import comm


def output_tensors(obj) -> list:
    """The tensors in a forward's output, found where torch's DDP looks for them
    (``_find_tensors``): tensors, lists, tuples (named ones too), dict values and
    dataclass fields, nested in any way. Anything else is not searched."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in output_tensors(item)]
    return []


def reached_leaves(outputs) -> set:
    """``id``s of the leaf tensors whose gradient a backward from ``outputs`` would compute."""
    found, seen, stack = set(), set(), []
    for t in output_tensors(outputs):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:  # forward returned a parameter itself
            found.add(id(t))
    while stack:
        node = stack.pop()
        if node in seen:  # a node shared by two paths is walked once
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad: where a leaf's .grad is written
        if leaf is not None:
            found.add(id(leaf))
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return found


def unused_parameters(outputs, params) -> list:
    """Indices into ``params`` of those a backward from ``outputs`` will give no gradient."""
    reached = reached_leaves(outputs)
    return [i for i, p in enumerate(params) if id(p) not in reached]


class UsedMap:
    """Which parameters got a gradient on this rank (``local``, 0/1 per
    parameter) and, after one all-reduce, on any rank.

    ``local`` is the wrapper's ``grad_marks`` (see ``wrapper_duties.GradSyncModule``):
    a bytearray its hooks write, because a hook writes one byte in nanoseconds
    where indexing a tensor from Python costs microseconds. It is cleared
    after each synchronizing backward, so parameters used in ``no_sync``
    micro-steps count as used at the step that synchronizes.
    """

    def __init__(self, local: bytearray, group=None, recorder=None, device=None):
        self.local = local
        self.group = group
        self.device = device  # nccl reduces device tensors only
        self.recorder = recorder
        self._work = None
        self._reduced = None

    @property
    def launched(self) -> bool:
        return self._work is not None

    def launch(self) -> None:
        """Start the all-reduce (SUM) of the map; every rank launches it at the same point."""
        local = torch.tensor(list(self.local), dtype=torch.int32)
        if local.device != torch.device(self.device or "cpu"):
            # pinned and non_blocking, as torch's reducer copies its map: a copy from
            # pageable memory would make the host wait for the GPU's queued work
            local = local.pin_memory().to(self.device, non_blocking=True)
        self._reduced = local
        # kind "used_map": not gradient payload, so comm_bytes_per_step is unchanged
        self._work = comm.all_reduce(self._reduced, self.group, async_op=True, kind="used_map",
                                     recorder=self.recorder)

    def unused_everywhere(self, candidates) -> set:
        """Those of ``candidates`` (indices) that got a gradient on no rank."""
        self._work.wait()  # on NCCL a stream wait, not a host wait
        if not candidates:  # as torch: read the map back only when something sat out here
            return set()
        counts = self._reduced.tolist()  # a host read (waits for the GPU), as in torch then
        return {i for i in candidates if counts[i] == 0}

    def reset(self) -> None:
        self.local[:] = bytes(len(self.local))
        self._work = self._reduced = None
