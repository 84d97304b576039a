"""Traffic of data parallel against model parallel: what each sends per step, counted.

Teaches (lab 08):
- torch DDP sends one gradient per parameter per step, whatever the batch
  size: ``ddp_traffic_on_rank`` watches torch's own DDP from the observing
  process group (``DDPTracer``), which counts every bucket it all-reduces;
- a model split in two stages across two ranks (model parallel, the
  simplest pipeline) sends the activation between the stages forward and
  its gradient backward, so its traffic grows with the batch size:
  ``pipeline_step`` with ``p2p_counting`` (``ddplab.pg.p2p_watch``) counting
  every send;
- where they cross: per rank, DDP puts ``2(p-1)/p`` times the gradient bytes
  on its link (a ring all-reduce), the pipeline ``batch x hidden x
  element size`` each way; ``crossover_batch`` solves for the batch size
  where the two are equal.

The stage-to-stage transfer is point-to-point ``send``/``recv`` on the
Cluster's own process group. ``torch.distributed.rpc`` (which the older
model-parallel tutorials use) starts a TensorPipe agent with listening
sockets of its own, on the address the host name resolves to (or
``TP_SOCKET_IFNAME``): loopback on a machine whose name resolves to
127.0.0.1, the network on a server. This project opens no listener beyond
loopback, and the tensors moved are the same, so the bytes are the same. ``torch.distributed.pipelining`` also uses
send/recv between stages.

Leaves out: micro-batching (GPipe, 1F1B schedules) that fills the pipeline's
bubble, tensor parallelism, and any timing: here only bytes are counted.
References: torch/distributed/pipelining (stages exchange activations with
P2P send/recv); GPipe (Huang et al., 2019); torch/nn/parallel/distributed.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddplab.pg.p2p_watch import p2p_counting
from ddplab.sync import comm

D_IN, HIDDEN, D_OUT = 64, 256, 10


def two_stage_model(seed: int = 0, dtype=torch.float32) -> nn.Sequential:
    """Four Linear layers with a ReLU between each; modules [0:4] (two Linear layers, 55 % of
    the parameters) are stage 0, [4:] (two, 45 %) stage 1; the cut carries HIDDEN features."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D_OUT)).to(dtype)


def split(model: nn.Sequential):
    """(stage 0, stage 1): the same modules, shared with ``model``."""
    return model[:4], model[4:]


def batch(size: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, D_IN, generator=g, dtype=dtype), torch.randn(size, D_OUT, generator=g, dtype=dtype)


def loss_fn(out, y):
    return F.mse_loss(out, y)


def pipeline_step(stage, x, y, act_shape):
    """One forward and backward of the two-stage model: rank 0 holds stage 0, rank 1 stage 1.

    Rank 0 gets ``x`` and returns None; rank 1 gets ``y`` and returns the loss.
    ``act_shape`` is the activation's shape at the cut (rank 1 must allocate it).
    """
    import torch.distributed as dist

    if dist.get_rank() == 0:
        h = stage(x)
        dist.send(h.detach(), dst=1)  # the activation, forward
        grad_h = torch.empty_like(h)
        dist.recv(grad_h, src=1)  # d loss / d activation, backward
        h.backward(grad_h)  # the rest of backward, through stage 0
        return None
    h = torch.empty(act_shape, dtype=y.dtype)
    dist.recv(h, src=0)
    h.requires_grad_()  # so that backward leaves d loss / d h in h.grad
    loss = loss_fn(stage(h), y)
    loss.backward()
    dist.send(h.grad, dst=0)
    return loss.detach()


def pipeline_traffic_on_rank(batch_size: int, step=pipeline_step) -> dict:
    """Bytes this rank sends and receives in one pipeline step (ranks beyond 1 stay idle)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    stages = split(two_stage_model())
    if rank > 1:
        return {"rank": rank, "sent": 0, "received": 0, "sends": 0, "recvs": 0, "param_bytes": 0}
    stage = stages[rank]
    x, y = batch(batch_size)
    with p2p_counting() as counted:
        step(stage, x, y, (batch_size, HIDDEN))
    return {"rank": rank, **counted.as_dict(),
            "param_bytes": sum(p.numel() * p.element_size() for p in stage.parameters())}


# On the CPU on purpose, also on NCCL ranks: it counts bytes, which no device changes.
@comm.cpu_gradients_on_purpose()
def ddp_traffic_on_rank(batch_size: int, steps: int = 2) -> dict:
    """Gradient bytes torch DDP all-reduces per step, seen at the process group, training the
    whole model here."""
    import torch.distributed as dist

    from ddplab.sync.registry import build_strategy

    built = build_strategy("ddp", two_stage_model())
    model, tracer = built.model, built.tracer
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    per_step = []
    for step in range(steps):
        x, y = batch(batch_size, seed=1 + dist.get_rank() + 100 * step)
        with tracer.watching():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
        seen = tracer.end_iteration()
        opt.step()
        per_step.append({"bytes": seen["nbytes"], "calls": seen["n_buckets"]})
    world = dist.get_world_size()
    payload = per_step[-1]["bytes"]
    return {"per_step": per_step, "bytes": payload, "calls": per_step[-1]["calls"],
            "wire_bytes": 2 * (world - 1) / world * payload,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def traffic(cluster, batch_sizes=(32, 1024)) -> dict:
    """{batch size: {"ddp": rank 0's DDP counts, "pipeline": [rank 0's, rank 1's]}}.

    The same batch size for both: per rank for DDP (each rank has its own
    batch), per step for the pipeline (both stages work on the one batch).
    """
    out = {}
    for b in batch_sizes:
        out[b] = {"ddp": cluster.run(ddp_traffic_on_rank, b)[0],
                  "pipeline": cluster.run(pipeline_traffic_on_rank, b)[:2]}
    return out


def crossover_batch(ddp_wire_bytes: float, pipeline_bytes_small: float, small: int,
                    pipeline_bytes_large: float, large: int) -> float:
    """The batch size where the pipeline's per-rank bytes equal DDP's, from two measured points.

    The pipeline's bytes are a line in the batch size (measured at ``small`` and
    ``large``); DDP's are flat. Below the crossover the pipeline sends less.
    """
    slope = (pipeline_bytes_large - pipeline_bytes_small) / (large - small)
    if slope <= 0:
        raise ValueError("the pipeline's bytes did not grow with the batch size: count them again")
    return small + (ddp_wire_bytes - pipeline_bytes_small) / slope
