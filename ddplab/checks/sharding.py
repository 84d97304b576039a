"""Grader for lab 11: the sharded optimizer (ZeRO-1), its partition and its step, on live ranks.

The learner writes two functions:

- ``partition(params, world_size) -> owner``: a dict from each parameter to the
  rank that steps it (every parameter owned by exactly one rank, the same dict
  on every rank);
- ``step(local_optimizer, params, owner)``: ``local_optimizer`` knows only this
  rank's share; step it, then share the updated parameters, so that every rank
  holds the weights one process gets with the unsharded optimizer.

Every way of sharing them passes: a broadcast of each parameter from its owner
(torch's ``ZeroRedundancyOptimizer``), or an all-gather of flat shards (each
rank flattens what it owns, pads it to the largest share, ``all_gather`` or
``all_gather_into_tensor``, then cuts the result back into the parameters,
padding dropped).

``check_sharded_step(cluster, step, partition=None)`` runs three Adam steps of a
small float64 model on every rank (every rank is given the same averaged
gradient, as DDP leaves it), next to the same model and the whole Adam in one
process. Its weights have even and odd sizes, so shares that do not divide
evenly (where padding goes wrong) occur at 2 and at 3 ranks. Without
``partition`` the owners are ``ShardedOptimizer``'s. After each step it
compares the weights with one process and between the ranks, and counts at the
observing group what the step handed it (``OpBytes``).

Mistakes it names: not implemented; a parameter no rank owns; ranks that
disagree on the owners; hung (a collective only some ranks make); the local
optimizer never stepped; nothing shared (replicas apart); an asynchronous
collective never waited for (seen at the group: no wait on its work); the updated
parameters not received (a broadcast before the step, of a gradient or of a
copy); the gathered shards never copied back into the parameters; other
traffic than one copy of the parameters; a parameter sent by a rank that does
not own it; the gradients divided by the world size a second time; the
gathered shards cut into the wrong parameters; anything else differing from
one process.
Leaves out: DDP's all-reduce (the gradients are given), param groups, and
whether the shares are balanced (any partition trains the same weights).
References: torch/distributed/optim/zero_redundancy_optimizer.py
(``_partition_parameters``, ``_sync_params``); torch.distributed.all_gather,
all_gather_into_tensor and broadcast; Rajbhandari et al. 2020 (ZeRO), stage 1.
"""
from __future__ import annotations

import operator
import uuid

from ddplab.checks.graders import (  # passed: exercise -> last verdict
    not_finished,
    outside_collectives,
    passed,
    refuse_changed_torch,
)
from ddplab.checks.mistakes import HUNG, NOT_IMPLEMENTED, RAISED, WRONG, CheckFailed
from ddplab.cluster.errors import RankError

NOT_OWNED = "a parameter no rank owns"
OWNERS_DIFFER = "the ranks disagree on who owns what"
NO_STEP = "the local optimizer never stepped"
NO_BROADCAST = "nothing shared: each rank kept its own update"
NOT_RECEIVED = "the updated parameters did not reach the other ranks"
NOT_COPIED_BACK = "the gathered parameters were never copied back"
WRONG_SOURCE = "a parameter sent by a rank that does not own it"
DIVIDED_TWICE = "the gradients divided by the world size again"
WRONG_CUT = "the gathered shards cut into the wrong parameters"
WRONG_BYTES = "not one copy of the parameters sent"
NOT_WAITED = "an asynchronous collective never waited for"
AVERAGED_COPIES = "averaged stepped and unstepped copies"
OWN_OPTIMIZER = "the weights changed, but not through the local optimizer"
STEPS = 3
GATHERS = {"all_gather", "all_gather_into_tensor"}
HUNG_HOW = ("\nEvery rank makes every collective: each broadcast (the owner sending, the others "
            "receiving), or the one all-gather (the ranks were replaced).")


def _grade_on_rank(step, partition, tag: str) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn

    from ddplab.pg.group import observe
    from ddplab.sync.core.sharded_optimizer import ShardedOptimizer
    from ddplab.timeline.op_bytes import OpBytes

    class Counted(OpBytes):  # the bytes, and which calls were waited for
        def launched(self, op, tensors, group, peer):
            super().launched(op, tensors, group, peer)
            self.unwaited = getattr(self, "unwaited", set()) | {sum(self.calls.values())}
            return sum(self.calls.values())

        def waiting(self, token):  # c10d waits on a blocking call's work too
            self.unwaited.discard(token)

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    # weights of 25, 5, 35, 7, 28, 4 elements, even and odd: torch's partition gives shares
    # of 51 and 53 at 2 ranks, 35, 33 and 36 at 3, so a rank's flat shard is padded at both
    model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 7), nn.Tanh(),
                          nn.Linear(7, 4)).double()
    ref, halved = copy.deepcopy(model), copy.deepcopy(model)  # one process; and on grad / ws
    params = list(model.parameters())
    out = {"rank": rank, "steps": [], "error": None, "owners": None, "every_owners": None,
           "sizes": [p.numel() * p.element_size() for p in params]}
    if partition is None:
        owner = ShardedOptimizer(params, torch.optim.SGD, lr=0.0).owner  # the partition only
    else:
        try:
            owner = partition(params, ws)
            out["owners"] = [_rank_of(owner, p, ws) for p in params]
        except NotImplementedError:
            out["error"] = ("NotImplementedError", "your partition")
        except Exception as exc:  # noqa: BLE001 - named by the grader, with the message
            out["error"] = (type(exc).__name__, "your partition: " + str(exc)[:400])
        # every rank makes this gather, whatever its partition did, so none is left waiting
        out["every_owners"] = [None] * ws
        dist.all_gather_object(out["every_owners"], out["owners"])
        if out["error"] or any(o != out["owners"] for o in out["every_owners"]) \
                or None in out["owners"]:
            return out
    # one group, possibly empty: a partition may leave a rank nothing to step
    local = torch.optim.Adam([{"params": [p for p in params if owner[p] == rank]}], lr=0.05)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    halved_opt = torch.optim.Adam(halved.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(11)
    for i in range(STEPS):
        x, y = torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randn(
            8, 4, generator=g, dtype=torch.float64)
        for m in (model, ref, halved):
            m.zero_grad(set_to_none=True)
            nn.functional.mse_loss(m(x), y).backward()  # the gradient DDP would leave
        for p in halved.parameters():
            p.grad.div_(ws)
        before = [p.detach().clone() for p in params]
        with observe(Counted()) as counted:
            try:
                step(local, params, owner)
            except NotImplementedError:
                out["error"] = ("NotImplementedError", "your step")
            except Exception as exc:  # noqa: BLE001 - named by the grader, with the message
                out["error"] = (type(exc).__name__, str(exc)[:400])
        if out["error"]:
            return out
        ref_opt.step()
        halved_opt.step()
        # the weights go back to the kernel, which compares the ranks: no collective of the
        # grader's own follows the learner's, so one a rank skipped is not answered by ours
        out["steps"].append({
            "weights": torch.cat([p.detach().reshape(-1) for p in params]),
            "vs_one_process": _furthest(params, ref.parameters()),
            "vs_halved": _furthest(params, halved.parameters()),
            "unchanged": [torch.equal(p, b) for p, b in zip(params, before)],
            # Adam counts its steps per parameter: did the local optimizer step at all?
            "stepped": any(float(s.get("step", 0)) > i for s in local.state.values()),
            "owned": [owner[p] for p in params],
            "nbytes": counted.nbytes, "by_op": dict(counted.by_op),
            "unwaited": len(getattr(counted, "unwaited", ()))})
    return out


def _rank_of(owner, p, ws):
    """owner[p] if it is a rank of the group, else None."""
    try:
        r = operator.index(owner[p])  # an int, or what stands for one (a 0-d integer tensor)
    except (KeyError, IndexError, TypeError, RuntimeError):
        return None
    return r if 0 <= r < ws and not isinstance(owner[p], bool) else None


def _furthest(params, others) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(params, others))


def _diagnose_partition(per_rank: list) -> None:
    owners = per_rank[0]["owners"]
    if owners is None:  # not asked for (ShardedOptimizer's), or it raised (named before)
        return
    ws = len(per_rank)
    for r in per_rank:
        if None in r["owners"]:
            i = r["owners"].index(None)
            raise CheckFailed(NOT_OWNED, f"on rank {r['rank']}, parameter {i} (of {len(owners)}) has "
                                         f"no owner in 0..{ws - 1}: nobody would step it. Return a "
                                         "dict {parameter: rank} with every parameter in it, each "
                                         "given to one rank of range(world_size).")
    if any(r["owners"] != owners for r in per_rank):
        said = "; ".join(f"rank {r['rank']}: {r['owners']}" for r in per_rank)
        raise CheckFailed(OWNERS_DIFFER, f"owners of the parameters, in order: {said}. Every rank "
                                         "must compute the same partition: decide from what every "
                                         "rank sees alike (the parameters' sizes and order), never "
                                         "from the rank or from chance.")


def _shares(per_rank: list) -> list:
    """Bytes each rank owns at the first step."""
    s = per_rank[0]["steps"][0]
    every = [0] * len(per_rank)
    for size, r in zip(per_rank[0]["sizes"], s["owned"]):
        every[r] += size
    return every


def _traffic(per_rank: list) -> None:
    size, largest = sum(per_rank[0]["sizes"]), max(_shares(per_rank))
    worst = max(s["vs_one_process"] for r in per_rank for s in r["steps"])
    if worst > 1e-12 and any("all_reduce" in s["by_op"] for r in per_rank for s in r["steps"]):
        # the values first: an all-reduce of parameters nobody zeroed sums every rank's copy,
        # stepped by its owner or not, and the weights are wrong whatever the traffic
        raise CheckFailed(AVERAGED_COPIES, f"your weights are {worst:.2e} away from one process's: "
                          "an all-reduce sums every rank's copy of a parameter, and only its owner "
                          "stepped it: divided by the world size or not, the stepped copy is mixed "
                          "with unstepped ones. Zero the parameters a rank does not own first, or "
                          "better, send each parameter once, from its owner "
                          "(dist.broadcast(p, src=owner[p])).")
    for r in per_rank:
        for i, s in enumerate(r["steps"]):
            ops = set(s["by_op"])
            if ops == {"broadcast"} and s["nbytes"] == size:
                continue
            if ops and ops <= GATHERS and s["nbytes"] == largest:
                continue
            why = (" An all-reduce of parameters the other ranks zeroed gives the right weights, "
                   "but on a ring it sends 2(p-1)/p of the bytes per rank where one copy sends "
                   "(p-1)/p: twice the traffic." if "all_reduce" in ops else "")
            if ops <= GATHERS:
                why += (f" An all-gather hands the group this rank's flat shard once, padded to "
                        f"the largest share: {largest} bytes here.")
            raise CheckFailed(WRONG_BYTES, f"rank {r['rank']}, step {i}: your step handed the "
                                           f"group {s['nbytes']} bytes ({s['by_op']}); the "
                                           f"parameters are {size} bytes, and each one travels "
                                           "once, from its owner." + why)


def _hint(said: str) -> str:
    """The cause behind torch's words for the usual slips of a gathered step."""
    if "invalid tensor type" in said:
        return ("\nA buffer of another dtype than the parameters' (float64 here): make it with "
                "flat.new_empty(...) or torch.empty_like(flat).")
    if "must match the size of tensor" in said or "mat1 and mat2" in said:
        return ("\nA parameter lost its shape, or a flat piece met a shaped one: copy each piece "
                "back with p.copy_(piece.view_as(p)) (p.data = piece gives p the piece's flat "
                "shape).")
    return ""


def _replicas_equal(per_rank, i) -> bool:
    first = per_rank[0]["steps"][i]["weights"]
    return all(first.equal(r["steps"][i]["weights"]) for r in per_rank)


def diagnose(per_rank: list) -> None:
    errors = {r["rank"]: r["error"] for r in per_rank if r["error"]}
    if any(e[0] == "NotImplementedError" for e in errors.values()):
        where = sorted({e[1] for e in errors.values() if e[0] == "NotImplementedError"})
        raise CheckFailed(NOT_IMPLEMENTED, f"({' and '.join(where)})")
    # a collective only some ranks make: one rank's wait times out, and the other may see
    # gloo's connection close first (its peer gave up)
    if any("timed out" in t or "Timeout" in n or "Connection closed" in t
           for n, t in errors.values()):
        raise CheckFailed(HUNG, "\n".join(f"rank {r}: {n}: {t}" for r, (n, t) in
                                          sorted(errors.items())) + HUNG_HOW)
    if errors:
        said = " ".join(t for _, t in errors.values())
        pad = _hint(said) + ("\ngloo's all-gather takes the same number of elements from every "
                             "rank: pad each rank's flat shard to the largest share, and drop "
                             "the padding when copying back."
                             if "allgather" in said and "size" in said else "")
        raise CheckFailed(RAISED, "\n".join(f"rank {r}: {n}: {t}" for r, (n, t) in
                                            sorted(errors.items())) + pad)
    _diagnose_partition(per_rank)
    first = [r["steps"][0] for r in per_rank]
    moved = any(not all(s["unchanged"]) for s in first)
    if not any(s["stepped"] for s in first) and moved:
        raise CheckFailed(OWN_OPTIMIZER, "your step changed the weights, yet local_optimizer "
                                         "never stepped: each rank updated parameters with an "
                                         "optimizer of its own (every parameter, with Adam's "
                                         "state for all of them on every rank: nothing sharded, "
                                         "no memory saved). Step local_optimizer, which holds "
                                         "this rank's share only, then share the parameters from "
                                         "their owners.")
    if not any(s["stepped"] for s in first):
        raise CheckFailed(NO_STEP, "no weight changed on any rank: call local_optimizer.step() "
                                   "first; it updates this rank's share.")
    if all(s["nbytes"] == 0 for s in first) and not _replicas_equal(per_rank, 0):
        raise CheckFailed(NO_BROADCAST, "each rank updated its own share and sent nothing, so "
                                        "the ranks now hold different weights. After the step, "
                                        "share every parameter from its owner: "
                                        "dist.broadcast(p, src=owner[p]), or an all-gather of "
                                        "the owners' flat shards.")
    unwaited = [(r["rank"], i, s["unwaited"]) for r in per_rank for i, s in enumerate(r["steps"])
                if s.get("unwaited")]
    if unwaited:
        rank, i, n = unwaited[0]
        raise CheckFailed(NOT_WAITED, f"rank {rank}, step {i}: {n} collective(s) launched with "
                                      "async_op=True were never waited for, so the parameters may "
                                      "not have arrived when your step returned. Keep each work "
                                      "and call work.wait() on all of them before returning.")
    _traffic(per_rank)
    gathered = set(first[0]["by_op"]) <= GATHERS
    if not all(_replicas_equal(per_rank, i) for i in range(STEPS)):
        if gathered:
            raise CheckFailed(NOT_COPIED_BACK, "the ranks hold different weights although every "
                                               "share was gathered: after the all-gather, after "
                                               "local_optimizer.step(), cut rank r's part back into "
                                               "the parameters r owns and copy it into each one "
                                               "(p.data.copy_(piece.view_as(p))). A view of the "
                                               "gathered tensor is not the parameter.")
        raise CheckFailed(NOT_RECEIVED, "the ranks hold different weights although every "
                                        "parameter's bytes were sent: what travelled was not "
                                        "the updated parameter itself. Broadcast after "
                                        "local_optimizer.step(), and broadcast p (or p.data) in "
                                        "place, not its gradient or a copy: the receiving "
                                        "ranks' p must be overwritten.")
    steps = [s for r in per_rank for s in r["steps"]]
    worst = max(s["vs_one_process"] for s in steps)
    if worst <= 1e-12:
        return
    if max(s["vs_halved"] for s in steps) <= 1e-12:
        raise CheckFailed(DIVIDED_TWICE, "your weights are one process's, stepped on the gradients "
                                         "divided by the world size. DDP already averaged them: "
                                         "the gradient your step is given is the mean, so step it "
                                         "as it is. (Adam hides most of it, dividing by the "
                                         f"gradient's size: {worst:.2e} away; SGD would not.)")
    # a parameter no rank moved, though one process moved it: the copy that travelled came
    # from a rank that never stepped it (its owner's update was overwritten)
    stale = [i for i, u in enumerate(first[0]["unchanged"]) if all(s["unchanged"][i] for s in first)]
    if stale and not gathered:
        raise CheckFailed(WRONG_SOURCE, f"every rank holds the same weights, {worst:.2e} away from "
                                        f"one process, and parameters {stale} did not move on any "
                                        "rank: each was sent by a rank that did not step it. The "
                                        "source of p's broadcast is owner[p].")
    if gathered:
        raise CheckFailed(WRONG_CUT, f"every rank holds the same weights, {worst:.2e} away from "
                                     "one process: rank r's part of the gathered tensor holds the "
                                     "parameters r owns, in params' order, then padding. Cut each "
                                     "part at the same sizes it was flattened with, and drop the "
                                     "padding at its end. (dist.all_gather needs one tensor per "
                                     "rank: a list holding one buffer world_size times is "
                                     "overwritten by every rank's part.)")
    raise CheckFailed(WRONG, f"every rank holds the same weights, {worst:.2e} away from one process.")


def check_sharded_step(cluster, step, partition=None, *, timeout: float = 60.0) -> list:
    """Grade ``step(local_optimizer, params, owner)`` (and ``partition(params, world_size)``,
    when given) on every rank against one process."""
    for name, fn in (("step", step), ("partition", partition)):
        if fn is not None and not callable(fn):
            raise TypeError(f"pass your {name} function itself, got {type(fn).__name__}")
    if getattr(cluster, "world_size", 0) < 2:
        raise ValueError("this check needs a Cluster of at least 2 ranks: ddplab.Cluster(2)")
    passed["sharded_step"] = False
    refuse_changed_torch(cluster)
    try:
        per_rank = cluster.run_job(_grade_on_rank, (step, partition, uuid.uuid4().hex),
                                   job_timeout=timeout)
    except RankError as err:
        cluster.ensure_ready(stale="The sharded step stopped halfway: a collective may still "
                                   "be posted inside gloo.")
        if outside_collectives(err):  # no collective pending there: not a hang, a loop
            raise not_finished(err, outside_collectives(err)) from None
        if isinstance(err, TimeoutError) or "imeout" in str(err):
            raise CheckFailed(HUNG, str(err).splitlines()[0] + HUNG_HOW) from None
        raise CheckFailed(RAISED, str(err).splitlines()[0] + _hint(str(err))) from None
    if all(r["error"] and r["error"][0] == "NotImplementedError" for r in per_rank):
        # the untouched exercise: every rank stopped at the same line, before any collective of
        # the step, so nothing is half-done and the ranks stay as they are
        diagnose(per_rank)
    if any(r["error"] and not r["error"][1].startswith("your partition") for r in per_rank):
        # a collective may be left half-done inside gloo (the partition makes none of the step's)
        cluster.ensure_ready(stale="The sharded step stopped halfway: a collective may still "
                                   "be posted inside gloo.")
    diagnose(per_rank)
    passed["sharded_step"] = True
    how = "broadcasts" if set(per_rank[0]["steps"][0]["by_op"]) == {"broadcast"} else "an all-gather"
    print(f"sharded step: passed. Equal to one process after each of {STEPS} Adam steps on "
          f"{len(per_rank)} ranks; shares of {_shares(per_rank)} bytes; each step shared the "
          f"parameters by {how}, {per_rank[0]['steps'][0]['nbytes']} bytes handed the group "
          "per rank")
    return per_rank
