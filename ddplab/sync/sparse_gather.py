"""A sparse all-reduce where the backend has none: gather every rank's rows, then add.

Teaches: NCCL has no sparse all-reduce (torch's ``ProcessGroupNCCL::allreduce_sparse``
raises "NCCL does not support all_reduce with sparse tensors"); gloo has one, and does
inside it what this module does in the open: every rank all-gathers the others'
indices and values (dense tensors, which NCCL moves) and adds them up. The lengths
differ from rank to rank, so they travel first and the blocks are padded to the
longest. ``ddplab.sync.comm`` sends sparse tensors here on NCCL ranks.

Leaves out: an asynchronous version (the lengths are read on the host, a sync that
torch's DDP on NCCL never reaches, since it refuses sparse gradients there).

References: torch/csrc/distributed/c10d/ProcessGroupGloo.cpp (``AsyncSparseAllreduceWork``);
ProcessGroupNCCL.cpp (``allreduce_sparse``).
"""
from __future__ import annotations

import torch


class FinishedWork:
    """A ``Work`` whose collective has already run (``wait()`` returns at once)."""

    def __init__(self, tensor):
        self.future = torch.futures.Future()
        self.future.set_result([tensor])

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self):
        return self.future

    def is_completed(self) -> bool:
        return True


def all_reduce_by_gather(tensor, group=None) -> FinishedWork:
    """SUM-all-reduce the sparse ``tensor`` in place with dense all-gathers (for NCCL)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    mine = tensor.coalesce()
    idx, vals = mine._indices(), mine._values()
    # The lengths first: the blocks are padded to the longest, and only the real part counts.
    n = torch.tensor([idx.shape[1]], dtype=torch.int64, device=idx.device)
    counts = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(counts, n, group=group)
    counts = [int(c.item()) for c in counts]  # a host sync, as in gloo's sparse all-reduce
    most = max(counts)
    padded_idx = idx.new_zeros((idx.shape[0], most))
    padded_idx[:, :idx.shape[1]] = idx
    padded_vals = vals.new_zeros((most,) + tuple(vals.shape[1:]))
    padded_vals[:vals.shape[0]] = vals
    all_idx = [torch.empty_like(padded_idx) for _ in range(world)]
    all_vals = [torch.empty_like(padded_vals) for _ in range(world)]
    dist.all_gather(all_idx, padded_idx, group=group)
    dist.all_gather(all_vals, padded_vals, group=group)
    total = torch.sparse_coo_tensor(torch.cat([a[:, :c] for a, c in zip(all_idx, counts)], 1),
                                    torch.cat([v[:c] for v, c in zip(all_vals, counts)]),
                                    tuple(mine.shape), device=idx.device).coalesce()
    with torch.no_grad():
        tensor.copy_(total)  # in place, as gloo's sparse all-reduce leaves it
    return FinishedWork(tensor)
