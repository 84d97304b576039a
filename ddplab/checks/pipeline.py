"""Grader for lab 08: the stage-to-stage send/recv of a model split across two ranks.

The learner writes ``step(stage, x, y, act_shape)``, run on ranks 0 and 1:
rank 0 runs stage 0 on ``x`` and sends the activation; rank 1 receives it,
runs stage 1 and the loss, runs backward and sends the activation's
gradient back; rank 0 receives it and finishes backward through stage 0.
Rank 1 returns the loss.

``check_pipeline_step(cluster, fn)`` runs it in float64, then float32 (the
lab's next cell runs float32, so a dtype written out fails here), next to the whole
model in one process (same weights, same batch) and checks every
parameter's gradient on both stages, the loss, and the bytes each rank sent
(``ddplab.pg.p2p_watch.p2p_counting``): one activation forward and
one gradient backward, ``batch x hidden x element size`` bytes each.

Mistakes it names (each planted in tests/checks/test_checks_labs06_08.py):
not implemented; hung (a recv whose send never comes); the received
activation does not require grad; stage 0 never ran its backward; wrong
gradients; more (or fewer) bytes than one activation and one gradient;
rank 1 did not return the loss; a send and its recv of different shapes or
dtypes (gloo copies bytes: it raises nothing, the values are garbage); an
isend/irecv never waited.
Leaves out: micro-batches and schedules (GPipe, 1F1B), more than 2 stages.
"""
from __future__ import annotations

import uuid

from ddplab.checks.graders import passed  # exercise -> last verdict in this kernel
from ddplab.checks.mistakes import HUNG, NOT_IMPLEMENTED, RAISED, CheckFailed
from ddplab.cluster.errors import RankError

NO_REQUIRES_GRAD = "the received activation does not require grad"
NO_STAGE0_BACKWARD = "stage 0 got no gradient"
WRONG_GRADIENTS = "the gradients differ from one process"
WRONG_BYTES = "not one activation forward and one gradient back"
NO_LOSS = "rank 1 did not return the loss"
SIZE_MISMATCH = "a tensor of another shape received than was sent"
DTYPE_MISMATCH = "a buffer of another dtype than the activation"
MISSING_WAIT = "an isend/irecv was never waited for"
DTYPES = ("float64", "float32")


def _grade_on_rank(fn, batch_size: int, hang_s: float, dtype: str = "float64", tag=None) -> dict:
    import torch
    import torch.distributed as dist

    from ddplab.lessons import pipeline as P
    from ddplab.pg.p2p_watch import p2p_counting

    rank = dist.get_rank()
    if rank > 1:
        return {"rank": rank, "idle": True}
    dt = getattr(torch, dtype)
    whole = P.two_stage_model(seed=3, dtype=dt)
    x, y = P.batch(batch_size, seed=5, dtype=dt)
    loss = P.loss_fn(whole(x), y)
    loss.backward()
    stage = P.split(whole)[rank]
    want = [p.grad.clone() for p in stage.parameters()]
    whole.zero_grad(set_to_none=True)
    out, error = None, None
    with p2p_counting(recv_timeout_s=hang_s, tag=tag) as counted:
        try:
            out = fn(stage, x if rank == 0 else None, y if rank == 1 else None, (batch_size, P.HIDDEN))
        except Exception as exc:  # noqa: BLE001 - named below, with what was sent and received
            error = (type(exc).__name__, str(exc)[:600])
    have = [p.grad for p in stage.parameters()]
    try:
        loss_out = None if out is None else float(out.detach() if torch.is_tensor(out) else out)
    except (TypeError, ValueError, RuntimeError) as exc:
        loss_out, error = None, error or (type(exc).__name__, f"rank 1 returned {type(out).__name__}: {exc}")
    return {"rank": rank, "idle": False, **counted.as_dict(), "error": error, "dtype": dtype,
            "none_grads": sum(g is None for g in have),
            "zero_grads": all(g is None or not bool(g.any()) for g in have),
            "max_error": max(float((g - w).abs().max()) if g is not None and g.shape == w.shape
                             else float("inf") for g, w in zip(have, want)),
            "loss": loss_out, "want_loss": float(loss.detach()),
            "expected_bytes": batch_size * P.HIDDEN * torch.empty((), dtype=dt).element_size()}


def from_rank_error(err: RankError) -> Exception:
    from ddplab.checks.graders import raised
    from ddplab.cluster.errors import RankDied

    errors = {r: e for r, e in err.exceptions.items() if e is not None}
    if isinstance(err, RankDied):
        return CheckFailed(SIZE_MISMATCH, f"{str(err).splitlines()[0]}. gloo aborts a process that "
                                          "receives more bytes than its recv buffer holds, the usual cause "
                                          "here: an irecv buffer smaller than the tensor sent (the ranks "
                                          "were replaced).")
    if any(isinstance(e, NotImplementedError) for e in errors.values()):
        return CheckFailed(NOT_IMPLEMENTED)
    if isinstance(err, TimeoutError) or any(isinstance(e, TimeoutError) for e in errors.values()):
        waits = [str(e) for e in errors.values() if isinstance(e, TimeoutError)]
        return CheckFailed(HUNG, "\n".join(waits or [str(err).splitlines()[0]]) + HUNG_HOW)
    return raised(err)


HUNG_HOW = ("\nEvery recv needs a matching send on the other rank: the activation 0 -> 1 after "
            "stage 0's forward, its gradient 1 -> 0 after stage 1's backward (the ranks were replaced).")


def _messages(per_rank: list) -> None:
    """Name a send and its recv that disagree on shape or dtype, or a work never waited."""
    r0, r1 = per_rank[0], per_rank[1]
    for sender, receiver in ((r0, r1), (r1, r0)):
        sends = [m for m in sender["messages"] if m[0] == "send"]
        recvs = [m for m in receiver["messages"] if m[0] == "recv"]
        for k, (s, r) in enumerate(zip(sends, recvs)):
            what = (f"message {k} from rank {sender['rank']} to rank {receiver['rank']}: sent "
                    f"{s[3]} {s[2]}, received into {r[3]} {r[2]} (graded in {sender['dtype']})")
            if s[2] != r[2]:
                raise CheckFailed(SIZE_MISMATCH, what + ".")
            if s[3] != r[3] or r[3] != sender["dtype"]:
                raise CheckFailed(DTYPE_MISMATCH, what + ".")
    for r in (r0, r1):
        if r["unwaited"]:
            raise CheckFailed(MISSING_WAIT, f"rank {r['rank']}: {r['unwaited']} isend/irecv work(s) "
                                            f"not waited for when your function returned ({r['dtype']}).")
    errors = {r["rank"]: r["error"] for r in (r0, r1) if r["error"]}
    if not errors:
        return
    texts = " ".join(f"{name}: {text}" for name, text in errors.values())
    if any(name == "NotImplementedError" for name, _ in errors.values()):
        raise CheckFailed(NOT_IMPLEMENTED)
    if "does not require grad" in texts or "NoneType" in texts:
        raise CheckFailed(NO_REQUIRES_GRAD, "rank 1 received the activation into a plain tensor, so "
                                            "backward left nothing in its .grad to send back. Call "
                                            "h.requires_grad_() after dist.recv(h, src=0).\n" + texts[:600])
    if any(name == "TimeoutError" for name, _ in errors.values()):
        raise CheckFailed(HUNG, "\n".join(t for n, t in errors.values() if n == "TimeoutError") + HUNG_HOW)
    raise CheckFailed(RAISED, "\n".join(f"rank {r}: {n}: {t}" for r, (n, t) in sorted(errors.items())))


def diagnose(per_rank: list) -> None:
    r0, r1 = per_rank[0], per_rank[1]
    _messages(per_rank)
    tol = 1e-9 if r0["dtype"] == "float64" else 1e-4
    if r0["none_grads"] or r0["zero_grads"]:
        raise CheckFailed(NO_STAGE0_BACKWARD, "stage 0's parameters have no gradient. After receiving "
                                              "d loss / d h from rank 1, rank 0 must call "
                                              "h.backward(grad_h) on the activation it computed.")
    for r in (r0, r1):
        if r["sent"] != r["expected_bytes"] or r["received"] != r["expected_bytes"]:
            raise CheckFailed(WRONG_BYTES, f"rank {r['rank']} sent {r['sent']} and received "
                                           f"{r['received']} bytes in {r['sends']} send(s) and "
                                           f"{r['recvs']} recv(s); one activation of batch x hidden "
                                           f"{r['dtype']} is {r['expected_bytes']} bytes, and each rank "
                                           "sends exactly one tensor that size.")
    worst = max(r0["max_error"], r1["max_error"])
    if worst > tol:
        raise CheckFailed(WRONG_GRADIENTS, f"largest gradient difference {worst:.2e} (rank 0: "
                                           f"{r0['max_error']:.2e}, rank 1: {r1['max_error']:.2e}). "
                                           "Rank 0's backward takes the gradient rank 1 sent: "
                                           "h.backward(grad_h), not a loss of its own.")
    if r1["loss"] is None or abs(r1["loss"] - r1["want_loss"]) > tol:
        raise CheckFailed(NO_LOSS, f"rank 1 returned {r1['loss']}, the loss is {r1['want_loss']:.6f}: "
                                   "return loss_fn(stage(h), y) (detached) from rank 1.")


def check_pipeline_step(cluster, fn, *, batch_size: int = 6, timeout: float = 5.0) -> list:
    """Grade ``fn(stage, x, y, act_shape)`` on ranks 0 and 1 against the whole model in one process."""
    if not callable(fn):
        raise TypeError(f"pass your function itself, got {type(fn).__name__}")
    if getattr(cluster, "world_size", 0) < 2:
        raise ValueError("this check needs a Cluster of at least 2 ranks: ddplab.Cluster(2)")
    passed["pipeline"] = False
    for dtype in DTYPES:  # lab 08 goes on in float32: a dtype written out fails here
        try:
            per_rank = cluster.run_job(_grade_on_rank, (fn, batch_size, float(timeout), dtype,
                                                        uuid.uuid4().hex), job_timeout=2 * timeout + 10)
        except RankError as err:
            raise from_rank_error(err) from None
        try:
            diagnose(per_rank)
        except CheckFailed:
            if any(r.get("error") or r.get("unwaited") for r in per_rank[:2]):
                # a message may be left half-delivered inside gloo: the next job gets fresh ranks
                cluster.ensure_ready(stale="The pipeline step stopped halfway: a send or recv "
                                           "may still be posted inside gloo.")
            raise
    passed["pipeline"] = True
    r0, r1 = per_rank[0], per_rank[1]
    print(f"pipeline step: passed. Gradients of both stages equal one process (max gap "
          f"{max(r0['max_error'], r1['max_error']):.1e}); loss {r1['loss']:.6f}; each rank sent "
          f"{r0['sent']} bytes (batch {batch_size} x hidden x 4 bytes, float32; graded in float64 too) "
          "in one send.")
    return per_rank
