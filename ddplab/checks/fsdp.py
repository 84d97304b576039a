"""Grader for lab 12: a unit's four hooks, FSDP itself, written by the learner, on live ranks.

``check_fsdp_hooks(cluster, pre_forward, post_forward, pre_backward, post_backward)``
takes four functions of ``(fsdp, unit)``, the moments ddplab's reference
(``ddplab.sync.core.fsdp.FSDP``) calls them at, FSDP2's names:

- ``pre_forward``: all-gather the unit's flat shards, cut off the padding,
  give each weight its shape, put it into ``unit.fulls`` (their memory is
  freed between uses: ``alloc_storage`` first) and swap them into the layer
  (``fsdp.swap_in(unit)``);
- ``post_forward``: swap the shards back (``fsdp.swap_out(unit)``) and free the
  full weights' memory (``free_storage``);
- ``pre_backward``: gather again, into the SAME tensors (autograd saved them);
- ``post_backward``: reduce-scatter each full weight's gradient (padded to
  world_size pieces of the shard's length), averaged, onto the shard's
  ``.grad``; then free as after the forward.

It runs on every rank, in three parts, and names the first mistake:

1. each hook alone on each unit of a two-layer model whose weights have 35,
   7, 42 and 6 elements (padded and not, at 2 and 3 ranks: a padding rule
   that only equals ceil at an even world size shows): the layer's weights
   after each hook (full and right, shaped, in rank order, freed, swapped
   back), the shard's gradient (the average of the ranks' gradients, this
   rank's piece: not the sum, not averaged twice, not another piece), and the
   ring bytes each collective costs, per op (an all-reduce in place of the
   all-gather or the reduce-scatter, or an all-gather of every whole gradient,
   right in value, costs more);
2. two SGD steps of that model with the four hooks inside the reference's
   plumbing, against one process on all the ranks' data AND torch's
   ``fully_shard`` (both computed before your hooks train, once part 1 passed
   on every rank, and kept on the ranks: no collective of the grader's meets
   one of yours);
3. what went wrong in words: a collective only some ranks make is "hung"; an
   untouched exercise is "not implemented" and keeps its ranks; a rank that
   died (a freed tensor written or read: torch does not check) is told so.

Leaves out: compute_dtype (float32 here), a unit called twice, gradient
accumulation, checkpointing (the reference handles them; the hooks here need
not). References: torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py
(``pre_forward``, ``post_forward``, ``pre_backward``, ``post_backward``),
_fsdp_collectives.py (``foreach_all_gather``, ``foreach_reduce``).
"""
from __future__ import annotations

from ddplab.checks import graders
from ddplab.checks.mistakes import HUNG, NOT_IMPLEMENTED, RAISED, CheckFailed
from ddplab.cluster.errors import RankError
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


class _Bytes(ObserverBase):
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


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(*LAYERS[0]), nn.Tanh(), nn.Linear(*LAYERS[1]))


def _batch(step, rank):
    import torch

    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, LAYERS[0][0], generator=g), torch.randn(4, LAYERS[1][1], generator=g)


def _references() -> dict:
    """Full weights after each step: one process on every rank's batch, and fully_shard. Runs
    before the learner's hooks train, so its collectives meet only its own."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ws = dist.get_world_size()
    one, theirs = _model(), _model()
    mesh = init_device_mesh("cpu", (ws,))
    for layer in theirs:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (one, theirs)]
    out = {"one process": [], "fully_shard": []}
    for step in range(STEPS):
        batches = [_batch(step, r) for r in range(ws)]
        x, y = (torch.cat(t) for t in zip(*batches))
        for m, xb, yb in ((one, x, y), (theirs, *batches[dist.get_rank()])):
            m.zero_grad(set_to_none=True)
            nn.functional.mse_loss(m(xb), yb).backward()
        for o in opts:
            o.step()
        out["one process"].append([p.detach().clone() for p in one.parameters()])
        out["fully_shard"].append([_full(p, ws) for p in theirs.parameters()])
    return out


def _full(p, ws):
    """A fully_shard DTensor (dim-0 chunks, the last ones short) gathered by hand."""
    import torch
    import torch.distributed as dist

    local, rows = p.to_local().detach(), -(-p.shape[0] // ws)
    padded = torch.zeros((rows, *p.shape[1:]))
    padded[:local.shape[0]] = local
    out = torch.empty((rows * ws, *p.shape[1:]))
    dist.all_gather_single(out, padded)
    return out[:p.shape[0]]


_CACHED: dict = {}  # world size -> references, kept on the rank between checks


def _on_rank(hooks: dict):
    import torch.distributed as dist

    ws = dist.get_world_size()
    _each_hook(hooks)  # first: an untouched exercise stops here, before fully_shard is built
    if ws not in _CACHED:  # every rank got here, each of your collectives answered
        _CACHED[ws] = _references()
    return _trains(hooks, _CACHED[ws])


def _held(t) -> bool:
    """``t`` has memory for its elements (reading a freed tensor crashes the process)."""
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


def _close(a, b) -> bool:
    import torch

    return (a is not None and tuple(a.shape) == tuple(b.shape) and _held(a)
            and torch.allclose(a.detach().double(), b.double(), atol=1e-6, rtol=1e-6))


def _slots(unit):
    return [(m._parameters[name], sp) for m, name, sp in unit.slots]


def _each_hook(hooks):
    """Each hook alone, on each unit of a fresh reference FSDP: what it left in the layer."""
    import torch
    import torch.distributed as dist

    from ddplab.sync.core.fsdp import FSDP

    rank, ws = dist.get_rank(), dist.get_world_size()
    fsdp = FSDP(_model())
    plain = dict(_model().named_parameters())
    full_of = {id(sp): plain[name] for name, sp in fsdp.sharded.items()}
    for unit in fsdp.units:
        shard_bytes = sum(sp.shard.numel() * sp.shard.element_size() for sp in unit.params)
        seen = _Bytes()
        with observe(seen):
            hooks["pre_forward"](fsdp, unit)
        used = _gathered(unit, full_of, rank, ws, "pre_forward")
        sent, allowed = ring_bytes(seen.calls, ws), (ws - 1) * shard_bytes
        if sum(sent.values()) > allowed * (1 + 1e-9):
            raise CheckFailed(GATHER_TOO_MANY_BYTES, f"rank {rank}: pre_forward sent {_said(sent)} "
                              f"ring bytes where an all-gather of the shards sends {allowed:.0f}. "
                              + EXPLAIN[GATHER_TOO_MANY_BYTES])
        hooks["post_forward"](fsdp, unit)
        _released(unit, used, rank, NOT_FREED, NOT_SWAPPED_BACK)
        hooks["pre_backward"](fsdp, unit)
        again = _gathered(unit, full_of, rank, ws, "pre_backward", after_free=True)
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
        seen = _Bytes()
        with observe(seen):
            hooks["post_backward"](fsdp, unit)
        for sp in unit.params:
            _reduced(sp, grads[id(sp)], rank, ws)
        _scatter_bytes(unit, seen, rank, ws)
        kept = [t for t in again if t.grad is not None]
        if kept:
            raise CheckFailed(GRAD_KEPT, f"rank {rank}: a full weight of {tuple(kept[0].shape)} "
                                         "still holds its gradient after post_backward. "
                                         + EXPLAIN[GRAD_KEPT])
        _released(unit, again, rank, NOT_FREED_AFTER_BACKWARD, NOT_FREED_AFTER_BACKWARD)


def _gathered(unit, full_of, rank, ws, hook, after_free=False) -> list:
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
        raise CheckFailed(GATHER_WRONG, f"{where} is {tuple(t.shape)}, not the full weight.")
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


def _reduced(sp, every, rank, ws):
    """The shard's gradient: this rank's piece of the average over ranks, or the mistake."""
    import torch

    n, numel = sp.shard.numel(), sp.numel
    flat = [torch_pad(g.reshape(-1), n * ws) for g in every]
    total = torch.stack(flat).double().sum(0)
    mine = sp.shard.grad
    answer = (total / ws)[rank * n:(rank + 1) * n]
    where = f"rank {rank}, a weight of {numel} elements at {ws} ranks"
    if mine is None:
        raise CheckFailed(NO_GRADIENT, f"{where}: sp.shard.grad is None. " + EXPLAIN[NO_GRADIENT])
    mine = mine.detach().reshape(-1)
    if _close(mine, answer):
        return
    wrong = [(flat[rank][rank * n:(rank + 1) * n], NOT_REDUCED),
             (total[rank * n:(rank + 1) * n], NO_DIVISION),
             (answer / ws, DIVIDED_TWICE), (total / ws, WHOLE_GRADIENT),
             ((total / ws)[:numel], WHOLE_GRADIENT)]
    wrong += [((total / ws)[r * n:(r + 1) * n], WRONG_PIECE) for r in range(ws) if r != rank]
    for value, mistake in wrong:
        if _close(mine, value):
            raise CheckFailed(mistake, f"{where}. " + EXPLAIN[mistake])
    if mine.numel() != n:
        raise CheckFailed(WRONG_PADDING, f"{where}: a piece of {mine.numel()} elements where "
                                         f"n = ceil({numel} / {ws}) = {n}. " + EXPLAIN[WRONG_PADDING])
    raise CheckFailed(SCATTER_WRONG, f"{where}: expected piece {rank} of the average over ranks.")


def _scatter_bytes(unit, seen, rank, ws):
    padded_bytes = sum(sp.shard.numel() * ws * 4 for sp in unit.params)
    sent, allowed = ring_bytes(seen.calls, ws), (ws - 1) / ws * padded_bytes
    if "all_reduce" in sent:
        raise CheckFailed(ALL_REDUCED, f"rank {rank}: post_backward sent {_said(sent)} ring bytes "
                                       f"where a reduce-scatter sends {allowed:.0f}. "
                                       + EXPLAIN[ALL_REDUCED])
    if sum(sent.values()) > allowed * (1 + 1e-9):
        mistake = GATHERED_GRADIENTS if any("all_gather" in op for op in sent) else SCATTER_TOO_MANY_BYTES
        raise CheckFailed(mistake, f"rank {rank}: post_backward sent {_said(sent)} ring bytes where "
                                   f"a reduce-scatter sends {allowed:.0f}. " + EXPLAIN[mistake])


def _said(sent: dict) -> str:
    return ", ".join(f"{op} {n:.0f}" for op, n in sent.items()) or "nothing"


def _trains(hooks, refs) -> dict:
    """Two SGD steps with the learner's hooks inside the reference's plumbing."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddplab.sync.core.fsdp import FSDP

    class Yours(FSDP):  # the reference's hooks call these four: yours
        def pre_forward(self, unit):
            hooks["pre_forward"](self, unit)

        def post_forward(self, unit):
            hooks["post_forward"](self, unit)

        def pre_backward(self, unit):
            hooks["pre_backward"](self, unit)

        def post_backward(self, unit):
            hooks["post_backward"](self, unit)

    rank, ws = dist.get_rank(), dist.get_world_size()
    model = Yours(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = [n for n, _ in _model().named_parameters()]
    pieces = {name: sp for name, sp in model.sharded.items()}
    worst = {"one process": 0.0, "fully_shard": 0.0}
    per_step = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        opt.zero_grad(set_to_none=True)
        seen = _Bytes()
        with observe(seen):
            nn.functional.mse_loss(model(x), y).backward()
        model.finish_gradient_synchronization()
        opt.step()
        per_step.append(ring_bytes(seen.calls, ws))
        for which, ref in refs.items():  # compared on this rank's pieces: no collective of ours
            for name, want in zip(names, ref[step]):
                sp = pieces[name]
                n = sp.shard.numel()
                piece = torch_pad(want.reshape(-1), n * ws)[rank * n:(rank + 1) * n]
                gap = float((sp.shard.detach().double() - piece.double()).abs().max())
                worst[which] = max(worst[which], gap)
    if max(worst.values()) > TOL:
        raise CheckFailed(TRAINS_WRONG, f"rank {rank}: after {STEPS} SGD steps its shards differ "
                                        f"from one process's by {worst['one process']:.2e} and from "
                                        f"fully_shard's by {worst['fully_shard']:.2e}.")
    shard_bytes = sum(sp.shard.numel() * 4 for sp in pieces.values())
    expected = 3 * (ws - 1) * shard_bytes  # per unit: two all-gathers, one reduce-scatter
    for step, sent in enumerate(per_step):
        if sum(sent.values()) > expected * (1 + 1e-9):
            raise CheckFailed(SCATTER_TOO_MANY_BYTES, f"rank {rank}, step {step}: {_said(sent)} ring "
                              f"bytes where FSDP sends {expected:.0f} (per unit two all-gathers and "
                              "one reduce-scatter).")
    return {"worst": worst, "ring_bytes": per_step[-1], "expected": expected}


HUNG_HOW = ("\nEvery rank must make every all-gather and reduce-scatter, with the same sizes "
            "(the ranks were replaced).")
DIED_HOW = ("\nA rank died: torch does not check a tensor whose memory free_storage released, "
            "and writing into it or reading it crashes the process. pre_forward and pre_backward "
            "call alloc_storage(full) before copying into it, and the backward reads the weights "
            "only after pre_backward gathered them (the ranks were replaced).")
GLOO_SIZE_HOW = ("\ngloo checked the sizes of a collective and stopped the rank: a reduce-scatter's "
                 "input must be exactly world_size times its output, and every rank's all-gather "
                 "input the same length: pad the flat gradient to n * world_size, "
                 "n = ceil(numel / world_size) (the shard's length).")


def _hints(text: str) -> str:
    """The cause behind an exception's words, where torch's words do not say it."""
    low = text.lower()
    if "check failed" in low and "worldsize" in low:
        return GLOO_SIZE_HOW
    if "must match the size" in low:
        return "\nA flat gathered weight was copied into a shaped one: view(sp.shape) first."
    if "mat1 and mat2" in low:
        return ("\nThe layer computed with a weight of the wrong shape: the flat shard, or a "
                "gathered weight never given its shape (view(sp.shape)).")
    if "modified by an inplace operation" in low:
        return ("\nAutograd saved the full weight in the forward and checks, in the backward, that "
                "nothing changed it in place: a copy_ into it (even under torch.no_grad()) counts. "
                "Refill it through full.data.copy_(...), which autograd does not see.")
    if "leaf variable" in low and "in-place" in low:
        return ("\nfull.copy_(...) on a tensor that requires grad is an in-place change autograd "
                "refuses: copy into full.data (or under torch.no_grad()).")
    if "dtype" in low or "expected scalar type" in low:
        return ("\nA dtype mismatch: the gathered weights and gradients are float32 here; keep the "
                "dtype of the shard (sp.shard.dtype) for the buffers you allocate.")
    if "'nonetype' object has no attribute" in low:
        return ("\npost_backward also runs at the end of the backward for every unit (FSDP2's "
                "final callback: a unit whose inputs need no gradient has no other end): a unit "
                "reduced already has full.grad None; skip it, and only free.")
    if "was not waited" in low or "wait()" in low:
        return "\nAn asynchronous collective's work must be waited for before its output is read."
    return ""


def _grad_size(text: str, ws: int):
    """A shard's .grad set to a tensor of the wrong size (torch refuses it at once): named."""
    import re

    found = re.search(r"gradient of size '\[(\d+)\]' to a tensor of size '\[(\d+)\]'", text)
    if not found:
        return None
    got, n = int(found.group(1)), int(found.group(2))
    numels = [i * o for i, o in LAYERS] + [o for _, o in LAYERS]
    if got == n * ws or any(got == m and -(-m // ws) == n for m in numels):  # padded or not
        return CheckFailed(WHOLE_GRADIENT, f"a piece of {got} elements for a shard of {n}. "
                                           + EXPLAIN[WHOLE_GRADIENT])
    return CheckFailed(WRONG_PADDING, f"a piece of {got} elements for a shard of {n} at {ws} "
                                      "ranks. " + EXPLAIN[WRONG_PADDING])


def _verdict(err: RankError, ws: int) -> CheckFailed:
    """A RankError from the ranks in words: the verdict a rank raised, or what happened."""
    exceptions = {r: e for r, e in err.exceptions.items() if e is not None}
    said = {r: f"{type(e).__name__}: {str(e).strip()[:400]}" for r, e in sorted(exceptions.items())}
    if exceptions and all(isinstance(e, NotImplementedError) for e in exceptions.values()):
        return CheckFailed(NOT_IMPLEMENTED, "your hooks raised NotImplementedError on the ranks.")

    def timed_out(text):
        return any(w in text.lower() for w in ("timed out", "timeout", "connection closed"))

    # a rank left inside a collective when another stopped, or one that waited it out
    waiting = sorted(r for r, s in err.status.items() if "still running" in str(s))
    waiting += sorted(r for r, t in said.items() if timed_out(t))
    others = {r: t for r, t in said.items() if not timed_out(t)
              and not isinstance(exceptions[r], CheckFailed)}
    if waiting or isinstance(err, TimeoutError):
        if others:  # a rank raised first and left the others waiting: the cause is its error
            text = "\n".join(f"rank {r}: {t}" for r, t in others.items())
            return CheckFailed(RAISED, text + _hints(text) + f"\n(rank(s) {waiting} were left "
                               "waiting in a collective; the ranks were replaced)")
        stopped = [f"rank {r} stopped: {e.mistake}" for r, e in sorted(exceptions.items())
                   if isinstance(e, CheckFailed)]
        return CheckFailed(HUNG, f"rank(s) {sorted(set(waiting))} waited in a collective that "
                           "not every rank made" + (" (" + "; ".join(stopped) + ")" if stopped
                                                    else "") + "." + HUNG_HOW)
    failed = {r: e for r, e in exceptions.items() if isinstance(e, CheckFailed)}
    if failed:
        first = failed[min(failed)]
        return CheckFailed(first.mistake, first.detail)
    if any(f.get("died") for f in err.failures.values()) and not exceptions:
        text = str(err)
        return CheckFailed(RAISED, text.splitlines()[0] + (
            GLOO_SIZE_HOW if "check failed" in text.lower() else DIED_HOW))
    text = "\n".join(f"rank {r}: {t}" for r, t in said.items()) or str(err).splitlines()[0]
    return _grad_size(text, ws) or CheckFailed(RAISED, text + _hints(text))


def check_fsdp_hooks(cluster, pre_forward, post_forward, pre_backward, post_backward, *,
                     timeout: float | None = None):
    """Your four hooks on every rank: each alone, then two steps inside FSDP, against one
    process and torch's fully_shard."""
    hooks = {"pre_forward": pre_forward, "post_forward": post_forward,
             "pre_backward": pre_backward, "post_backward": post_backward}
    for name, fn in hooks.items():
        if not callable(fn):
            raise TypeError(f"pass your {name} function itself, got {type(fn).__name__}")
    if getattr(cluster, "world_size", 0) < 2:
        raise ValueError("this check needs a Cluster of at least 2 ranks: ddplab.Cluster(2)")
    graders.passed["fsdp"] = False
    limit = timeout or 2 * getattr(cluster, "timeout", 60) + 60
    try:
        results = cluster.run_job(_on_rank, (hooks,), job_timeout=limit)
    except RankError as err:
        raise _verdict(err, cluster.world_size) from None
    graders.passed["fsdp"] = True
    r = results[0]
    print(f"FSDP hooks: passed. On {cluster.world_size} ranks each hook did its part (weights of "
          f"35, 7, 42 and 6 elements), and two SGD steps with your hooks equal one process "
          f"(largest difference {r['worst']['one process']:.1e}) and torch's fully_shard "
          f"({r['worst']['fully_shard']:.1e}); {sum(r['ring_bytes'].values()):.0f} ring bytes per "
          f"step on rank 0, as FSDP's {r['expected']:.0f}.")
    return results
