"""A ring all-reduce from send and recv, and what it costs: the algorithm behind all_reduce.

Teaches: the ring, the classic bandwidth-optimal way to all-reduce large
tensors (libraries choose among several algorithms per call; the ring is the
one whose cost is easiest to count). The tensor is cut into p chunks; in p-1 steps of
REDUCE-SCATTER every rank sends one chunk to its right neighbour and adds the
chunk arriving from its left, so that afterwards rank r holds the full sum of
one chunk; in p-1 steps of ALL-GATHER the finished chunks travel round the
ring once more. Each rank sends 2(p-1) chunks of n/p elements: 2(p-1)/p of
the data on its one outgoing link, almost twice the data however many ranks
there are. That is why DDP's traffic per step is about twice the gradients'
size, and why the time of an all-reduce hardly grows with p.

``ring_all_reduce(tensor)`` is ddplab's version (the lab's exercise is to
write it). Each step posts its send and its receive together
(``batch_isend_irecv``), then waits: NCCL asks that point-to-point calls which
must progress at the same time be one group (its user guide, "Point-to-point
communication"); a ring of blocking ``send`` then ``recv`` is not, and can
deadlock at 3 or more NCCL ranks. In plain torch only ``batch_isend_irecv``
makes that group (it coalesces a batch for torch's own NCCL groups); an
``isend`` or ``irecv`` called alone is an NCCL op of its own, which
ProcessGroupNCCL started with ``device_id`` (eager init) serializes with every
other op on the group, warning that it does. ``watch_p2p``
(``ddplab.pg.p2p_watch``, reachable here as ``ring.watch_p2p`` for lab 00) counts
every send and recv however it is spelled, notes a wait made before the other
half of its exchange was posted and a send or recv issued outside
``batch_isend_irecv``, and stops a wait that finds no partner after ``timeout``
seconds with a message instead of hanging. ``send_waits_on_rank`` measures
how long a blocking ``dist.send`` takes when the receiver is late: on gloo
(CPU tensors) ``send`` returns only once the receiver has posted its
``recv``, whatever the size; on NCCL ``send`` returns to the host once it is
queued on the GPU (``WorkNCCL::wait`` makes the current stream wait, see
torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp), so a ring in
which every rank sends first may or may not deadlock there: never rely on it.

Leaves out, compared with NCCL and gloo: trees and other algorithms chosen
for small messages or many nodes, pipelining a chunk in slices, several rings
over several links (NVLink), in-place buffers without copies, and reduce ops
other than SUM.

References: Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for
clusters of workstations" (2009); Baidu's ring all-reduce write-up (2017);
NCCL's docs on collective algorithms and on point-to-point communication
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/p2p.html);
torch.distributed send/recv/isend/irecv, P2POp, batch_isend_irecv.
"""
from __future__ import annotations

# The graders' watch on sends and recvs lives with the observing group it observes; lab 00
# counts its ring's bytes with it as ``ring.watch_p2p``.
from ddplab.pg.p2p_watch import P2PStalled, SizeMismatch, watch_p2p

__all__ = ["ring_all_reduce", "send_waits_on_rank", "ring_bytes_model", "ring_bytes_exact",
           "watch_p2p", "P2PStalled", "SizeMismatch"]


def ring_all_reduce(tensor, group=None):
    """SUM ``tensor`` over every rank, in place, with point-to-point messages only.

    Works for any length (chunks from ``torch.tensor_split`` differ by at most one
    element). Each step posts its send and its receive together, one
    ``batch_isend_irecv`` of two ``P2POp``, then waits for both: no rank waits for its
    receiver before receiving itself, and NCCL gets the send and the receive that must
    progress together as one group, which it needs (gloo would also take ``isend``,
    ``recv``, then the send's ``wait``).
    """
    import torch
    import torch.distributed as dist

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    if p == 1:
        return tensor
    flat = tensor.view(-1)  # a view: chunks below write into ``tensor`` itself
    chunks = torch.tensor_split(flat, p)
    right, left = _peer((rank + 1) % p, group), _peer((rank - 1) % p, group)
    for step in range(p - 1):  # reduce-scatter: chunk (rank - step) goes right
        send, recv = chunks[(rank - step) % p], chunks[(rank - step - 1) % p]
        recv.add_(_exchange(send, recv, right, left, group))
    for step in range(p - 1):  # all-gather: the finished chunk (rank + 1 - step) goes right
        send, recv = chunks[(rank + 1 - step) % p], chunks[(rank - step) % p]
        recv.copy_(_exchange(send, recv, right, left, group))
    return tensor


def send_waits_on_rank(delay_s: float = 0.5, numel: int = 1) -> dict:
    """Rank 0 ``dist.send``s ``numel`` floats to rank 1, which posts its ``recv`` only after
    ``delay_s``: how long did the blocking send take on rank 0? (Other ranks idle.)"""
    import time

    import torch
    import torch.distributed as dist

    from ddplab.pg.backend import backend_name, device

    t = torch.ones(numel, device=device())
    rank = dist.get_rank()
    took = None
    # line the ranks up first: rank 1's delay then counts from the moment rank 0 starts its send
    dist.barrier()
    if rank == 0:
        t0 = time.perf_counter()
        dist.send(t, 1)
        took = time.perf_counter() - t0
    elif rank == 1:
        time.sleep(delay_s)
        dist.recv(t, 0)
    dist.barrier()
    return {"backend": backend_name(), "send_s": took, "delay_s": delay_s, "numel": numel}


def _exchange(send, like, right, left, group):
    """Send ``send`` right while receiving a tensor shaped like ``like`` from the left:
    both posted as one group, then both waited for."""
    import torch
    import torch.distributed as dist

    incoming = torch.empty_like(like)
    ops = [dist.P2POp(dist.isend, send.contiguous(), right, group),
           dist.P2POp(dist.irecv, incoming, left, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return incoming


def _peer(group_rank, group):
    import torch.distributed as dist

    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def ring_bytes_model(numel: int, element_size: int, world_size: int) -> float:
    """Bytes one rank sends (= bytes on its outgoing link) in a ring all-reduce: 2(p-1)/p * n."""
    return 2 * (world_size - 1) / world_size * numel * element_size


def ring_bytes_exact(numel: int, element_size: int, world_size: int) -> list:
    """Bytes each rank sends in ``ring_all_reduce`` (chunks of unequal size make it differ a little)."""
    sizes = [numel // world_size + (1 if i < numel % world_size else 0) for i in range(world_size)]
    p = world_size
    return [element_size * sum(sizes[(r - s) % p] + sizes[(r + 1 - s) % p] for s in range(p - 1))
            for r in range(p)]
