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

1. (``ddplab.checks.fsdp_hooks``) each hook alone on each unit of a two-layer model whose weights have 35,
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
from ddplab.checks.fsdp_hooks import (  # noqa: F401  (the mistake names: ddplab.checks.fsdp.X)
    ALL_REDUCED,
    ASSIGNED,
    DIVIDED_TWICE,
    EXPLAIN,
    FREED_TOO_EARLY,
    GATHER_TOO_MANY_BYTES,
    GATHER_WRONG,
    GATHERED_GRADIENTS,
    GRAD_KEPT,
    LAYERS,
    NEW_TENSORS,
    NO_DIVISION,
    NO_GRADIENT,
    NOT_FREED,
    NOT_FREED_AFTER_BACKWARD,
    NOT_GATHERED,
    NOT_REDUCED,
    NOT_REGATHERED,
    NOT_SHAPED,
    NOT_SWAPPED_BACK,
    NOT_SWAPPED_IN,
    PADDING_LEFT,
    SCATTER_TOO_MANY_BYTES,
    SCATTER_WRONG,
    STEPS,
    TOL,
    TRAINS_WRONG,
    WHOLE_GRADIENT,
    WRONG_ORDER,
    WRONG_PADDING,
    WRONG_PIECE,
    Bytes,
    batch,
    each_hook,
    fresh_model,
    ring_bytes,
    said,
    torch_pad,
)
from ddplab.checks.mistakes import HUNG, NOT_IMPLEMENTED, RAISED, CheckFailed
from ddplab.cluster.errors import RankError
from ddplab.pg.group import observe


def _references() -> dict:
    """Full weights after each step: one process on every rank's batch, and fully_shard. Runs
    before the learner's hooks train, so its collectives meet only its own."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ws = dist.get_world_size()
    one, theirs = fresh_model(), fresh_model()
    mesh = init_device_mesh("cpu", (ws,))
    for layer in theirs:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (one, theirs)]
    out = {"one process": [], "fully_shard": []}
    for step in range(STEPS):
        batches = [batch(step, r) for r in range(ws)]
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
    each_hook(hooks)  # first: an untouched exercise stops here, before fully_shard is built
    if ws not in _CACHED:  # every rank got here, each of your collectives answered
        _CACHED[ws] = _references()
    return _trains(hooks, _CACHED[ws])


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
    model = Yours(fresh_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = [n for n, _ in fresh_model().named_parameters()]
    pieces = {name: sp for name, sp in model.sharded.items()}
    worst = {"one process": 0.0, "fully_shard": 0.0}
    per_step = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad(set_to_none=True)
        seen = Bytes()
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
            raise CheckFailed(SCATTER_TOO_MANY_BYTES, f"rank {rank}, step {step}: {said(sent)} ring "
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
    if "is invalid for input of size" in low:
        return ("\nA view to the weight's shape of a flat tensor of another length: the gathered "
                "flat weight is n * world_size long, padding included; cut it to numel first "
                "(out[:sp.numel].view(sp.shape)), and pad a flat gradient to n * world_size, "
                "n = ceil(numel / world_size).")
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

    numels = [i * o for i, o in LAYERS] + [o for _, o in LAYERS]
    found = re.search(r"gradient of size '\[(\d+)\]' to a tensor of size '\[(\d+)\]'", text)
    if found:
        got, n = int(found.group(1)), int(found.group(2))
    else:  # sp.shard.grad + piece, the piece of another length than the shard's gradient
        found = re.search(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)", text)
        if not found or int(found.group(1)) not in [-(-m // ws) for m in numels]:
            return None
        n, got = int(found.group(1)), int(found.group(2))
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
    if graders.outside_collectives(err):  # no collective pending there: not a hang, a loop
        return graders.not_finished(err, graders.outside_collectives(err))
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
    graders.refuse_changed_torch(cluster)
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
