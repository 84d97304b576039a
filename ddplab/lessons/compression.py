"""Compression and what comes after DDP: fewer bytes on the wire, less optimizer state per rank.

Teaches, measured on the live ranks:

- ``hook_on_rank``: a comm hook that casts each bucket to float16 or
  bfloat16 halves the gradient bytes (counted at ``ddplab.sync.comm``) and
  moves the averaged gradient by a measurable relative error against the
  exact float64 mean. ddplab's hooks are used because torch 2.13 refuses a
  hook named ``bf16_compress_hook`` unless torch was BUILT with CUDA or HIP
  and NCCL >= 2.10, or with XCCL and sees an XPU (``bf16_hook_allowed``
  repeats that test; the devices and the backend in use do not enter it, so
  a CUDA build runs the hook on gloo CPU ranks, the CPU wheel refuses it:
  ``torch_hook_on_rank`` shows which), and because torch's hooks call
  torch.distributed directly, where nothing counts their bytes;
- ``zero_on_rank``: ``ZeroRedundancyOptimizer`` keeps each rank's share of
  the optimizer state only (about 1/world_size of Adam's two moments),
  counted tensor by tensor, and trains the same weights as plain Adam;
- ``fsdp_on_rank``: FSDP2's ``fully_shard`` also shards the parameters and
  gradients; the bytes of parameters held per rank are counted when it runs
  here (on gloo it may not: the error is returned, not hidden).

Leaves out: PowerSGD and error feedback, ZeRO stages 2/3 as separate
objects, FSDP's prefetching, mixed precision policies and CPU offload.
References: torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py;
torch/distributed/optim/zero_redundancy_optimizer.py;
torch/distributed/fsdp (fully_shard); Rajbhandari et al., ZeRO (2020).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddplab.lessons.common import wide_batch, wide_net
from ddplab.pg.backend import device
from ddplab.sync import comm


def exact_mean_grads(model, rank) -> list:
    """Each rank's float64 gradient on its own batch, averaged over ranks in float64."""
    import torch.distributed as dist

    ref = wide_net().double().to(device())
    ref.load_state_dict(model.state_dict())
    x, y = wide_batch(rank, dtype=torch.float64, on=device())
    F.mse_loss(ref(x), y).backward()
    grads = [p.grad for p in ref.parameters()]
    for gr in grads:
        dist.all_reduce(gr)  # outside comm.counting on purpose: the reference is not traffic
        gr.div_(dist.get_world_size())
    return grads


def relative_error(grads, ref) -> float:
    worst = max(float(r.abs().max()) for r in ref)
    return max(float((g.double().to(r.device) - r).abs().max()) for g, r in zip(grads, ref)) / worst


def hook_on_rank(hook="none", bucket_cap_mb: float = 0.01) -> dict:
    """One backward of BucketedDDP with ``hook`` ('none', 'fp16', 'bf16' or a hook function):
    gradient bytes and calls, and the relative error against the exact float64 mean."""
    import torch.distributed as dist

    from ddplab.sync import comm_hooks
    from ddplab.sync.registry import build_strategy

    rank = dist.get_rank()
    model = build_strategy("bucketed", wide_net().to(device()), bucket_cap_mb=bucket_cap_mb).model
    if hook != "none":
        fn = {"fp16": comm_hooks.fp16_compress_hook, "bf16": comm_hooks.bf16_compress_hook}.get(hook, hook)
        model.register_comm_hook(None, fn)
    x, y = wide_batch(rank, on=device())
    with comm.counting() as counted:
        F.mse_loss(model(x), y).backward()
    ref = exact_mean_grads(model.module, rank)
    return {"bytes": counted.grad_bytes, "calls": counted.grad_calls,
            "grad_dtype": str(model.module[0].weight.grad.dtype),
            "rel_error": relative_error([p.grad for p in model.module.parameters()], ref)}


def bf16_hook_allowed() -> bool:
    """torch 2.13's test in ``DistributedDataParallel._check_comm_hook`` for a hook named
    ``bf16_compress_hook``: how torch was built (CUDA/HIP with NCCL >= 2.10), or XCCL with an
    XPU present. Which devices or backend the ranks use does not enter it."""
    import torch.distributed as dist

    cuda_build = torch.version.cuda is not None or torch.version.hip is not None
    nccl = dist.is_available() and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    xccl = (dist.is_available() and getattr(dist, "is_xccl_available", lambda: False)()
            and hasattr(torch, "xpu") and torch.xpu.is_available())
    return bool((cuda_build and nccl) or xccl)


def torch_hook_on_rank(name: str) -> dict:
    """Register torch's own ``default_hooks.<name>`` on torch DDP and run one step:
    ``{"ran": bool, "error": message or None}`` (bf16 runs only where ``bf16_hook_allowed``)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(wide_net().to(device()))
    x, y = wide_batch(dist.get_rank(), on=device())
    try:
        ddp.register_comm_hook(None, getattr(default_hooks, name))
        F.mse_loss(ddp(x), y).backward()
    except Exception as err:  # the refusal is what is shown
        return {"ran": False, "error": f"{type(err).__name__}: {err}".split("\n")[0],
                "bf16_allowed": bf16_hook_allowed()}
    return {"ran": True, "error": None, "grad_dtype": str(ddp.module[0].weight.grad.dtype),
            "bf16_allowed": bf16_hook_allowed()}


def state_bytes(optimizer) -> int:
    """Bytes of every tensor in an optimizer's per-parameter state (Adam: step, exp_avg, exp_avg_sq)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values()
               for t in s.values() if torch.is_tensor(t))


def zero_on_rank(steps: int = 3, width: int = 128, depth: int = 6) -> dict:
    """Adam on torch DDP, plain and as ZeroRedundancyOptimizer, from the same start on the same data.

    Returns this rank's optimizer-state bytes for each, the parameter bytes, and the largest
    weight difference between the two runs after ``steps`` steps.
    """
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    plain, zero = (DDP(wide_net(0, width, depth).to(device())) for _ in range(2))
    opt_plain = torch.optim.Adam(plain.parameters(), lr=1e-3)
    opt_zero = ZeroRedundancyOptimizer(zero.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    for step in range(steps):
        x, y = wide_batch(rank, step, on=device())
        for model, opt in ((plain, opt_plain), (zero, opt_zero)):  # noqa: B007
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    gap = max(float((a - b).detach().abs().max()) for a, b in zip(plain.module.parameters(),
                                                          zero.module.parameters()))
    return {"plain_state_bytes": state_bytes(opt_plain),
            "zero_state_bytes": state_bytes(opt_zero.optim),  # the local shard's optimizer
            "param_bytes": sum(p.numel() * p.element_size() for p in plain.parameters()),
            "weight_gap": gap}


def fsdp_on_rank(width: int = 128, depth: int = 6) -> dict:
    """Parameter bytes this rank holds after ``fully_shard`` (FSDP2), or why it did not run."""
    import torch.distributed as dist

    model = wide_net(0, width, depth).to(device())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device().type, (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        x, y = wide_batch(dist.get_rank(), on=device())
        F.mse_loss(model(x), y).backward()  # gathers layer by layer, then reduce-scatters
        grad_held = sum(p.grad.to_local().numel() * p.grad.element_size() for p in model.parameters())
    except Exception as err:
        return {"ran": False, "error": f"{type(err).__name__}: {err}".split("\n")[0], "full_bytes": full}
    return {"ran": True, "full_bytes": full, "param_bytes_held": held, "grad_bytes_held": grad_held}
