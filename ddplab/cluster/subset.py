"""A job on some ranks only, and why a collective cannot run there.

Teaches: a collective is a meeting of every rank in its group. If rank 0 alone
calls ``dist.all_reduce`` while rank 1 waits for its next job, rank 0 waits
for a partner that never comes, until the group's timeout (a minute here, 30
minutes by default in torch), and gloo's group is unusable after that. So a
job sent to some ranks only (``Cluster.run_job(..., ranks=[0])``, ``%%ddp --on
0``) runs with torch.distributed's collectives replaced by ones that raise
``NotTakingPart`` at once, naming the ranks that are missing. A collective on
a group made only of the ranks taking part still runs. A forward pass of a
torch DDP model with gradients on is refused too: torch's C++ reducer would
all-reduce in the backward that follows, out of Python's reach (under
``torch.no_grad()`` or ``model.module(x)`` it runs).

Leaves out: collectives reached without going through ``torch.distributed``'s
functions (methods of a ProcessGroup object). Those still wait for the
timeout, which then names the stuck rank.

References: torch.distributed (collective semantics: every rank of the group
must call it); ipyparallel's ``%%px --targets`` (the same idea for engines,
which do not share collectives).
"""
from __future__ import annotations

import functools
import inspect

# torch.distributed's functions that need every rank of their group (the last
# two are what torch DDP's constructor and forward call to sync parameters).
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "broadcast_object_list",
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced",
    "gather", "gather_object", "scatter", "scatter_object_list", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "new_group", "new_subgroups",
    "_broadcast_coalesced", "_verify_params_across_processes",
)


class NotTakingPart(RuntimeError):
    """A collective was called in a job that runs on some ranks only."""


def check(ranks, world_size: int) -> set[int]:
    """The set of ranks a job runs on; ValueError saying what is allowed."""
    try:
        chosen = {int(r) for r in ranks}
    except (TypeError, ValueError):
        raise ValueError(f"ranks must be rank numbers, e.g. ranks=[0]; got {ranks!r}") from None
    if not chosen:
        raise ValueError("ranks is empty: name at least one rank, e.g. ranks=[0]")
    bad = sorted(r for r in chosen if not 0 <= r < world_size)
    if bad:
        raise ValueError(f"ranks {bad} do not exist: this cluster has ranks 0..{world_size - 1}")
    return chosen


def _group_inside(dist, original, args, kwargs, targets) -> bool:
    """True when the call names a group whose ranks all take part in the job."""
    try:
        bound = inspect.signature(original).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):  # C functions without a signature
        return False
    group = bound.arguments.get("group")
    if group is None or group is dist.group.WORLD:
        return False
    try:
        return set(dist.get_process_group_ranks(group)) <= set(targets)
    except Exception:
        return False


def _refusing(dist, name: str, original, targets, world_size):
    others = [r for r in range(world_size) if r not in targets]

    @functools.wraps(original)
    def refuse(*args, **kwargs):
        __tracebackhide__ = True
        if name not in ("new_group", "new_subgroups") and _group_inside(dist, original, args, kwargs, targets):
            return original(*args, **kwargs)
        raise NotTakingPart(
            f"dist.{name}() was called in a job that runs on rank(s) {list(targets)} only "
            f"(%%ddp --on): rank(s) {others} are not taking part, so this collective could never "
            "complete. Run collectives in a cell that runs on every rank (without --on).")

    return refuse


def _refusing_ddp_forward(original, targets, world_size):
    import torch

    others = [r for r in range(world_size) if r not in targets]

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        __tracebackhide__ = True
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            raise NotTakingPart(
                f"a DistributedDataParallel forward with gradients on, in a job that runs on rank(s) "
                f"{list(targets)} only (%%ddp --on): its backward would all-reduce gradients with "
                f"rank(s) {others}, which are not taking part. Inspect under torch.no_grad(), or "
                "call model.module(...).")
        return original(self, *args, **kwargs)

    return forward


def guarded_call(targets, fn, *args, **kwargs):
    """Run ``fn`` with torch.distributed's collectives refusing to start."""
    __tracebackhide__ = True
    import sys

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    world_size = dist.get_world_size() if dist.is_initialized() else max(targets) + 1
    saved = []
    for module in (dist, distributed_c10d):
        for name in COLLECTIVES:
            original = getattr(module, name, None)
            if original is not None:
                saved.append((module, name, original))
                setattr(module, name, _refusing(dist, name, original, targets, world_size))
    ddp = sys.modules.get("torch.nn.parallel.distributed")  # not imported: no DDP model exists
    if ddp is not None:
        cls = ddp.DistributedDataParallel
        saved.append((cls, "forward", cls.forward))
        cls.forward = _refusing_ddp_forward(cls.forward, targets, world_size)
    try:
        return fn(*args, **kwargs)
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
