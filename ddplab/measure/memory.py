"""Memory per rank, measured: what each rank holds under DDP, ZeRO-1 and FSDP.

Teaches: the memory a rank needs is read from the tensors it holds, never
worked out on paper. For each row (a way to train: ``ddp``, ``zero1``,
``torch_zero``) and each world size, every rank builds the same model,
trains a few steps, and reports in bytes:

- ``params``, ``grads``: the storages of its model's parameters and of their
  ``.grad`` (a storage shared by two tensors counts once);
- ``optimizer_state``: the tensors in its optimizer's ``state`` (for a
  sharded optimizer, the local one's: this rank's share);
- ``peak``: the most bytes of tensor storage alive at once during a step,
  everything the rank made included (activations, DDP's buckets, the
  optimizer's temporaries, broadcast buffers); ``sent_by_op``: the bytes the
  last step handed the observing group, per collective. A ``TorchDispatchMode`` sees
  every op's outputs; a finalizer on each storage takes its bytes off when
  it is freed. On a GPU, ``cuda_peak`` is ``torch.cuda.max_memory_allocated``
  over the step too.

Rows are one entry each in ``ROWS``: ``build(model, optimizer_cls, **kwargs)``
returns ``(model_to_train, optimizer)``. Under FSDP (``fsdp``: ddplab's,
``torch_fsdp2``: torch's ``fully_shard``) the model's parameters ARE the
shards the rank holds (a DTensor counts its local shard), read the same way;
its peak includes the full weights of the layer being gathered. A storage
resized in place (FSDP frees gathered weights with ``resize_(0)``) is counted
at its size after each op.

World sizes smaller than the ranks at hand are measured on a group of the
first N ranks (``torch.distributed.new_group``), the others waiting: what a
rank holds depends on the size of the group it trains in, not on how many
processes exist, and one set of ranks for every N costs a fraction of
starting ranks anew for each (every rank imports torch).

Leaves out: memory outside tensor storages (the Python heap, gloo's own
buffers, the allocator's caching on CPU), and buffers (BatchNorm's
statistics). Between two ops a storage's size is not watched: the peak is
read at op boundaries.

References: torch.utils._python_dispatch.TorchDispatchMode;
torch.UntypedStorage (one Python object per storage, so a weakref finalizer
fires when the storage is freed); torch.cuda.max_memory_allocated.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

FIELDS = ("params", "grads", "optimizer_state", "peak")


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive on this rank: those it is told about (``track``)
    and every op's outputs while the mode is on; ``peak`` since ``reset_peak()``."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, weakref.ref] = {}  # storage -> the storage (while it lives)
        self.peak = 0

    @property
    def now(self) -> int:
        """Read at each call: FSDP resizes storages in place (``resize_(0)`` to free)."""
        return sum(s.nbytes() for s in (r() for r in list(self.live.values())) if s is not None)

    def track(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and hasattr(t, "to_local"):
                t = t.to_local()  # a DTensor: the rank holds its local shard
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.live:
                    self.live[key] = weakref.ref(storage)
                    weakref.finalize(storage, self.live.pop, key, None)
        self.peak = max(self.peak, self.now)

    def reset_peak(self) -> None:
        self.peak = self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(tree_leaves(out))
        return out


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (None skipped)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and hasattr(t, "to_local"):
            t = t.to_local()  # a DTensor (torch's fully_shard): this rank's shard
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer) -> list:
    """The tensors in the optimizer's state; a sharded one's local optimizer counts instead
    (ddplab's ShardedOptimizer and torch's ZeroRedundancyOptimizer both keep it as ``.optim``)."""
    inner = getattr(optimizer, "optim", None)
    state = (inner if isinstance(inner, torch.optim.Optimizer) else optimizer).state
    return [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def held(model, optimizer) -> dict:
    """What this rank holds now: parameters, gradients, optimizer state, in bytes. ZeRO-2's
    float32 copy of its slice counts as optimizer state (the paper's K counts the masters
    there), its slice's gradient as gradients."""
    params = list(model.parameters())
    mine = [t for t in [getattr(optimizer, "master_slice", None)] if t is not None]
    return {"params": storage_bytes(params),
            "grads": storage_bytes([*(p.grad for p in params), *(t.grad for t in mine)]),
            "optimizer_state": storage_bytes([*optimizer_state_tensors(optimizer), *mine])}


# -- the rows: how a rank trains ----------------------------------------------------------

def _ddp(model, optimizer_cls, group=None, **kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, process_group=group)
    return ddp, optimizer_cls(ddp.parameters(), **kwargs)


def _zero1(model, optimizer_cls, group=None, **kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.sync.core.sharded_optimizer import ShardedOptimizer

    ddp = DDP(model, process_group=group)
    return ddp, ShardedOptimizer(ddp.parameters(), optimizer_cls, process_group=group, **kwargs)


def _torch_zero(model, optimizer_cls, group=None, **kwargs):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, process_group=group)
    return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_cls, process_group=group, **kwargs)


def _zero2(model, optimizer_cls, group=None, **kwargs):
    from ddplab.sync.core.zero2 import ZeroTwo

    return model, ZeroTwo(model.parameters(), optimizer_cls, process_group=group, **kwargs)  # it reduces


def _fsdp(model, optimizer_cls, group=None, **kwargs):
    from ddplab.sync.core.fsdp import FSDP

    fsdp = FSDP(model, process_group=group)  # model's sharded weights are now this rank's shards
    return fsdp, optimizer_cls(fsdp.parameters(), **kwargs)


def _torch_fsdp2(model, optimizer_cls, group=None, **kwargs):
    from ddplab.sync.registry import build_strategy

    model = build_strategy("torch_fsdp2", model, process_group=group).model  # the row's units
    return model, optimizer_cls(model.parameters(), **kwargs)


ROWS = {"ddp": _ddp, "zero1": _zero1, "torch_zero": _torch_zero, "zero2": _zero2, "fsdp": _fsdp,
        "torch_fsdp2": _torch_fsdp2}


def default_model(width: int = 256, depth: int = 4):
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def measure_rank(row: str, make_model=default_model, optimizer_cls=torch.optim.Adam,
                 steps: int = 3, batch: int = 16, lr: float = 1e-3, group=None) -> dict:
    """On each rank (``Cluster.run``): train ``steps`` steps under ``row`` and report
    what the rank holds after the last one, and the peak and bytes sent during it.
    Three steps by default: in its second step torch's DDP rebuilds its buckets and
    broadcasts their layout (tens of bytes), a one-off the third step no longer has.
    ``group``: train in that process group (the default: every rank)."""
    import contextlib

    import torch.distributed as dist

    from ddplab.pg.backend import device
    from ddplab.pg.group import observe, observing_group
    from ddplab.timeline.op_bytes import OpBytes

    dev = device()
    torch.manual_seed(0)
    counter = LiveBytes()
    with counter:
        model = make_model().to(dev)
        counter.track(model.parameters())
        # the input's width, read before FSDP swaps the weights for shards (and no reference
        # to a weight kept: FSDP frees the full ones, and the peak would count one still held)
        width = next((p.shape[-1] for p in model.parameters()), None)
        if width is None:
            raise ValueError(f"make_model built a {type(model).__name__} without parameters: there is "
                             "nothing to hold or to train; pass a model with at least one parameter")
        trained, opt = ROWS[row](model, optimizer_cls, group=group, lr=lr)
        g = torch.Generator().manual_seed(dist.get_rank())
        sent = OpBytes()  # what the last step handed the group, where it is an observing one
        for i in range(steps):
            last = i == steps - 1 and observing_group(group) is not None
            x = torch.randn(batch, width, generator=g).to(dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            counter.reset_peak()
            with observe(sent, group) if last else contextlib.nullcontext():
                opt.zero_grad(set_to_none=True)
                trained(x).square().mean().backward()
                if hasattr(trained, "finish_gradient_synchronization"):  # ddplab's FSDP
                    trained.finish_gradient_synchronization()
                opt.step()
        out = {**held(model, opt), "peak": counter.peak, "sent_by_op": dict(sent.by_op)}
    if dev.type == "cuda":
        out["cuda_peak"] = torch.cuda.max_memory_allocated(dev)
    return out


def checked(rows, world_sizes=(1,)) -> tuple[tuple, tuple]:
    """``rows`` and ``world_sizes`` as tuples, refused in words before any rank runs: rows are
    names from ``ROWS``; world sizes whole numbers from 1, each measured once, in the order given."""
    import numbers

    if isinstance(rows, str):
        raise TypeError(f"rows is a tuple of row names, not one string: rows=({rows!r},)")
    rows = tuple(rows)
    if not rows:
        raise ValueError("no rows given: e.g. rows=('ddp', 'zero1')")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}: name rows from ddplab.measure.memory.ROWS "
                         f"({', '.join(ROWS)})")
    sizes = []
    for n in world_sizes:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"world sizes are whole numbers of ranks from 1 up, got {n!r}")
        if int(n) not in sizes:
            sizes.append(int(n))
    if not sizes:
        raise ValueError("no world sizes given: e.g. world_sizes=(1, 2, 3, 4)")
    return rows, tuple(sizes)


def measure(rows=("ddp", "zero1"), world_sizes=(1, 2, 3, 4), **kwargs) -> list:
    """Start ranks once, as many as the largest world size, and measure every row at each
    world size there (``measure_sizes``): one dict per (row, world size, rank), with the
    FIELDS in bytes."""
    from ddplab.cluster import Cluster

    rows, world_sizes = checked(rows, world_sizes)
    with Cluster(world_size=max(world_sizes)) as cluster:
        return measure_sizes(cluster, rows, world_sizes, **kwargs)


def measure_on(cluster, rows=("ddp", "zero1"), **kwargs) -> list:
    """The same on the ranks of a running ``Cluster`` (a lab's): one dict per (row, rank)."""
    rows, _ = checked(rows)
    return [{"row": row, "world_size": cluster.world_size, "rank": rank, **got}
            for row in rows for rank, got in enumerate(cluster.run(measure_rank, row, **kwargs))]


def measure_sizes(cluster, rows, world_sizes, **kwargs) -> list:
    """Every row at each world size N on ``cluster``'s ranks: N equal to the cluster's size on
    all of them (``measure_on``), a smaller N on a group of its first N ranks while the others
    wait. One dict per (row, world size, rank)."""
    rows, world_sizes = checked(rows, world_sizes)
    too_big = [n for n in world_sizes if n > cluster.world_size]
    if too_big:
        raise ValueError(f"world sizes {too_big} need more ranks than the cluster's "
                         f"{cluster.world_size}: start a Cluster of {max(world_sizes)}")
    out = []
    for n in world_sizes:
        if n == cluster.world_size:
            out += measure_on(cluster, rows, **kwargs)
            continue
        per_rank = cluster.run(_measure_in_group, n, rows, **kwargs)
        out += [{"row": row, "world_size": n, "rank": rank, **got[i]}
                for i, row in enumerate(rows) for rank, got in enumerate(per_rank[:n])]
    return out


def _measure_in_group(n: int, rows, **kwargs):
    """On every rank: a group of ranks 0..n-1 (every rank calls ``new_group``, torch's rule,
    member or not); its members measure each row in it, the others return None."""
    import torch.distributed as dist

    group = dist.new_group(list(range(n)))
    if dist.get_rank() >= n:
        return None
    try:
        return [measure_rank(row, group=group, **kwargs) for row in rows]
    finally:
        dist.destroy_process_group(group)
