"""Sharding the optimizer (ZeRO stage 1): each rank keeps the state of its share only.

What it teaches. Under DDP every rank holds the whole optimizer state: for
Adam that is two extra tensors the size of each parameter, so the state
alone takes twice the memory of the model, on every rank, to compute the
very same update everywhere. After DDP's all-reduce every rank already has
the same averaged gradient, so ONE rank per parameter is enough to step it:

    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    loss_fn(ddp_model(x), y).backward()   # DDP averages the gradients
    opt.step()                            # each rank steps its share, then
                                          # each owner broadcasts its parameters

1. Partition: the parameters are dealt out whole, largest first, each to the
   rank whose share is smallest so far (balanced by size: elements).
2. ``step()``: a local ``optimizer_cls`` that knows only this rank's share
   steps it; its state (momentum, exp_avg, exp_avg_sq) exists only here.
3. Each owner broadcasts its updated parameters; every rank ends with the
   weights the unsharded optimizer gives, bit for bit.

The state per rank falls toward 1/world_size in steps (whole parameters are
dealt, so a rank may keep the same share when a rank is added); what travels
per step is one extra copy of the parameters (the broadcasts), next to DDP's
all-reduce: 1.5x DDP's ring bytes. That is torch's ``ZeroRedundancyOptimizer``
behind DDP. The ZeRO paper's stage 1 reduce-scatters the gradients instead
and all-gathers the stepped parameters: 2Psi, DDP's own volume (Rajbhandari
et al. 2020, section 7.2).

``state`` holds this rank's share of the state. ``state_dict()`` follows
torch's ``ZeroRedundancyOptimizer``: call ``consolidate_state_dict(to=r)``
on every rank, then ``state_dict()`` on rank ``r`` returns the whole state
in the form the unsharded optimizer saves (other ranks raise).
``load_state_dict`` takes such a whole state dict on every rank and keeps
its share.

What it leaves out, compared with torch's ZeroRedundancyOptimizer:
``parameters_as_bucket_view`` (one broadcast per rank of a flat buffer, not
one per parameter), ``overlap_with_ddp`` (stepping each bucket from a DDP
communication hook), a partition given by hand, and the ``join()`` context
for uneven inputs. Gradients and parameters stay whole on every rank
(sharding those too is ZeRO-2 and ZeRO-3: FSDP, torch's ``fully_shard``).
Every rank must create the optimizer and call ``add_param_group`` with the
same parameters in the same order; both check the shapes on every rank, so a
mismatch is an error, not a hang.

References: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models" (SC 2020), stage 1 (P_os);
torch/distributed/optim/zero_redundancy_optimizer.py (``_partition_parameters``:
largest first, to the smallest rank; ``_sync_params``: one broadcast per
parameter from its owner); torch.optim.Optimizer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim import Optimizer

# options of torch's ZeroRedundancyOptimizer that this one leaves out
_NOT_HERE = ("overlap_with_ddp", "parameters_as_bucket_view")


class ShardedOptimizer(Optimizer):
    """``optimizer_cls(params, **kwargs)``, with its state sharded over the process group."""

    def __init__(self, params, optimizer_cls, process_group=None, **kwargs):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
            raise TypeError("ShardedOptimizer(params, optimizer_cls, **kwargs): optimizer_cls is "
                            f"an optimizer class such as torch.optim.Adam, got {optimizer_cls!r}")
        for name in _NOT_HERE:
            if name in kwargs:
                raise NotImplementedError(
                    f"ShardedOptimizer has no {name!r}: it steps after backward and broadcasts "
                    "one parameter at a time. torch.distributed.optim.ZeroRedundancyOptimizer "
                    "has it.")
        if not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer shards over a process group: start one first "
                               "(dist.init_process_group, or a ddplab.Cluster)")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.owner = {}  # parameter -> the rank (in the group) that steps it
        self._sizes = [0] * self.world_size  # elements given to each rank so far
        self.optim = None  # the local optimizer, made once the first groups are known
        super().__init__(params, kwargs)  # calls add_param_group for each group
        local = [self._local_group(g) for g in self.param_groups]
        self.optim = optimizer_cls(local, **kwargs)
        # our groups show every hyperparameter, as the unsharded optimizer's do (betas, eps...)
        self.defaults = self.optim.defaults
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)
        self.state = self.optim.state  # this rank's share of the state, nothing else

    # -- the partition --------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """Add a group on EVERY rank (same parameters, same order); its parameters are
        dealt out like the first ones, to the rank whose share is smallest."""
        super().add_param_group(param_group)  # checks, and fills in the defaults
        group = self.param_groups[-1]
        self._check_same_on_every_rank(group["params"])
        # largest first (a stable sort: equal sizes keep their order), each to the
        # rank with the fewest elements so far, the first such rank on a tie
        for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            rank = self._sizes.index(min(self._sizes))
            self.owner[p] = rank
            self._sizes[rank] += p.numel()
        if self.optim is not None:
            self.optim.add_param_group(self._local_group(group))

    def _local_group(self, group: dict) -> dict:
        """The same group, holding only this rank's parameters (possibly none)."""
        return {**group, "params": [p for p in group["params"] if self.owner[p] == self.rank]}

    def _check_same_on_every_rank(self, params) -> None:
        shapes = [tuple(p.shape) for p in params]
        every = [None] * self.world_size
        dist.all_gather_object(every, shapes, group=self.process_group)
        for r, theirs in enumerate(every):
            if theirs != shapes:
                raise ValueError(
                    f"ShardedOptimizer: rank {r} was given {len(theirs)} parameters and rank "
                    f"{self.rank} {len(shapes)} (shapes {theirs} and {shapes}): give every rank "
                    "the same parameters in the same order")

    # -- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Step this rank's share, then every owner broadcasts its parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # hyperparameters changed on our groups (a learning-rate schedule) reach the local ones
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update({k: v for k, v in group.items() if k != "params"})
        self.optim.step()
        # each rank sends its own share, and receives every other share from its owner
        works = []
        for rank in range(self.world_size):
            src = dist.get_global_rank(self.process_group, rank) if self.process_group else rank
            for group in self.param_groups:
                for p in group["params"]:
                    if self.owner[p] == rank:
                        works.append(dist.broadcast(p, src=src, group=self.process_group,
                                                    async_op=True))
        for work in works:
            work.wait()
        return loss

    # -- saving and loading ---------------------------------------------------------------
    def _indexed(self) -> dict:
        """Each parameter's index in the unsharded optimizer's state_dict."""
        params = [p for g in self.param_groups for p in g["params"]]
        return {p: i for i, p in enumerate(params)}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's share of the state on rank ``to``; call it on EVERY rank."""
        index = self._indexed()
        mine = {index[p]: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                for p, s in self.optim.state.items()}
        shares = [None] * self.world_size if self.rank == to else None
        dst = dist.get_global_rank(self.process_group, to) if self.process_group else to
        dist.gather_object(mine, shares, dst=dst, group=self.process_group)
        self._whole_state = None
        if self.rank == to:
            self._whole_state = {i: s for share in shares for i, s in share.items()}

    def state_dict(self) -> dict:
        """The whole state, as the unsharded optimizer's state_dict(), on the rank that
        ``consolidate_state_dict(to=...)`` named."""
        whole = getattr(self, "_whole_state", None)
        if whole is None:
            raise RuntimeError("each rank holds only its share of the optimizer state: call "
                               "consolidate_state_dict(to=r) on every rank, then state_dict() "
                               "on rank r")
        groups, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + n))})
            start += n
        return {"state": {i: whole[i] for i in sorted(whole)}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state dict (the unsharded optimizer's, or ``state_dict()``'s) on
        every rank: each keeps the state of its share only."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the state dict's parameter groups do not match this optimizer's")
        index = self._indexed()
        local_groups, local_state, n = [], {}, 0
        for group, saved_group in zip(self.param_groups, saved):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
            mine = []
            for p in group["params"]:
                if self.owner[p] == self.rank:
                    if index[p] in state_dict["state"]:
                        local_state[n] = state_dict["state"][index[p]]
                    mine.append(n)
                    n += 1
            local_groups.append({**{k: v for k, v in saved_group.items() if k != "params"},
                                 "params": mine})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.optim.state  # load_state_dict made a new one
