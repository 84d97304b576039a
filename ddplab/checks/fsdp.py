"""Grader for FSDP's two collectives: your gather-before-use and your gradient reduce-scatter.

``check_fsdp_collectives(cluster, gather_full, reduce_scatter_grad)`` runs on
the live ranks, for a weight of 35 elements (padded at 2 and 3 ranks) and
one of 36 (padded at neither: a padding rule that is not ceil shows there):

- ``gather_full(shard, numel, shape, group=None)``: this rank's padded piece
  (rank r holds elements ``r*len(shard)`` to ``(r+1)*len(shard)`` of the
  flattened weight, padded with zeros) -> the full weight, shaped ``shape``;
- ``reduce_scatter_grad(full_grad, group=None)``: this rank's full gradient
  -> this rank's piece of the gradient AVERAGED over ranks (padded, flat).

It checks, from outside: the VALUES, against the exact answer and against
the answers the usual mistakes give (its own shard only, the sum, the whole
averaged gradient, another rank's piece, the padding left in); and WHAT was
SENT: the payload bytes the rank's observing group was handed, which a
gather must keep to the shard (an all-reduce of a zero-padded full weight
gets the right values for the price of the whole weight), and the reduce's
ring bytes, which must not exceed a reduce-scatter's (gathering every whole
gradient and averaging locally is right in value, world_size times the bytes). Then both run
inside ddplab's reference FSDP (``ddplab.sync.core.fsdp``) for two training
steps, which must equal the reference's.

Leaves out: compute_dtype casts, several weights in one call, timing.
"""
from __future__ import annotations

import itertools

from ddplab.checks import graders
from ddplab.checks.mistakes import HUNG, CheckFailed
from ddplab.cluster.errors import RankError
from ddplab.pg.group import ObserverBase, observe
from ddplab.pg.inner import payload_bytes

NOT_GATHERED = "the gathered weight is this rank's shard only"
PADDING_LEFT = "the gathered weight still holds the padding"
WRONG_ORDER = "the pieces are in the wrong order"
GATHER_WRONG = "the gathered weight is not the full weight"
GATHER_TOO_MANY_BYTES = "the gather sent the whole weight, not the shard"
NOT_REDUCED = "the gradient piece is this rank's own, not reduced over ranks"
NO_DIVISION = "the gradient piece is the sum over ranks, not the average"
WHOLE_GRADIENT = "the whole averaged gradient came back, not this rank's piece"
WRONG_PIECE = "another rank's piece of the gradient"
SCATTER_WRONG = "the gradient piece differs from the average over ranks"
ALL_REDUCED = "the gradient was all-reduced, then cut"
WRONG_PADDING = "the gradient piece has the wrong length: padded to another size than ceil"
GATHERED_GRADIENTS = "every whole gradient was gathered and averaged on each rank"
SCATTER_TOO_MANY_BYTES = "the reduce step sent more than a reduce-scatter's ring bytes"
TRAINS_WRONG = "inside FSDP, training differs from the reference"

EXPLAIN = {
    NOT_GATHERED: "all-gather every rank's piece: dist.all_gather_single(out, shard), with out "
                  "world_size times the shard's length.",
    PADDING_LEFT: "the last piece is padded with zeros: keep the first numel elements, then "
                  "view(shape).",
    WRONG_ORDER: "all_gather_single puts rank r's piece at position r: take the output as it is.",
    GATHER_WRONG: "",
    GATHER_TOO_MANY_BYTES: "send the shard, 1/world_size of the weight (all_gather_single): "
                           "an all-reduce of a zero-padded full weight costs the whole weight.",
    NOT_REDUCED: "reduce-scatter the padded gradient (dist.reduce_scatter_single), then divide "
                 "by world_size.",
    NO_DIVISION: "divide the reduced piece by the world size: FSDP averages gradients as DDP does.",
    WHOLE_GRADIENT: "return only this rank's piece (reduce_scatter_single gives exactly that), "
                    "flat and padded like the shard.",
    WRONG_PIECE: "rank r keeps piece r: reduce_scatter_single's output on rank r is piece r.",
    SCATTER_WRONG: "",
    ALL_REDUCED: "an all-reduce sends each rank the whole average, twice a reduce-scatter's ring "
                 "traffic (it IS a reduce-scatter followed by an all-gather): reduce_scatter_single.",
    WRONG_PADDING: "each rank's piece is n = ceil(numel / world_size) elements (-(-numel // "
                   "world_size)); pad the flat gradient to n * world_size.",
    GATHERED_GRADIENTS: "the values are right, but each rank sent its whole gradient to every "
                        "other rank: world_size times a reduce-scatter's ring bytes. "
                        "dist.reduce_scatter_single sums piece r onto rank r only.",
    SCATTER_TOO_MANY_BYTES: "a reduce-scatter sends (world_size - 1) / world_size of the padded "
                            "gradient per rank: use dist.reduce_scatter_single alone.",
    TRAINS_WRONG: "",
}
graders.TITLES.setdefault("fsdp", "FSDP gather and reduce-scatter")
SHAPE = (5, 7)  # 35 elements: padded at 2 and at 3 ranks
SHAPES = (SHAPE, (6, 6))  # and 36: no padding at 2 or 3 ranks, where a wrong padding rule shows


class _Bytes(ObserverBase):
    def __init__(self):
        self.nbytes, self.ops, self.calls = 0, [], []

    def launched(self, op, tensors, group, peer):
        nbytes = sum(payload_bytes(t) for t in tensors)
        self.nbytes += nbytes
        self.ops.append(op)
        self.calls.append((op, nbytes))


def _close(a, b) -> bool:
    import torch

    return a is not None and tuple(a.shape) == tuple(b.shape) and torch.allclose(
        a.double(), b.double(), atol=1e-6, rtol=1e-6)


def _ring_bytes(ops_bytes, p) -> float:
    """What the rank sent in a ring for the calls it made (all-gathers: handed their input)."""
    factor = {"all_reduce": 2 * (p - 1) / p, "broadcast": (p - 1) / p}
    return sum(n * ((p - 1) if "all_gather" in op else (p - 1) / p if "reduce_scatter" in op
                    else factor.get(op, 1)) for op, n in ops_bytes)


def _on_rank(gather_full, reduce_scatter_grad):
    for shape in SHAPES:
        _values(gather_full, reduce_scatter_grad, shape)
    return _trains_like_the_reference(gather_full, reduce_scatter_grad)


def _values(gather_full, reduce_scatter_grad, shape):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, ws = dist.get_rank(), dist.get_world_size()
    numel = shape[0] * shape[1]
    weight = torch.arange(numel, dtype=torch.float32).view(shape) + 1
    n = -(-numel // ws)
    padded = F.pad(weight.reshape(-1), (0, n * ws - numel))
    shard = padded[rank * n:(rank + 1) * n].clone()
    seen = _Bytes()
    with observe(seen):
        full = gather_full(shard.clone(), numel, shape)
    full = None if full is None else torch.as_tensor(full).detach()
    if not _close(full, weight):
        if full is not None and full.numel() == n:
            raise CheckFailed(NOT_GATHERED, EXPLAIN[NOT_GATHERED])
        if full is not None and full.numel() == n * ws and _close(full.reshape(-1), padded):
            raise CheckFailed(PADDING_LEFT, EXPLAIN[PADDING_LEFT])
        pieces = list(padded.view(ws, n))
        if full is not None and full.numel() == numel and any(  # the right pieces, another order
                _close(full.reshape(-1), torch.cat(order)[:numel])
                for order in itertools.permutations(pieces)):
            raise CheckFailed(WRONG_ORDER, EXPLAIN[WRONG_ORDER])
        raise CheckFailed(GATHER_WRONG, f"rank {rank} got {None if full is None else tuple(full.shape)}"
                                        f" where the weight is {shape}")
    if seen.nbytes > shard.numel() * shard.element_size():
        raise CheckFailed(GATHER_TOO_MANY_BYTES, f"handed {seen.nbytes} bytes ({', '.join(seen.ops)})"
                          f"; the shard is {shard.numel() * 4}. " + EXPLAIN[GATHER_TOO_MANY_BYTES])

    grads = [torch.randn(shape, generator=torch.Generator().manual_seed(r)) for r in range(ws)]
    flat = [F.pad(g.reshape(-1), (0, n * ws - numel)) for g in grads]
    total = torch.stack(flat).double().sum(0)
    seen = _Bytes()
    with observe(seen):
        mine = reduce_scatter_grad(grads[rank].clone())
    mine = None if mine is None else torch.as_tensor(mine).detach().reshape(-1)
    answer = (total / ws)[rank * n:(rank + 1) * n]
    if not _close(mine, answer):
        wrong = [(flat[rank][rank * n:(rank + 1) * n], NOT_REDUCED),
                 (total[rank * n:(rank + 1) * n], NO_DIVISION),
                 (total / ws, WHOLE_GRADIENT), ((total / ws)[:numel], WHOLE_GRADIENT)]
        wrong += [((total / ws)[r * n:(r + 1) * n], WRONG_PIECE) for r in range(ws) if r != rank]
        for value, mistake in wrong:
            if _close(mine, value):
                raise CheckFailed(mistake, EXPLAIN[mistake])
        if mine is not None and mine.numel() != n:
            raise CheckFailed(WRONG_PADDING, f"rank {rank}: {mine.numel()} elements for a weight of "
                                             f"{numel} at {ws} ranks, where n = {n}. "
                                             + EXPLAIN[WRONG_PADDING])
        raise CheckFailed(SCATTER_WRONG, f"rank {rank}: expected {n} values, the average of the "
                                         f"ranks' gradients in piece {rank}")
    if "all_reduce" in seen.ops:
        raise CheckFailed(ALL_REDUCED, EXPLAIN[ALL_REDUCED])
    sent, allowed = _ring_bytes(seen.calls, ws), (ws - 1) / ws * 4 * n * ws
    if sent > allowed * (1 + 1e-9):
        mistake = GATHERED_GRADIENTS if any("all_gather" in op for op in seen.ops) \
            else SCATTER_TOO_MANY_BYTES
        raise CheckFailed(mistake, f"rank {rank} sent {sent:.0f} ring bytes where a reduce-scatter "
                                   f"sends {allowed:.0f}. " + EXPLAIN[mistake])


def _trains_like_the_reference(gather_full, reduce_scatter_grad) -> float:
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddplab.sync.core.fsdp import FSDP

    class Yours(FSDP):  # the reference, with each weight gathered and reduced by your code
        def all_gather(self, unit):
            return [torch.as_tensor(gather_full(sp.shard.detach().clone(), sp.numel, sp.shape))
                    .reshape(sp.shape) for sp in unit.params]

        def reduce_scatter(self, unit, grads):
            return [None if g is None else torch.as_tensor(reduce_scatter_grad(g.detach().clone()))
                    .reshape(-1) for g in grads]

    out = []
    for cls in (Yours, FSDP):
        torch.manual_seed(0)
        model = cls(nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            g = torch.Generator().manual_seed(10 * step + dist.get_rank())
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            model.finish_gradient_synchronization()
            opt.step()
        out.append(model.full_parameters())
    worst = max((out[0][k] - out[1][k]).abs().max().item() for k in out[1])
    if worst > 1e-6:
        raise CheckFailed(TRAINS_WRONG, f"after 2 steps the weights differ by {worst:.2e}")
    return worst


def check_fsdp_collectives(cluster, gather_full, reduce_scatter_grad):
    """Your two functions on every rank: values, bytes sent, then two steps inside FSDP."""
    graders.passed["fsdp"] = False
    try:
        worst = cluster.run(_on_rank, gather_full, reduce_scatter_grad)
    except RankError as err:
        said = " ".join(f"{type(e).__name__} {e}" for e in err.exceptions.values() if e is not None)
        if any(w in said.lower() for w in ("timed out", "timeout", "connection closed")):
            # a collective not every rank made: one rank waited it out, the other saw it go
            cluster.ensure_ready(stale="FSDP's check stopped in a collective that not every "
                                       "rank made.")
            raise CheckFailed(HUNG, str(err).splitlines()[0] + "\nEvery rank must make every "
                              "all-gather and reduce-scatter, with the same sizes.") from None
        raise graders.from_rank_error(err) from None
    graders.passed["fsdp"] = True
    print(f"FSDP gather and reduce-scatter: passed. Correct on {cluster.world_size} ranks (weights of "
          f"35 and 36 elements), and two training steps inside FSDP equal the reference "
          f"(largest difference {max(worst):.1e}).")
    return True
