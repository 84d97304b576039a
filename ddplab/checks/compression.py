"""Grader for lab 07: your comm hook, registered on torch's own DDP on the live ranks.

``check_comm_hook(cluster, hook, compress=True)`` registers ``hook(state,
bucket)`` with ``DistributedDataParallel.register_comm_hook(None, hook)``
on every rank (a float32 net, different data per rank), runs two
backwards (torch's one-bucket first iteration, then its rebuilt buckets) and checks, from the outside:

- WHAT it returned: a ``torch.futures.Future`` (not a tensor, not a Work);
  whose value is ONE tensor shaped like ``bucket.buffer()`` (not the list a
  Work's future holds: torch's reducer fails on that with an internal assert).
  A float16 value is accepted: torch's reducer casts it into the float32
  gradients itself (measured on torch 2.13);
- WHAT it sent: the bytes the rank's observing process group was handed in
  all-reduces while the hook ran (however the hook spells the call: nothing
  is patched), against the float32 bucket (``compress=True`` asks for at most
  half);
- the VALUES: the gradients against the exact float64 mean over ranks (no
  division, divided twice, nothing synchronized, a reduced 16-bit copy that
  never came back into the bucket, or off by more than 16-bit rounding explains).

A wrong future is caught before torch's reducer sees it (the bucket then
gets its own, unreduced buffer), so a mistake is named instead of crashing
the ranks.

- that it is ASYNC: a blocking all-reduce, or ``work.wait()``, inside the hook
  (then wrapped in a finished Future) is named.

Leaves out: stateful hooks (PowerSGD), hooks that use ``GradBucket.set_buffer``,
a ``future.wait()`` inside the hook (a future's wait does not reach the group),
and timing.
"""
from __future__ import annotations

from ddplab.checks import graders
from ddplab.checks.mistakes import NOT_IMPLEMENTED, RAISED, CheckFailed
from ddplab.cluster.errors import RankError
from ddplab.pg.group import ObserverBase
from ddplab.pg.inner import payload_bytes

NOT_A_FUTURE = "the hook did not return a future"
LIST_FUTURE = "the future's value is a list (a Work's future), not the bucket tensor"
NOT_DECOMPRESSED = "compressed and reduced, but the result never came back into the bucket"
NO_DIVISION = "no division by world size"
DIVIDED_TWICE = "divided twice"
NOT_REDUCED = "nothing was all-reduced"
NOT_COMPRESSED = "no compression: as many bytes as the float32 bucket"
WRONG = "the result differs from the mean over ranks by more than rounding"
NOT_ASYNC = "the all-reduce finished inside the hook (not async)"
WRONG_SHAPE = "the future's value is not shaped like the bucket"

EXPLAIN = {
    NOT_A_FUTURE: "return the future of an ASYNC all-reduce: "
                  "dist.all_reduce(t, async_op=True).get_future(), chained with .then(...).",
    LIST_FUTURE: "a Work's future holds [tensor]; torch's reducer wants the tensor: "
                 ".then(lambda fut: fut.value()[0]).",
    NOT_DECOMPRESSED: "the 16-bit copy was all-reduced, but the future handed back the "
                      "bucket's own (local) buffer: in the .then callback copy the reduced "
                      "16-bit result into bucket.buffer() and return that buffer.",
    NO_DIVISION: "with a comm hook torch DDP no longer divides by the world size: the hook must "
                 "(divide before the all-reduce, so that a 16-bit sum stays in range).",
    DIVIDED_TWICE: "the gradients came out world_size times too small: divide once.",
    NOT_REDUCED: "each rank kept its own gradient: all-reduce the (compressed) bucket.",
    NOT_COMPRESSED: "cast the bucket to torch.float16 or torch.bfloat16 before the all-reduce.",
    WRONG: "",
    NOT_ASYNC: "the hook must return at once with the all-reduce still in flight, so that torch "
               "can go on with backward: dist.all_reduce(t, async_op=True).get_future().then(...). "
               "A blocking all-reduce (or work.wait()) inside the hook, wrapped in a finished "
               "Future, gives the right values but no overlap.",
    WRONG_SHAPE: "the future must hold one tensor with bucket.buffer()'s shape (and number of "
                 "elements): copy the reduced values back into the buffer and return it.",
}
graders.TITLES.setdefault("comm_hook", "comm hook")


def _on_rank(hook, bucket_cap_mb):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.lessons.common import wide_batch, wide_net
    from ddplab.lessons.compression import exact_mean_grads, relative_error
    from ddplab.pg.backend import device

    rank, world = dist.get_rank(), dist.get_world_size()
    seen = {"buckets": 0, "bucket_bytes": 0, "sent_bytes": 0, "mistake": None, "detail": ""}
    from ddplab.pg.group import observe

    def flag(mistake, detail):
        if seen["mistake"] is None:
            seen["mistake"], seen["detail"] = mistake, detail

    def watched(state, bucket):
        buffer = bucket.buffer()
        seen["buckets"] += 1
        seen["bucket_bytes"] += buffer.numel() * buffer.element_size()
        with observe(_InHook(seen)):  # what the group is handed while the hook runs
            fut = hook(state, bucket)
        if not isinstance(fut, torch._C.Future):
            flag(NOT_A_FUTURE, f"bucket {bucket.index()}: the hook returned {type(fut).__name__}.")
            done = torch.futures.Future()
            done.set_result(buffer)
            return done
        if seen.get("not_async"):  # checked after the type: a tensor returned is the first mistake
            flag(NOT_ASYNC, f"bucket {bucket.index()}: {seen['not_async']}")

        def inspect_value(f):
            value = f.value()
            if isinstance(value, (list, tuple)):
                flag(LIST_FUTURE, f"bucket {bucket.index()}: value is a {type(value).__name__} "
                                  f"of {len(value)}.")
                return buffer
            if not torch.is_tensor(value) or value.shape != buffer.shape:
                flag(WRONG_SHAPE, f"bucket {bucket.index()}: the value is {type(value).__name__} "
                            f"{getattr(value, 'shape', '')}, the bucket {tuple(buffer.shape)}.")
                return buffer
            return value

        return fut.then(inspect_value)

    ddp = DDP(wide_net().to(device()), bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(None, watched)
    x, y = wide_batch(rank, on=device())
    for _ in range(2):  # iteration 0 has one bucket; iteration 1 the rebuilt ones
        ddp.zero_grad()
        F.mse_loss(ddp(x), y).backward()
    grads = [p.grad for p in ddp.module.parameters()]
    ref = exact_mean_grads(ddp.module, rank)
    local = wide_net().double().to(device())
    local.load_state_dict(ddp.module.state_dict())
    xd, yd = wide_batch(rank, dtype=torch.float64, on=device())
    F.mse_loss(local(xd), yd).backward()
    scale = [float((g.double().to(r.device) * r).sum() / (r * r).sum()) for g, r in zip(grads, ref)]
    seen.update(rel_error=relative_error(grads, ref), world=world,
                local_error=relative_error(grads, [p.grad for p in local.parameters()]),
                scale=sum(scale) / len(scale))
    return seen


class _InHook(ObserverBase):
    """Installed on the rank's process group while the hook runs: the bytes of its
    all-reduces, and a wait for one of them before the hook returned (no overlap then)."""

    def __init__(self, seen):
        self.seen = seen

    def launched(self, op, tensors, group, peer):
        if op != "all_reduce":
            return None
        self.seen["sent_bytes"] += sum(payload_bytes(t) for t in tensors)
        return op

    def waiting(self, token):
        if token is not None:
            self.seen.setdefault("not_async", _how_it_waited())


def _how_it_waited() -> str:
    """A blocking ``dist.all_reduce`` waits inside torch.distributed; ``work.wait()`` in the
    learner's code: the first frame outside ddplab's group says which."""
    import sys

    frame = sys._getframe(2)
    while frame is not None and "ddplab" in frame.f_code.co_filename.replace("\\", "/").split("/"):
        frame = frame.f_back
    if frame is not None and "torch/distributed" in frame.f_code.co_filename.replace("\\", "/"):
        return "a blocking dist.all_reduce (no async_op=True) ran inside the hook."
    return "work.wait() was called inside the hook, before it returned."


def diagnose(per_rank, compress: bool) -> dict:
    """The first mistake the ranks' observations show, as ``CheckFailed``; else rank 0's facts."""
    for r, seen in enumerate(per_rank):
        if seen["mistake"]:
            raise CheckFailed(seen["mistake"], f"rank {r}: {seen['detail']} "
                                               f"{EXPLAIN[seen['mistake']]}")
    s = per_rank[0]
    world, tol = s["world"], (2e-2 if compress else 1e-5)
    if s["sent_bytes"] == 0:
        raise CheckFailed(NOT_REDUCED, EXPLAIN[NOT_REDUCED])
    if s["local_error"] < tol < s["rel_error"]:  # sent, yet every rank kept its own gradient
        raise CheckFailed(NOT_DECOMPRESSED, f"sent {s['sent_bytes']} bytes, yet each rank's "
                                            "gradient is still its own. " + EXPLAIN[NOT_DECOMPRESSED])
    if abs(s["scale"] - world) < 0.05 * world:
        raise CheckFailed(NO_DIVISION, EXPLAIN[NO_DIVISION])
    if abs(s["scale"] - 1 / world) < 0.05 / world:
        raise CheckFailed(DIVIDED_TWICE, EXPLAIN[DIVIDED_TWICE])
    if compress and s["sent_bytes"] > s["bucket_bytes"] // 2:
        raise CheckFailed(NOT_COMPRESSED, f"sent {s['sent_bytes']} bytes for "
                                          f"{s['bucket_bytes']} bytes of float32 buckets. "
                                          + EXPLAIN[NOT_COMPRESSED])
    worst = max(p["rel_error"] for p in per_rank)
    if worst > tol:
        raise CheckFailed(WRONG, f"largest relative error {worst:.1e} (allowed {tol:.0e}).")
    return s


def check_comm_hook(cluster, hook, *, compress: bool = True, bucket_cap_mb: float = 0.01):
    """Grade ``hook(state, bucket)`` on torch DDP: see the module docstring. Prints bytes and error."""
    if not callable(hook):
        raise TypeError(f"pass your hook function itself, got {type(hook).__name__}")
    graders.passed["comm_hook"] = False
    try:
        per_rank = cluster.run(_on_rank, hook, bucket_cap_mb)
    except RankError as err:
        excs = [e for e in err.exceptions.values() if e is not None]
        if any(isinstance(e, NotImplementedError) for e in excs):
            raise CheckFailed(NOT_IMPLEMENTED, "your hook raised NotImplementedError.") from None
        raise CheckFailed(RAISED, f"{excs[0]!r}" if excs else str(err)) from None
    s = diagnose(per_rank, compress)
    graders.passed["comm_hook"] = True
    print(f"comm hook: passed. {s['buckets']} buckets on {len(per_rank)} ranks; sent "
          f"{s['sent_bytes']} bytes for {s['bucket_bytes']} bytes of float32 gradients; largest "
          f"relative error against the exact mean {max(p['rel_error'] for p in per_rank):.1e}.")
    return s
