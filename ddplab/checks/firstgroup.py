"""Grader for lab 00's warm-up: one send/recv pair per rank, before the ring.

``check_pass_right(cluster, fn)`` calls ``fn(tensor)`` on every rank of a
Cluster of at least 3 ranks. Each rank must send its tensor to its right
neighbour ``(rank + 1) % p`` and return the tensor its left neighbour
``(rank - 1) % p`` sent it (a fresh tensor; the argument may stay as it was).
That is one step of the ring, and the pairing problem of the whole ring in
miniature: every rank sends AND receives.

Named mistakes: every rank blocked in a blocking ``send`` (a gloo ``send``
returns only once its receiver has posted the matching ``recv``, so nobody
receives); a send or recv without a partner; the wrong direction (the
tensor came from the right); a receive buffer of another size; nothing
returned; a collective instead of send/recv; an isend/irecv never waited; judged
for NCCL (``backend="nccl"``, as lab 00 asks), a wait before the other half of
the pair was posted, and a send or recv called outside ``batch_isend_irecv``
(the ring grader's two NCCL rules, ``ddplab.checks.ring``). The traffic is
watched with ``ddplab.pg.p2p_watch.watch_p2p``, which stops a deadlock after
``timeout`` seconds instead of hanging.

Leaves out: tags, process subgroups, GPUs (the same code runs on NCCL ranks).
"""
from __future__ import annotations

import traceback
import uuid

from ddplab.checks import graders
from ddplab.checks.mistakes import EXPLAIN, NOT_IMPLEMENTED, RAISED, CheckFailed
from ddplab.checks.ring import COLLECTIVE, DEADLOCK, MISSING_WAIT, UNBATCHED, UNGROUPED, UNPAIRED, judged_for_nccl
from ddplab.cluster.errors import RankDied, RankError

FROM_THE_RIGHT = "received from the right instead of the left"
NOTHING_RETURNED = "the received tensor was not returned"
SIZE = "a receive buffer of another size"
WRONG_VALUES = "the tensor returned is not the left neighbour's"

EXPLAIN.update({
    FROM_THE_RIGHT: "rank r sends to (r + 1) % p and receives from (r - 1) % p: what arrives "
                    "comes from the LEFT.",
    NOTHING_RETURNED: "return the tensor you received into (torch.empty_like(t), filled by recv).",
    SIZE: "the buffer you receive into must have as many elements as the tensor sent: "
          "torch.empty_like(t).",
    WRONG_VALUES: "return the buffer that dist.recv filled, not your own tensor.",
})
graders.TITLES.setdefault("pass_right", "a send/recv pair round the ranks")


def _data(rank: int, n: int):
    import torch

    return torch.arange(n, dtype=torch.float64) + 1000.0 * (rank + 1)


def pass_right_on_rank(fn, cfg: dict) -> dict:
    """Runs on every rank: the learner's send/recv pair, watched."""
    import torch
    import torch.distributed as dist

    from ddplab.pg.backend import device
    from ddplab.pg.p2p_watch import P2PStalled, SizeMismatch, watch_p2p

    rank, p = dist.get_rank(), dist.get_world_size()
    out: dict = {"rank": rank, "p": p}
    log = None
    try:
        with watch_p2p(cfg["timeout"], tag=cfg["tag"]) as log:
            got = fn(_data(rank, cfg["n"]).to(device()))
        out["got"] = got.detach().cpu() if isinstance(got, torch.Tensor) else None
    except NotImplementedError:
        out["error"] = "NotImplementedError"
    except P2PStalled as e:
        out["stalled"] = (e.op, e.peer)
    except SizeMismatch as e:
        out["size"] = str(e)
    except Exception as e:  # the learner's bug, in words below
        out["error"] = traceback.format_exception_only(type(e), e)[-1].strip()
    out["log"] = log.as_dict() if log is not None else None
    return out


def diagnose(per_rank: list, n: int, backend: str = "gloo") -> None:
    """Raise the first mistake found in the ranks' reports, else return (``backend``: the
    backend judged for; "nccl" adds the ring grader's two NCCL rules)."""
    p = len(per_rank)
    if any(r.get("error") == "NotImplementedError" for r in per_rank):
        raise CheckFailed(NOT_IMPLEMENTED, "my_pass_right raised NotImplementedError")
    if any((r.get("log") or {}).get("collectives") for r in per_rank):
        raise CheckFailed(COLLECTIVE, f"called: {per_rank[0]['log']['collectives']}")
    stalled = {r["rank"]: r["stalled"] for r in per_rank if "stalled" in r}
    if stalled and len(stalled) == p and all(op == "send" for op, _ in stalled.values()):
        raise CheckFailed(DEADLOCK, "every rank was blocked in dist.send")
    # A rank that returned with its isend/irecv still posted leaves a message in gloo that the
    # next call may meet: a stall elsewhere is then its consequence, not an unpaired exchange.
    returned = [r["rank"] for r in per_rank if "stalled" not in r and "error" not in r
                and (r.get("log") or {}).get("unfinished")]
    if stalled and returned:
        raise CheckFailed(MISSING_WAIT, f"rank {returned[0]} returned with an isend/irecv not "
                                        f"waited for; rank(s) {sorted(stalled)} then stalled")
    if stalled:
        raise CheckFailed(UNPAIRED, "; ".join(f"rank {r} blocked in {op} with rank {peer}"
                                              for r, (op, peer) in sorted(stalled.items())))
    sizes = [r["size"] for r in per_rank if "size" in r]
    if sizes:
        raise CheckFailed(SIZE, sizes[0])
    unwaited = [r["rank"] for r in per_rank if (r.get("log") or {}).get("unfinished")]
    if unwaited:  # the values may even be right: the task is a pair that has finished
        raise CheckFailed(MISSING_WAIT, f"rank {unwaited[0]}: an isend/irecv not waited for "
                                        "when your function returned")
    if judged_for_nccl(backend):
        for key, mistake in (("ungrouped", UNGROUPED), ("unbatched", UNBATCHED)):
            notes = [(r["rank"], r["log"][key]) for r in per_rank if (r.get("log") or {}).get(key)]
            if notes:
                raise CheckFailed(mistake, f"rank {notes[0][0]} {notes[0][1]}.")
    errors = [(r["rank"], r["error"]) for r in per_rank if "error" in r]
    if errors:
        raise CheckFailed(RAISED, f"rank {errors[0][0]}: {errors[0][1]}")
    for r in per_rank:
        got, rank = r["got"], r["rank"]
        if got is None or got.numel() != n:
            raise CheckFailed(NOTHING_RETURNED, f"rank {rank} returned {got!r:.80}")
        got = got.double()
        if got.equal(_data((rank - 1) % p, n)):
            continue
        if got.equal(_data((rank + 1) % p, n)):
            raise CheckFailed(FROM_THE_RIGHT, f"rank {rank} returned rank {(rank + 1) % p}'s tensor")
        raise CheckFailed(WRONG_VALUES, f"rank {rank} returned {got[:4].tolist()}..., "
                                        f"rank {(rank - 1) % p} sent {_data((rank - 1) % p, n)[:4].tolist()}...")


def check_pass_right(cluster, fn, *, n: int = 7, timeout: float = 5.0,
                     backend: str | None = None) -> list:
    """Grade ``fn(t) -> received``: send ``t`` right, return what came from the left.

    ``backend``: the backend to judge for (default: the Cluster's). Under ``"nccl"`` the
    pair must be one ``batch_isend_irecv``, as ``check_ring_all_reduce`` asks."""
    if getattr(cluster, "world_size", 0) < 3:
        raise ValueError("the warm-up needs at least 3 ranks (with 2, left and right are the "
                         "same neighbour): ddplab.Cluster(3)")
    graders.passed["pass_right"] = False
    cfg = dict(n=n, timeout=float(timeout), tag=uuid.uuid4().hex)
    try:
        per_rank = cluster.run_job(pass_right_on_rank, (fn, cfg), job_timeout=2 * timeout + 30)
    except RankDied as err:  # numels are compared before a blocking recv, not before an irecv
        raise CheckFailed(SIZE, f"{str(err).splitlines()[0]}: gloo aborts a process that receives "
                                "more bytes than its buffer holds (an irecv buffer too small, or "
                                "of a smaller dtype). The ranks were replaced.") from None
    except RankError as err:
        raise CheckFailed(RAISED, str(err).splitlines()[0]) from None
    try:
        diagnose(per_rank, n, backend or getattr(cluster, "backend", "gloo"))
    except CheckFailed:
        if any((r.get("log") or {}).get("unfinished") for r in per_rank):
            # an isend/irecv without a partner may still be posted inside gloo: fresh ranks
            cluster.ensure_ready(stale="The warm-up stopped halfway: an unmatched send or recv "
                                       "may still be posted inside gloo.")
        raise
    graders.passed["pass_right"] = True
    sent = [r["log"]["bytes_sent"] for r in per_rank]
    print(f"pass_right: passed on {len(per_rank)} ranks; every rank got its left neighbour's "
          f"tensor and sent {sent[0]} bytes to its right.")
    return per_rank
