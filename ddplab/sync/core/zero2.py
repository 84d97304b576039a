"""ZeRO stage 2 as the paper has it: reduce-scatter the gradients, step the shard, all-gather.

What it teaches. After backward every rank holds the whole gradient, as under
DDP. Instead of all-reducing it (every rank gets every average) this
optimizer REDUCE-SCATTERS it: rank r gets the average of its 1/world_size
slice of the flattened model only, and frees the whole gradients. It steps
that slice (its float32 copy of those parameters, and the optimizer state of
those elements only), then ALL-GATHERS the slices so that every rank holds the
updated model. Ring bytes per rank: (p-1)/p Psi + (p-1)/p Psi, exactly a ring
all-reduce's 2(p-1)/p Psi, DDP's volume (Rajbhandari et al. 2020, sec. 7.2),
while gradients and state per rank fall to 1/world_size.

    model = net                     # no DDP: this optimizer averages the gradients
    opt = ZeroTwo(model.parameters(), torch.optim.Adam, lr=1e-3)
    loss_fn(model(x), y).backward()
    opt.step()                      # reduce-scatter, step the slice, all-gather

The slice is cut from ONE flat vector of every parameter in order, padded with
zeros to a multiple of world_size, so every rank's share is even (torch's
ZeroRedundancyOptimizer deals whole parameters instead).

Leaves out, next to DeepSpeed's stage 2: reducing bucket by bucket during
backward (here the whole gradients live until ``step``, so the peak still
holds them once), overlap, mixed precision (float32 throughout), several
parameter groups with different hyperparameters (one group here).

It is a ``torch.optim.Optimizer`` with that one group, so learning-rate
schedulers work: a change to ``param_groups[0]`` reaches the local optimizer at
the next ``step``. ``state_dict()`` is this rank's: the local optimizer's state
of its slice (save one per rank, load each on the same rank and world size).

References: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models" (SC 2020), sections 5.2 and 7.2;
torch/distributed/distributed_c10d.py (``reduce_scatter_tensor``,
``all_gather_into_tensor``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddplab.sync.core.fsdp import check_same_on_every_rank, check_started


class ZeroTwo(torch.optim.Optimizer):
    """``optimizer_cls`` stepping this rank's slice of the flattened parameters."""

    def __init__(self, params, optimizer_cls, process_group=None, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        if not self.params or any(p.dtype != torch.float32 for p in self.params):
            raise ValueError("ZeroTwo takes float32 parameters that require grad (at least one)")
        check_started("ZeroTwo")
        check_same_on_every_rank("ZeroTwo", [(str(i), p) for i, p in enumerate(self.params)],
                                 process_group)
        self.group = process_group
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        with torch.no_grad():  # every rank starts from rank 0's weights, as DDP does
            src = dist.get_global_rank(process_group, 0) if process_group else 0
            for p in self.params:
                dist.broadcast(p, src, group=process_group)
        self.numel = sum(p.numel() for p in self.params)
        self.n = -(-self.numel // self.world_size)  # each rank's slice, the last one padded
        start = self.rank * self.n
        # this rank's float32 copy of its slice: what the local optimizer steps
        self.master_slice = nn.Parameter(self._flat(p.detach() for p in self.params)[start:start + self.n]
                                  .clone())
        self.optim = optimizer_cls([self.master_slice], **kwargs)  # its state: the slice's only
        # one group over the model's parameters, showing every hyperparameter (a scheduler's)
        super().__init__(self.params, dict(self.optim.defaults))

    def _flat(self, tensors) -> torch.Tensor:
        """The tensors flattened, concatenated and padded with zeros to world_size slices."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.cat([flat, flat.new_zeros(self.n * self.world_size - flat.numel())])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.optim.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """This rank's: the local optimizer's state of its slice, and the hyperparameters."""
        self._hyperparameters_down()
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """A state dict this rank saved (same world size): its slice's state comes back."""
        self.optim.load_state_dict(state_dict)
        self.param_groups[0].update({k: v for k, v in self.optim.param_groups[0].items()
                                     if k != "params"})

    def _hyperparameters_down(self) -> None:
        """A learning rate a scheduler set on our group reaches the local optimizer."""
        self.optim.param_groups[0].update({k: v for k, v in self.param_groups[0].items()
                                           if k != "params"})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._hyperparameters_down()
        grads = self._flat(torch.zeros_like(p) if p.grad is None else p.grad for p in self.params)
        mine = grads.new_empty(self.n)
        dist.reduce_scatter_single(mine, grads, group=self.group)  # slice r's sum, on rank r
        del grads
        for p in self.params:  # a rank keeps the gradients of its slice only
            p.grad = None
        self.master_slice.grad = mine.div_(self.world_size)
        self.optim.step()
        full = self.master_slice.new_empty(self.n * self.world_size)
        dist.all_gather_single(full, self.master_slice.detach(), group=self.group)
        offset = 0
        for p in self.params:  # the updated slices, back into every parameter
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return loss
