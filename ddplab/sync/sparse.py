"""Sparse gradients (``nn.Embedding(..., sparse=True)``): a bucket of one, no flat buffer.

Teaches why sparse gradients do not go into buckets. An embedding's
gradient with ``sparse=True`` lists only the rows this batch touched
(indices and values), and each rank touched other rows. It cannot be
copied into a slice of a flat dense buffer without losing the point, so
torch's reducer gives each such parameter a bucket of its own and
all-reduces the sparse tensor itself; gloo sums sparse tensors by
gathering every rank's indices and values. The result is sparse again:
the rows any rank touched, averaged over the ranks.

As in torch, which parameters have sparse gradients is decided when the
wrapper is built, from the modules that say so (``module.sparse`` is True:
``nn.Embedding``, ``nn.EmbeddingBag``); a sparse gradient anywhere else,
or a dense one for such a parameter, is an error that says which.

On NCCL ranks: NCCL has no sparse all-reduce (torch's
``ProcessGroupNCCL::allreduce_sparse`` raises "NCCL does not support
all_reduce with sparse tensors"), so the choke point sends sparse tensors to
``ddplab.sync.sparse_gather.all_reduce_by_gather``, which does what gloo does
inside its own all-reduce.

Leaves out, compared with torch: comm hooks on sparse buckets (refused by
``register_comm_hook``), ``gradient_as_bucket_view`` for them (a sparse
gradient is never a view of a bucket), and an asynchronous sparse
all-reduce on NCCL (the gather waits on the host for the other ranks'
lengths: torch's DDP on NCCL fails instead).

References: torch/csrc/distributed/c10d/reducer.cpp
(``mark_variable_ready_sparse``, ``expect_sparse_gradients``);
torch/csrc/distributed/c10d/ProcessGroupGloo.cpp (``AsyncSparseAllreduceWork``);
torch/nn/parallel/distributed.py (``_build_params_for_reducer``).
"""
from __future__ import annotations

import torch
from torch import nn

from ddplab.sync import comm


def sparse_parameter_ids(module: nn.Module) -> set:
    """``id``s of the parameters whose gradients will be sparse (as torch decides)."""
    return {id(p) for m in module.modules() if getattr(m, "sparse", False) is True
            for p in m.parameters(recurse=False)}


def not_sparse_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"BucketedDDP: parameter {name} got a sparse gradient, but no module holding it says "
        "sparse=True, so it was given a dense bucket when the wrapper was built (torch decides "
        "the same way). Set the module's sparse=True before wrapping.")


class SparseBucket:
    """One parameter with a sparse gradient; the same interface as ``bucket.Bucket``."""

    def __init__(self, index: int, param, name: str, world_size: int):
        self.index = index
        self.params = [param]
        self.names = (name,)
        self.world_size = world_size
        self.divide = True
        self.as_view = False
        self.nbytes = 0  # varies with the rows touched; the choke point counts each step's
        self.numel = param.numel()
        self.reset()

    def reset(self) -> None:
        self.ready_slots = [False]
        self.n_ready = 0
        self.work = None
        self.future = None
        self.grad = None

    @property
    def ready(self) -> bool:
        return self.n_ready == 1

    def mark_ready(self, slot: int) -> None:
        """Take this step's sparse gradient now (divided): there is no buffer to fill."""
        p = self.params[0]
        grad = p.grad
        if grad is None:  # not used on this rank: contribute no rows
            grad = torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.long),
                                           torch.empty((0,) + tuple(p.shape[1:]), dtype=p.dtype),
                                           tuple(p.shape), device=p.device)
        elif not grad.is_sparse:
            raise RuntimeError(
                f"BucketedDDP: parameter {self.names[0]} got a dense gradient, but its module "
                "says sparse=True (so its bucket was built for a sparse one). Do not change a "
                "module's sparse flag after wrapping.")
        # a new tensor: dividing in place would change a .grad the user may still hold
        self.grad = grad / self.world_size if self.divide else grad.clone()
        self.ready_slots[0] = True
        self.n_ready = 1

    def fill(self) -> None:
        pass  # done by mark_ready

    def launch(self, group, recorder=None) -> None:
        self.work = comm.all_reduce(self.grad, group, async_op=True, bucket=self.index,
                                    params=self.names, recorder=recorder)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.grad  # gloo writes the sum back into the tensor it was given

    def write_back(self, reduced, skip=()) -> None:
        if 0 not in skip:
            self.params[0].grad = reduced

    def missing(self) -> list:
        return [] if self.ready_slots[0] else [self.names[0]]
