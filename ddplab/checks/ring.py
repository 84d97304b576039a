"""Grader for lab 00: a ring all-reduce written with send/recv, against dist.all_reduce.

``check_ring_all_reduce(cluster, fn)`` calls ``fn(tensor)`` on every rank of a
Cluster of at least 3 ranks, on float64 and float32 tensors (lab 00 goes on in
float32, so a dtype written out fails here) whose lengths do not divide by the
world size, holding whole numbers (so every order of addition gives the same
sum exactly). It compares each rank's tensor afterwards with what
``dist.all_reduce`` (SUM, in place) gives on the same data, and counts the
bytes each rank sent (``ddplab.pg.p2p_watch.watch_p2p``). A blocking gloo
``send`` waits for its receiver's ``recv``, so a ring in which every rank
sends first deadlocks; inside the check it stops after ``timeout`` seconds
with a message instead of hanging.

Named mistakes: a collective used instead of send/recv; deadlock (every rank
blocked in send); on NCCL, a send and its recv not posted as one group (a wait
made before the other half of its exchange was posted: a ring of blocking
send and recv, which gloo runs but NCCL can deadlock on at 3+ ranks); on NCCL, a send
or recv called outside ``batch_isend_irecv`` (lessons/ring.py says why). Both NCCL rules
are judged from what the observing group saw, so CPU ranks check them too
(``backend="nccl"``); sends and recvs that do not pair up; chunks that do not
cover the tensor or differ between sender and receiver; the all-gather phase
missing; a result returned instead of written in place; the tensor never written;
a buffer of another dtype; an isend/irecv never waited; an average instead of a
sum; a correct result that sends more than a ring (not a ring).

Each case (one length, one dtype, every rank) is judged in the order of
``_diagnose_case``'s steps: the first mistake found is the one named.

Leaves out: timing (the cost is counted in bytes), reduce ops other than SUM,
and process subgroups.
"""
from __future__ import annotations

import traceback
import uuid

from ddplab.checks import graders
from ddplab.checks.mistakes import EXPLAIN, NOT_IMPLEMENTED, RAISED, CheckFailed
from ddplab.cluster.errors import RankDied, RankError
from ddplab.lessons.ring import ring_bytes_model
from ddplab.pg.p2p_watch import P2PStalled, SizeMismatch, watch_p2p

COLLECTIVE = "a collective instead of send/recv"
DEADLOCK = "deadlock: every rank sends first"
UNPAIRED = "sends and recvs do not pair up"
WRONG_SPLIT = "chunks do not cover the tensor"
NO_ALLGATHER = "the all-gather phase is missing"
NOT_IN_PLACE = "result not written in place"
AVERAGED = "averaged instead of summed"
NOT_A_RING = "correct, but not a ring (too many bytes)"
NEVER_WRITTEN = "the tensor was never written"
DTYPE_MISMATCH = "a buffer of another dtype than the tensor"
MISSING_WAIT = "an isend/irecv was never waited for"
RING_WRONG = "the result differs from dist.all_reduce"
UNGROUPED = "on NCCL, a send and its recv not posted together"
UNBATCHED = "on NCCL, a send or recv outside batch_isend_irecv"

EXPLAIN.update({
    COLLECTIVE: "the exercise is to build all_reduce from dist.send/dist.recv (and isend/irecv); "
                "no collective may do the work for you.",
    DEADLOCK: "every rank called a blocking dist.send first. A send waits until its receiver "
              "posts the matching recv (on gloo at every size; on NCCL the GPUs may wait the same way), "
              "so all ranks wait and none receives. Post the send and the recv together, then wait "
              "for both: dist.batch_isend_irecv([dist.P2POp(dist.isend, chunk, right), "
              "dist.P2POp(dist.irecv, buf, left)]) and .wait() on each work it returns (on gloo "
              "only, dist.isend and dist.irecv, then waiting for both, works too).",
    UNGROUPED: "this ring runs on gloo, which pairs sends and recvs as they come, but not as it "
               "should on NCCL: there a send and the recv that must progress with it have to be one "
               "group (NCCL's point-to-point guide: calls that need to progress concurrently must be "
               "merged, or they can deadlock; with 3 or more ranks a ring of blocking sends and "
               "recvs can). Post both as one batch before waiting for either: "
               "dist.batch_isend_irecv with two dist.P2POp (isend right, irecv left), then wait "
               "for both works.",
    UNBATCHED: "judged for NCCL, every send and recv must go through dist.batch_isend_irecv. gloo "
               "(and this lab's Cluster) pair separately called isend/irecv as they come; plain torch "
               "on NCCL groups only a batch, and ProcessGroupNCCL with device_id (eager init) "
               "serializes a lone isend or irecv with every other op, warning that it does. Post "
               "each step as one batch: dist.batch_isend_irecv([dist.P2POp(dist.isend, chunk, "
               "right), dist.P2POp(dist.irecv, buf, left)]), then .wait() on each work.",
    UNPAIRED: "a rank waited for a message that its neighbour never sent (or sent one nobody "
              "received). Every rank sends to (rank + 1) % p and receives from (rank - 1) % p, "
              "the same number of times.",
    WRONG_SPLIT: "when the length does not divide by the world size, chunks of n // p elements "
                 "leave the last n % p elements out (or a reshape to (p, -1) fails). Cut with "
                 "torch.tensor_split(t, p) (or t.chunk(p)) and size each receive buffer like the "
                 "chunk it receives.",
    NO_ALLGATHER: "after p-1 reduce-scatter steps each rank holds the full sum of only ONE chunk. "
                  "p-1 more steps must pass the finished chunks round the ring (copying, not adding).",
    NOT_IN_PLACE: "dist.all_reduce writes the sum into the tensor it is given; your function "
                  "returned the right values but left its argument unchanged. Write into it "
                  "(chunk views of it, add_/copy_).",
    AVERAGED: "the result is the mean, not the sum: all_reduce's default op is SUM (DDP divides "
              "by the world size separately).",
    NEVER_WRITTEN: "after your function every rank's tensor still held its own values: the sums "
                   "went into new tensors (x = x + y, torch.cat, a list of chunks rebound). "
                   "Write into the tensor: chunk views of it, then add_/copy_ or +=.",
    DTYPE_MISMATCH: "a send or receive buffer had another dtype than the tensor being reduced "
                    "(e.g. torch.float64 written out while lab 00 reduces float32). gloo moves bytes, "
                    "not values: make buffers with torch.empty_like(chunk) or chunk.new_empty(...).",
    MISSING_WAIT: "dist.isend/dist.irecv return a Work at once; until work.wait() returns, the "
                  "send may not have left and the received buffer may not be filled. Wait for every "
                  "one before the function returns (before reading a received buffer).",
    RING_WRONG: "",
    NOT_A_RING: "the values are right, but a rank sent more than a ring's 2(p-1)/p of the data. "
                "Send one chunk per step to your right neighbour only.",
})
graders.TITLES.setdefault("ring_all_reduce", "ring all-reduce")
# lab 00 reduces float32 after the check (its bytes cells): graded in both
DTYPES = ("float64", "float32")


# -- on the ranks ---------------------------------------------------------------------------------
def _data(rank: int, n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-99, 100, (n,), generator=g).double()


def grade_on_rank(fn, cfg: dict) -> list:
    """Runs on every rank: the learner's ring on each length, next to dist.all_reduce."""
    import torch
    import torch.distributed as dist

    from ddplab.pg.backend import device

    rank, p = dist.get_rank(), dist.get_world_size()
    cases = []
    plan = [(n, dt) for dt in cfg["dtypes"] for n in cfg["lengths"]]
    for i, (n, dtype) in enumerate(plan):
        mine = _data(rank, n, cfg["seed"]).to(device(), getattr(torch, dtype))
        reference = mine.clone()
        dist.all_reduce(reference)  # torch's own answer, before the learner's code runs
        t = mine.clone()
        case = {"n": n, "ref": reference.cpu(), "p": p, "element_size": t.element_size(),
                "dtype": dtype, "in": mine.cpu()}
        log = None
        try:
            with watch_p2p(cfg["timeout"], tag=f"{cfg['tag']}/{i}") as log:
                ret = fn(t)
            case["ret"] = ret.detach().cpu() if isinstance(ret, torch.Tensor) else None
        except NotImplementedError:
            case["error"] = ("NotImplementedError", "")
        except P2PStalled as e:
            case["stalled"] = (e.op, e.peer)
        except SizeMismatch as e:
            case["size_mismatch"] = str(e)
        except Exception as e:  # the learner's bug, reported in words below
            case["error"] = (type(e).__name__, str(e)[:400], traceback.format_exc()[-1500:])
        case["out"] = t.cpu()
        case["log"] = log.as_dict() if log is not None else None
        cases.append(case)
        if not _all_ranks_ok("ret" in case, f"ddplab-ring/{cfg['tag']}/{i}", rank, p, cfg["timeout"]):
            break  # every rank stops at the same case (or all go on)
    return cases


def _all_ranks_ok(ok: bool, prefix: str, rank: int, p: int, timeout: float) -> bool:
    """Agree through the store, not a collective: a failed ring may have left an
    unmatched isend inside gloo, and a collective on the same pair could wait behind it."""
    import datetime

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.set(f"{prefix}/{rank}", "1" if ok else "0")
    keys = [f"{prefix}/{r}" for r in range(p)]
    store.wait(keys, datetime.timedelta(seconds=2 * timeout + 10))
    return all(store.get(k) == b"1" for k in keys)


# -- in the kernel ----------------------------------------------------------------------------------
def judged_for_nccl(backend) -> bool:
    """Whether a backend name means NCCL's rules: "nccl", "cpu:gloo,cuda:nccl", "ddplab_nccl"."""
    return "nccl" in str(backend or "").lower()


def check_ring_all_reduce(cluster, fn, *, lengths=(10, 1001), timeout: float = 5.0, seed: int = 0,
                          backend: str | None = None):
    """Grade ``fn(tensor)``: afterwards ``tensor`` holds the SUM over ranks, as after
    ``dist.all_reduce(tensor)``, using only send/recv (isend/irecv), and each rank sent
    about 2(p-1)/p of the tensor. Needs a Cluster of at least 3 ranks.

    ``backend`` is the backend to judge for (default: the Cluster's). Under ``"nccl"``
    each wait comes after both halves of its exchange were posted, and every send and recv
    from ``dist.batch_isend_irecv``, even when the ranks run on gloo."""
    _refuse_arguments(cluster, fn, lengths)
    cfg = dict(lengths=list(lengths), timeout=float(timeout), seed=seed, tag=uuid.uuid4().hex,
               dtypes=list(DTYPES))
    graders.passed["ring_all_reduce"] = False
    per_rank = _run_on_ranks(cluster, fn, cfg)
    try:
        summary = diagnose(per_rank, backend or getattr(cluster, "backend", "gloo"))
    except CheckFailed as failed:
        if any(_left_pending(case) for cases in per_rank for case in cases):
            # an isend/irecv without a partner may still be posted inside gloo: fresh ranks
            cluster.ensure_ready(stale="The ring stopped halfway: an unmatched send or recv may "
                                       "still be posted inside gloo.")
            failed = CheckFailed(failed.mistake, f"{failed.detail}\n(The ranks were replaced: "
                                 "an unmatched send or recv may still have been posted.)")
        raise failed from None
    graders.passed["ring_all_reduce"] = True
    print(summary)
    return per_rank


def _refuse_arguments(cluster, fn, lengths) -> None:
    """Raise on what the check cannot grade: not a function, fewer than 3 ranks, a length that divides."""
    if not callable(fn):
        raise TypeError(f"pass your ring function itself, got {type(fn).__name__}")
    if getattr(cluster, "world_size", 0) < 3:
        raise ValueError("the ring check needs at least 3 ranks (with 2, left and right are the "
                         "same neighbour): ddplab.Cluster(3)")
    p = cluster.world_size
    if any(n % p == 0 for n in lengths):
        raise ValueError(f"choose lengths that do not divide by {p}: that is where rings go wrong")


def _run_on_ranks(cluster, fn, cfg: dict) -> list:
    """Every rank's cases; a rank that died or raised outside the learner's code becomes a CheckFailed."""
    job_timeout = len(cfg["lengths"]) * len(DTYPES) * (2 * cfg["timeout"] + 10) + 20
    try:
        return cluster.run_job(grade_on_rank, (fn, cfg), job_timeout=job_timeout)
    except RankDied as err:  # numels are compared before a recv is posted: the bytes were not
        raise CheckFailed(DTYPE_MISMATCH, f"{str(err).splitlines()[0]}: gloo aborts a process that "
                          "receives more bytes than its buffer holds, here a buffer with smaller "
                          "elements than the tensor's (or an irecv buffer too short). The ranks "
                          "were replaced.") from None
    except RankError as err:
        raise graders.from_rank_error(err) from None


def _left_pending(case) -> bool:
    """Whether a case may have left an unmatched isend/irecv inside gloo (blocking send and
    recv start their real transfer only once both sides are there, so they never do)."""
    return bool((case.get("log") or {}).get("unfinished"))


def diagnose(per_rank: list, backend: str = "gloo") -> str:
    """A summary if every case passed, else ``CheckFailed`` naming the first mistake."""
    p = len(per_rank)
    for i in range(len(per_rank[0])):
        cases = [r[i] for r in per_rank if i < len(r)]
        _diagnose_case(cases, p, backend)
    lengths = ", ".join(sorted({str(c["n"]) for c in per_rank[0]}))
    lines = [f"ring all-reduce: passed on {p} ranks, {' and '.join(DTYPES)}, lengths {lengths} "
             f"(none divisible by {p}); every rank equals dist.all_reduce."]
    last = per_rank[0][-1]  # the bytes of the last case graded
    model = ring_bytes_model(last["n"], last["element_size"], p)
    sent = [r[-1]["log"]["bytes_sent"] for r in per_rank]
    lines.append(f"  n={last['n']}: bytes sent per rank {sent}; {last['dtype']}; "
                 f"model 2(p-1)/p * n * {last['element_size']} = {model:.0f}.")
    return "\n".join(lines)


# -- one case, judged step by step: the first mistake found is named ----------------------------------
def _diagnose_case(cases, p, backend="gloo"):
    """Raise ``CheckFailed`` for the first mistake in one case (one length and dtype, every rank)."""
    where = f"(length {cases[0]['n']}, {cases[0]['dtype']}, on {p} ranks)"
    errors = {r: c["error"] for r, c in enumerate(cases) if "error" in c}
    _refuse_forbidden_calls(cases, errors)
    _refuse_odd_messages(cases, where)
    _refuse_wrong_split(cases, errors, where)
    _refuse_stalls(cases, p)
    if judged_for_nccl(backend):
        _refuse_what_nccl_cannot_run(cases, where)
    _refuse_raised(errors, where)
    _refuse_wrong_values(cases, p, where)
    _refuse_more_than_a_ring(cases, p, where)


def _log(case) -> dict:
    """What ``watch_p2p`` saw in this case (empty when the ring raised before it was entered)."""
    return case.get("log") or {}


def _refuse_forbidden_calls(cases, errors) -> None:
    """Not written yet (NotImplementedError), or a collective doing the work."""
    if any(e[0] == "NotImplementedError" for e in errors.values()):
        raise CheckFailed(NOT_IMPLEMENTED, "your ring raised NotImplementedError.")
    used = sorted({name for c in cases for name in _log(c).get("collectives", ())})
    if used:
        raise CheckFailed(COLLECTIVE, f"called: {', '.join('dist.' + u for u in used)}.")


def _refuse_odd_messages(cases, where) -> None:
    """A message whose elements are not the tensor's size (another dtype), then a work never waited."""
    for r, c in enumerate(cases):
        log = _log(c)
        odd = [(peer, numel, nbytes) for key in ("sent", "received") for peer, numel, nbytes in log.get(key, ())
               if numel and nbytes != numel * c["element_size"]]
        if odd:
            peer, numel, nbytes = odd[0]
            raise CheckFailed(DTYPE_MISMATCH, f"rank {r} {where}: a message of {numel} elements to/from "
                              f"rank {peer} was {nbytes // numel} bytes per element; the tensor's "
                              f"{c['dtype']} is {c['element_size']}.")
    unwaited = {r: _log(c)["unfinished"] for r, c in enumerate(cases) if _log(c).get("unfinished")}
    # a ring that raised or stalled leaves works unwaited as a matter of course: named below
    interrupted = any(k in c for c in cases for k in ("error", "stalled", "size_mismatch"))
    if unwaited and not interrupted:
        r = min(unwaited)
        raise CheckFailed(MISSING_WAIT, f"rank {r} {where}: {unwaited[r]} isend/irecv work(s) not "
                          "waited for when your function returned.")


def _refuse_wrong_split(cases, errors, where) -> None:
    """Chunks that cannot be cut this way (torch's words), or a recv sized unlike its send."""
    for r, e in errors.items():
        if "invalid for input of size" in e[1] or "split_size" in e[1]:
            raise CheckFailed(WRONG_SPLIT, f"rank {r} {where}: {e[0]}: {e[1]}")
    mismatch = [c["size_mismatch"] for c in cases if "size_mismatch" in c]
    if mismatch:
        raise CheckFailed(WRONG_SPLIT, f"{where}: {mismatch[0]}.")


def _refuse_stalls(cases, p) -> None:
    """A wait with no partner: every rank stuck in send is the deadlock, anything else unpaired."""
    stalled = {r: c["stalled"] for r, c in enumerate(cases) if "stalled" in c}
    if not stalled:
        return
    lines = [f"rank {r} was blocked in {'send to' if op == 'send' else 'recv from'} rank {peer}"
             for r, (op, peer) in sorted(stalled.items())]
    if len(stalled) == p and all(op == "send" for op, _ in stalled.values()):
        raise CheckFailed(DEADLOCK, "stopped after the timeout: " + "; ".join(lines) + ".")
    raise CheckFailed(UNPAIRED, "stopped after the timeout: " + "; ".join(lines) + ".")


def _first_note(cases, key):
    """(rank, note) of the lowest rank whose log has a ``key`` note, or None."""
    notes = {r: _log(c)[key] for r, c in enumerate(cases) if _log(c).get(key)}
    return (min(notes), notes[min(notes)]) if notes else None


def _refuse_what_nccl_cannot_run(cases, where) -> None:
    """Judged for NCCL: an exchange not posted as one group (first: that one can deadlock),
    then a send or recv issued outside batch_isend_irecv."""
    ungrouped = _first_note(cases, "ungrouped")
    if ungrouped:
        rank, note = ungrouped
        raise CheckFailed(UNGROUPED, f"rank {rank} {where} {note}.")
    unbatched = _first_note(cases, "unbatched")
    if unbatched:
        rank, note = unbatched
        raise CheckFailed(UNBATCHED, f"rank {rank} {where} {note}.")


def _refuse_raised(errors, where) -> None:
    """Any other exception from the learner's ring, with its traceback."""
    if not errors:
        return
    r = min(errors)
    name, text = errors[r][0], errors[r][1]
    trace = errors[r][2] if len(errors[r]) > 2 else ""
    raise CheckFailed(RAISED, f"rank {r} {where}: {name}: {text}\n{trace}")


def _returned_the_sum(case, ref) -> bool:
    """Whether the ring returned the right sum (though its argument may be left unchanged)."""
    import torch

    return case.get("ret") is not None and case["ret"].shape == ref.shape and torch.equal(case["ret"], ref)


def _refuse_wrong_values(cases, p, where) -> None:
    """Every rank's tensor must equal dist.all_reduce's: else name how it differs."""
    import torch

    ref = cases[0]["ref"]
    untouched = all(torch.equal(c["out"], c["in"]) for c in cases)
    if untouched and not all(torch.equal(c["in"], ref) for c in cases):
        returned = all(_returned_the_sum(c, ref) for c in cases)
        raise CheckFailed(NOT_IN_PLACE if returned else NEVER_WRITTEN, f"{where}.")
    wrong = [r for r, c in enumerate(cases) if not torch.equal(c["out"], ref)]
    if wrong:
        _name_wrong_values(cases, wrong[0], p, where)


def _name_wrong_values(cases, r, p, where) -> None:
    """Rank ``r``'s tensor differs from dist.all_reduce's: say how."""
    import torch

    ref, out, n = cases[r]["ref"], cases[r]["out"], cases[r]["n"]
    if _returned_the_sum(cases[r], ref):
        raise CheckFailed(NOT_IN_PLACE, f"rank {r} {where}.")
    if torch.allclose(out * p, ref):
        raise CheckFailed(AVERAGED, f"rank {r} {where}: got {out[:3].tolist()}..., "
                          f"all_reduce gives {ref[:3].tolist()}...")
    wrong = (out != ref).nonzero().flatten().tolist()
    tail = set(range(p * (n // p), n))
    if set(wrong) <= tail:
        raise CheckFailed(WRONG_SPLIT, f"rank {r} {where}: elements {wrong} were never "
                          f"reduced (the last {n % p}).")
    for split in (torch.tensor_split(torch.arange(n), p), torch.arange(n).chunk(p)):
        finished = [sum(bool(torch.equal(c["out"][s], ref[s])) for s in split) for c in cases]
        if all(f == 1 for f in finished) and len(split) > 1:
            raise CheckFailed(NO_ALLGATHER, f"{where}: each rank holds the full sum of exactly "
                              "one chunk; the others hold partial sums.")
    raise CheckFailed(RING_WRONG, f"rank {r} {where}: {len(wrong)} of {n} elements differ from "
                      f"dist.all_reduce, first at index {wrong[0]}: got {out[wrong[0]].item():g}, "
                      f"expected {ref[wrong[0]].item():g}.")


def _refuse_more_than_a_ring(cases, p, where) -> None:
    """Right values, but a rank sent more than a ring's 2(p-1)/p of the tensor (uneven chunks allowed)."""
    n, element_size = cases[0]["n"], cases[0]["element_size"]
    limit = ring_bytes_model(n, element_size, p) + 2 * (p - 1) * element_size  # uneven chunks
    sent = [c["log"]["bytes_sent"] for c in cases]
    if max(sent) > limit:
        raise CheckFailed(NOT_A_RING, f"{where}: bytes sent per rank {sent}; a ring sends at most "
                          f"{limit:.0f} (2(p-1)/p * n * {element_size}, plus uneven chunks).")
