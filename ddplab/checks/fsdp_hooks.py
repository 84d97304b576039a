"""Lab 12's grader, part 1: each of the learner's four FSDP hooks alone, on one unit at a time.

A fresh reference FSDP (``ddplab.sync.core.fsdp.FSDP``) of a two-layer model whose
weights have 35, 7, 42 and 6 elements; after each hook the layer's weights are
read (full and right, shaped, in rank order, freed, swapped back), the shard's
gradient (the average of the ranks' gradients, this rank's piece: not the sum,
not averaged twice, not another piece, added to what the shard held) and the
ring bytes each collective costs, per op. Each mistake has a name (the
constants below) and an explanation (``EXPLAIN``); ``ddplab.checks.fsdp`` runs
these checks, then two training steps, and words the verdict.

Leaves out: what the hooks do inside training (``ddplab.checks.fsdp``).
References: torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py,
_fsdp_collectives.py (``foreach_all_gather``, ``foreach_reduce``).
"""
from __future__ import annotations

from ddplab.checks import graders
from ddplab.checks.mistakes import CheckFailed
from ddplab.pg.group import ObserverBase, observe
from ddplab.pg.inner import payload_bytes

NOT_GATHERED = "the layer got this rank's shard only, not the gathered weight"
NOT_SWAPPED_IN = "the gathered weights were never swapped into the layer"
PADDING_LEFT = "the gathered weight still holds the padding"
NOT_SHAPED = "the gathered weight was never given its shape"
WRONG_ORDER = "the pieces are in the wrong order"
GATHER_WRONG = "the gathered weight is not the full weight"
GATHER_TOO_MANY_BYTES = "the gather sent more than the shards"
NOT_FREED = "the full weights' memory was not released after the forward"
NOT_SWAPPED_BACK = "the layer kept the full weights after the forward"
NOT_REGATHERED = "the weights were not gathered again before the backward"
NEW_TENSORS = "gathered again into new tensors, not the ones autograd saved"
NO_GRADIENT = "the shard got no gradient"
NOT_REDUCED = "the gradient piece is this rank's own, not reduced over ranks"
NO_DIVISION = "the gradient piece is the sum over ranks, not the average"
DIVIDED_TWICE = "the gradient piece averaged twice"
WHOLE_GRADIENT = "the whole averaged gradient, not this rank's piece"
WRONG_PIECE = "another rank's piece of the gradient"
FREED_TOO_EARLY = "the full weights were freed before the layer used them"
ASSIGNED = "assigned, not added: accumulation would lose earlier micro-batches"
WRONG_PADDING = "the gradient piece has the wrong length: padded to another size than ceil"
SCATTER_WRONG = "the gradient piece differs from the average over ranks"
ALL_REDUCED = "an all-reduce where a reduce-scatter goes"
GATHERED_GRADIENTS = "every whole gradient was gathered and averaged on each rank"
SCATTER_TOO_MANY_BYTES = "the reduce step sent more than a reduce-scatter's ring bytes"
GRAD_KEPT = "the full gradient was kept after its reduce-scatter"
NOT_FREED_AFTER_BACKWARD = "the full weights' memory was not released after the backward"
TRAINS_WRONG = "inside FSDP, training differs from one process and from fully_shard"

EXPLAIN = {
    NOT_GATHERED: "all-gather every rank's piece: dist.all_gather_single(out, shard), out "
                  "world_size times the shard's length.",
    NOT_SWAPPED_IN: "put the full weights into unit.fulls and call fsdp.swap_in(unit): the layer "
                    "reads its weights from its own attributes.",
    PADDING_LEFT: "the last piece is padded with zeros: keep the first sp.numel elements.",
    NOT_SHAPED: "the gathered weight is flat: view(sp.shape) before copying it into the layer's "
                "tensor.",
    WRONG_ORDER: "all_gather_single puts rank r's piece at position r: take the output as it is.",
    GATHER_WRONG: "",
    GATHER_TOO_MANY_BYTES: "each rank hands the group its shard once (an all-gather: (p - 1) "
                           "shards' bytes per rank on a ring); an all-reduce of a zero-padded "
                           "full weight sends twice that.",
    NOT_FREED: "after the forward call free_storage(full) on each full weight: autograd keeps the "
               "tensor it saved for the backward, so dropping your own reference frees nothing.",
    NOT_SWAPPED_BACK: "fsdp.swap_out(unit): between uses the layer holds its shards, what the "
                      "optimizer steps.",
    NOT_REGATHERED: "the forward freed the full weights, and the backward reads them: pre_backward "
                    "gathers again (what pre_forward does).",
    NEW_TENSORS: "autograd saved the tensors swapped in at the forward: alloc_storage(full) and "
                 "full.data.copy_(...) refill those same tensors; new ones are never read by the "
                 "backward.",
    NO_GRADIENT: "after the reduce-scatter, add this rank's averaged piece to sp.shard.grad (set "
                 "it when it is None).",
    NOT_REDUCED: "reduce-scatter the padded gradient (dist.reduce_scatter_single), then divide by "
                 "world_size.",
    NO_DIVISION: "divide the reduced piece by world_size: FSDP averages gradients as DDP does.",
    DIVIDED_TWICE: "divide once: before the reduce-scatter or after it, not both.",
    WHOLE_GRADIENT: "keep only this rank's piece (reduce_scatter_single's output), flat, the "
                    "shard's length.",
    WRONG_PIECE: "rank r keeps piece r: reduce_scatter_single's output on rank r is piece r.",
    FREED_TOO_EARLY: "free_storage releases the memory the layer computes with: the forward (and "
                     "the backward) would read freed memory, which torch does not check (the "
                     "process may crash). Free the full weights in post_forward, after swap_out, "
                     "and at the end of post_backward.",
    ASSIGNED: "A shard's .grad may already hold the gradient of earlier micro-batches (gradient "
              "accumulation, or a unit reduced twice in one backward): add the piece to it "
              "(sp.shard.grad = piece if sp.shard.grad is None else sp.shard.grad + piece).",
    SCATTER_WRONG: "",
    ALL_REDUCED: "an all-reduce sends each rank the whole average: twice a reduce-scatter's ring "
                 "bytes (it IS a reduce-scatter followed by an all-gather). "
                 "dist.reduce_scatter_single sends piece r to rank r only.",
    WRONG_PADDING: "each piece has n = ceil(numel / world_size) elements (the shard's length, "
                   "sp.shard.numel()); pad the flat gradient to n * world_size.",
    GATHERED_GRADIENTS: "the values are right, but each rank sent its whole gradient to every "
                        "other rank: world_size times a reduce-scatter's ring bytes. "
                        "dist.reduce_scatter_single sums piece r onto rank r only.",
    SCATTER_TOO_MANY_BYTES: "a reduce-scatter sends (p - 1) / p of the padded gradient per rank: "
                            "use dist.reduce_scatter_single alone.",
    GRAD_KEPT: "set full.grad = None once it is reduced: the next backward would add to it, and "
               "its memory stays taken.",
    NOT_FREED_AFTER_BACKWARD: "post_backward ends as post_forward does: swap the shards back and "
                              "free_storage the full weights.",
    TRAINS_WRONG: "",
}
graders.TITLES.setdefault("fsdp", "FSDP hooks")
LAYERS = ((5, 7), (7, 6))  # Linear(in, out): weights of 35 and 42 elements, biases of 7 and 6
STEPS = 2
TOL = 1e-5  # float32, summed in another order by each implementation


class Bytes(ObserverBase):
    def __init__(self):
        self.calls = []

    def launched(self, op, tensors, group, peer):
        self.calls.append((op, sum(payload_bytes(t) for t in tensors)))


def ring_bytes(calls, p) -> dict:
    """Bytes this rank sends on a ring, by op, for the calls it made (what each call handed the
    group: an all-gather its input, a reduce-scatter or an all-reduce its whole tensor)."""
    out = {}
    for op, n in calls:
        if "all_gather" in op:
            sent = (p - 1) * n
        elif "reduce_scatter" in op or op == "broadcast":
            sent = (p - 1) / p * n
        elif op == "all_reduce":
            sent = 2 * (p - 1) / p * n
        else:
            sent = n
        out[op] = out.get(op, 0) + sent
    return out


def fresh_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(*LAYERS[0]), nn.Tanh(), nn.Linear(*LAYERS[1]))


def batch(step, rank):
    import torch

    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, LAYERS[0][0], generator=g), torch.randn(4, LAYERS[1][1], generator=g)



def _held(t) -> bool:
    """``t`` has memory for its elements (reading a freed tensor crashes the process)."""
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


def _close(a, b) -> bool:
    import torch

    return (a is not None and tuple(a.shape) == tuple(b.shape) and _held(a)
            and torch.allclose(a.detach().double(), b.double(), atol=1e-6, rtol=1e-6))


def _slots(unit):
    return [(m._parameters[name], sp) for m, name, sp in unit.slots]


def each_hook(hooks):
    """Each hook alone, on each unit of a fresh reference FSDP: what it left in the layer."""
    import torch
    import torch.distributed as dist

    from ddplab.sync.core.fsdp import FSDP

    rank, ws = dist.get_rank(), dist.get_world_size()
    fsdp = FSDP(fresh_model())
    plain = dict(fresh_model().named_parameters())
    full_of = {id(sp): plain[name] for name, sp in fsdp.sharded.items()}
    assigned = None
    for unit in fsdp.units:
        shard_bytes = sum(sp.shard.numel() * sp.shard.element_size() for sp in unit.params)
        seen = Bytes()
        with observe(seen):
            hooks["pre_forward"](fsdp, unit)
        used = _gathered(unit, full_of, rank, ws, "pre_forward", sent=bool(seen.calls))
        sent, allowed = ring_bytes(seen.calls, ws), (ws - 1) * shard_bytes
        if sum(sent.values()) > allowed * (1 + 1e-9):
            raise CheckFailed(GATHER_TOO_MANY_BYTES, f"rank {rank}: pre_forward sent {said(sent)} "
                              f"ring bytes where an all-gather of the shards sends {allowed:.0f}. "
                              + EXPLAIN[GATHER_TOO_MANY_BYTES])
        hooks["post_forward"](fsdp, unit)
        _released(unit, used, rank, NOT_FREED, NOT_SWAPPED_BACK)
        seen = Bytes()
        with observe(seen):
            hooks["pre_backward"](fsdp, unit)
        again = _gathered(unit, full_of, rank, ws, "pre_backward", after_free=True, sent=bool(seen.calls))
        if any(a is not u for a, u in zip(again, used)) and not all(_held(u) for u in used):
            raise CheckFailed(NEW_TENSORS, f"rank {rank}: the layer's weights after pre_backward "
                              "are other tensors than pre_forward swapped in, whose memory is "
                              "still freed: the backward would read those. " + EXPLAIN[NEW_TENSORS])
        grads = {}
        for t, sp in _slots(unit):  # every rank's gradient is known: seeded by rank
            if id(sp) not in grads:
                every = [torch.randn(sp.shape, generator=torch.Generator().manual_seed(r + 7 * sp.numel))
                         for r in range(ws)]
                grads[id(sp)] = every
                t.grad = every[rank].clone()
        earlier = {}  # a gradient the shard holds already, as under accumulation: it must be kept
        for sp in unit.params:
            g = torch.Generator().manual_seed(3 + rank + 11 * sp.numel)
            earlier[id(sp)] = torch.randn(sp.shard.shape, generator=g)
            sp.shard.grad = earlier[id(sp)].clone()
        seen = Bytes()
        with observe(seen):
            hooks["post_backward"](fsdp, unit)
        for sp in unit.params:  # assigned, not added: told last, when nothing else is wrong
            assigned = assigned or _reduced(sp, grads[id(sp)], earlier[id(sp)], rank, ws)
        _scatter_bytes(unit, seen, rank, ws)
        kept = [t for t in again if t.grad is not None]
        if kept:
            raise CheckFailed(GRAD_KEPT, f"rank {rank}: a full weight of {tuple(kept[0].shape)} "
                                         "still holds its gradient after post_backward. "
                                         + EXPLAIN[GRAD_KEPT])
        _released(unit, again, rank, NOT_FREED_AFTER_BACKWARD, NOT_FREED_AFTER_BACKWARD)
    if assigned:
        raise assigned


def _gathered(unit, full_of, rank, ws, hook, after_free=False, sent=False) -> list:
    """The layer's weights after ``hook``: each the full weight, or the mistake named."""
    used = []
    for t, sp in _slots(unit):
        want, n = full_of[id(sp)].detach(), sp.shard.numel()
        used.append(t)
        if _close(t, want):
            continue
        where = f"rank {rank}, after {hook}: a weight of {tuple(sp.shape)}"
        if t is sp.shard:
            if after_free:
                raise CheckFailed(NOT_REGATHERED, f"{where} is still this rank's flat shard. "
                                                  + EXPLAIN[NOT_REGATHERED])
            fulls = [f for f in unit.fulls if _close(f, want)]
            raise CheckFailed(NOT_SWAPPED_IN if fulls else NOT_GATHERED,
                              f"{where} is this rank's flat shard. "
                              + EXPLAIN[NOT_SWAPPED_IN if fulls else NOT_GATHERED])
        if not _held(t) and sent and any(t is f for f in unit.fulls):  # gathered, then freed
            raise CheckFailed(FREED_TOO_EARLY, f"{where}: the hook gathered, and the full weight "
                                               "in the layer has no memory when it returns. "
                                               + EXPLAIN[FREED_TOO_EARLY])
        if not _held(t):
            raise CheckFailed(NOT_REGATHERED if after_free else GATHER_WRONG,
                              f"{where}: its memory is freed (nothing was copied into it). "
                              "alloc_storage(full), then full.data.copy_(gathered). "
                              + (EXPLAIN[NOT_REGATHERED] if after_free else ""))
        flat = t.detach().reshape(-1)
        padded = torch_pad(want.reshape(-1), n * ws)
        if t.numel() == n:
            raise CheckFailed(NOT_GATHERED, f"{where} has {n} elements, a shard's. "
                                            + EXPLAIN[NOT_GATHERED])
        if t.numel() == n * ws and t.numel() != sp.numel and _close(flat, padded):
            raise CheckFailed(PADDING_LEFT, f"{where} has {t.numel()} elements. " + EXPLAIN[PADDING_LEFT])
        if tuple(t.shape) != tuple(sp.shape) and _close(flat, want.reshape(-1)):
            raise CheckFailed(NOT_SHAPED, f"{where} has shape {tuple(t.shape)}. " + EXPLAIN[NOT_SHAPED])
        pieces = list(padded.view(ws, n))
        if t.numel() == sp.numel and any(  # the same pieces, another order (not the identity)
                _close(flat, _cat(pieces, order)[:sp.numel]) for order in _orders(ws)):
            raise CheckFailed(WRONG_ORDER, f"{where} holds the right pieces in another order. "
                                           + EXPLAIN[WRONG_ORDER])
        if tuple(t.shape) != tuple(sp.shape):
            raise CheckFailed(GATHER_WRONG, f"{where} is {tuple(t.shape)}, not the full weight.")
        raise CheckFailed(GATHER_WRONG, f"{where} has the right shape and other values than the "
                                        "full weight: an all-gather with async_op=True read before "
                                        "its work.wait(), or pieces cut at the wrong places (rank "
                                        "r's piece is out[r * n:(r + 1) * n], n the shard's "
                                        "length, and the padding is at the end).")
    return used


def torch_pad(flat, size):
    from ddplab.sync.core.fsdp import pad

    return pad(flat, size)


def _orders(ws):
    import itertools

    return [o for o in itertools.permutations(range(ws)) if list(o) != list(range(ws))]


def _cat(pieces, order):
    import torch

    return torch.cat([pieces[i] for i in order])


def _released(unit, used, rank, not_freed, not_back):
    for t, sp in _slots(unit):
        if t is not sp.shard:
            raise CheckFailed(not_back, f"rank {rank}: a weight of {tuple(sp.shape)} is not the "
                                        "shard. " + EXPLAIN[not_back])
    held = [t for t in used if t.untyped_storage().nbytes() > 0]
    if held:
        raise CheckFailed(not_freed, f"rank {rank}: the full weight of {tuple(held[0].shape)} still "
                                     f"holds {held[0].untyped_storage().nbytes()} bytes. "
                                     + EXPLAIN[not_freed])


def _reduced(sp, every, earlier, rank, ws):
    """The shard's gradient: what it held (``earlier``) plus this rank's piece of the average over
    ranks, or the mistake raised; the piece assigned in place of added is returned, to raise once
    every other check passed."""
    import torch

    n, numel = sp.shard.numel(), sp.numel
    flat = [torch_pad(g.reshape(-1), n * ws) for g in every]
    total = torch.stack(flat).double().sum(0)
    mine = sp.shard.grad
    answer = (total / ws)[rank * n:(rank + 1) * n]
    before = earlier.reshape(-1).double()
    where = f"rank {rank}, a weight of {numel} elements at {ws} ranks"
    if mine is None:
        raise CheckFailed(NO_GRADIENT, f"{where}: sp.shard.grad is None. " + EXPLAIN[NO_GRADIENT])
    mine = mine.detach().reshape(-1)
    if _close(mine, before + answer):
        return
    if _close(mine, answer):
        return CheckFailed(ASSIGNED, f"{where}: the shard's .grad held a gradient before "
                                    "post_backward, and after it holds only the new piece. "
                                    + EXPLAIN[ASSIGNED])
    wrong = [(flat[rank][rank * n:(rank + 1) * n], NOT_REDUCED),
             (total[rank * n:(rank + 1) * n], NO_DIVISION),
             (answer / ws, DIVIDED_TWICE), (total / ws, WHOLE_GRADIENT),
             ((total / ws)[:numel], WHOLE_GRADIENT)]
    wrong += [((total / ws)[r * n:(r + 1) * n], WRONG_PIECE) for r in range(ws) if r != rank]
    for value, mistake in wrong:  # added to what the shard held, or assigned
        if _close(mine, value) or (value.numel() == n and _close(mine, before + value)):
            raise CheckFailed(mistake, f"{where}. " + EXPLAIN[mistake])
    if mine.numel() != n:
        raise CheckFailed(WRONG_PADDING, f"{where}: a piece of {mine.numel()} elements where "
                                         f"n = ceil({numel} / {ws}) = {n}. " + EXPLAIN[WRONG_PADDING])
    raise CheckFailed(SCATTER_WRONG, f"{where}: expected what the shard's .grad held plus piece "
                                     f"{rank} of the average over ranks (a reduce-scatter with "
                                     "async_op=True must be waited for, work.wait(), before its "
                                     "output is read).")


def _scatter_bytes(unit, seen, rank, ws):
    padded_bytes = sum(sp.shard.numel() * ws * 4 for sp in unit.params)
    sent, allowed = ring_bytes(seen.calls, ws), (ws - 1) / ws * padded_bytes
    if "all_reduce" in sent:
        raise CheckFailed(ALL_REDUCED, f"rank {rank}: post_backward sent {said(sent)} ring bytes "
                                       f"where a reduce-scatter sends {allowed:.0f}. "
                                       + EXPLAIN[ALL_REDUCED])
    if sum(sent.values()) > allowed * (1 + 1e-9):
        mistake = GATHERED_GRADIENTS if any("all_gather" in op for op in sent) else SCATTER_TOO_MANY_BYTES
        raise CheckFailed(mistake, f"rank {rank}: post_backward sent {said(sent)} ring bytes where "
                                   f"a reduce-scatter sends {allowed:.0f}. " + EXPLAIN[mistake])


def said(sent: dict) -> str:
    return ", ".join(f"{op} {n:.0f}" for op, n in sent.items()) or "nothing"
