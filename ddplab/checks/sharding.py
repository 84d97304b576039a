"""Grader for lab 11: the sharded optimizer's step, on live ranks.

The learner writes ``step(local_optimizer, params, owner, group=None)``:
``local_optimizer`` knows only this rank's share of ``params``; ``owner``
maps each parameter to the rank that steps it. After the call every rank
must hold the weights one process gets with the unsharded optimizer.

``check_sharded_step(cluster, fn)`` runs three Adam steps of a small float64
model on every rank (every rank is given the same averaged gradient, as DDP
leaves it), next to the same model and the whole Adam in one process. After
each step it compares the weights with that process and between the ranks,
and counts at the observing group what the step handed it (``OpBytes``).

Mistakes it names: not implemented; hung (a broadcast only some ranks
make); the local optimizer never stepped; no broadcast (replicas apart);
the updated parameters not received (broadcast before the step, a gradient
or a copy broadcast instead of the parameter); broadcast from
the wrong rank (every rank agrees, on the wrong weights); other traffic than
one copy of the parameters; anything else differing from one process.
Leaves out: DDP's all-reduce (the gradients are given), param groups, and
the partition itself (``owner`` is given, as ShardedOptimizer computes it).
"""
from __future__ import annotations

import uuid

from ddplab.checks.graders import passed  # exercise -> last verdict in this kernel
from ddplab.checks.mistakes import HUNG, NOT_IMPLEMENTED, RAISED, WRONG, CheckFailed
from ddplab.cluster.errors import RankError

NO_STEP = "the local optimizer never stepped"
NO_BROADCAST = "no broadcast: each rank kept its own update"
NOT_RECEIVED = "the updated parameters did not reach the other ranks"
WRONG_SOURCE = "broadcast from the wrong rank"
WRONG_BYTES = "not one copy of the parameters sent"
STEPS = 3
HUNG_HOW = ("\nEvery rank makes every broadcast, the owner sending and the others receiving: "
            "dist.broadcast(p, src=owner[p]) on all ranks (the ranks were replaced).")


def _grade_on_rank(fn, tag: str) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn

    from ddplab.pg.group import observe
    from ddplab.sync.core.sharded_optimizer import ShardedOptimizer
    from ddplab.timeline.op_bytes import OpBytes

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 5), nn.Tanh(),
                          nn.Linear(5, 3)).double()
    ref = copy.deepcopy(model)  # one process, the whole Adam
    params = list(model.parameters())
    owner = ShardedOptimizer(params, torch.optim.SGD, lr=0.0).owner  # the partition only
    local = torch.optim.Adam([p for p in params if owner[p] == rank], lr=0.05)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(11)
    out = {"rank": rank, "steps": [], "error": None,
           "param_bytes": sum(p.numel() * p.element_size() for p in params)}
    for _step in range(STEPS):
        x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(
            8, 3, generator=g, dtype=torch.float64)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            nn.functional.mse_loss(m(x), y).backward()  # the gradient DDP would leave
        before = torch.cat([p.detach().reshape(-1).clone() for p in params])
        with observe(OpBytes()) as counted:
            try:
                fn(local, params, owner)
            except NotImplementedError:
                out["error"] = ("NotImplementedError", "")
            except Exception as exc:  # noqa: BLE001 - named by the grader, with the message
                out["error"] = (type(exc).__name__, str(exc)[:400])
        if out["error"]:
            return out
        ref_opt.step()
        mine = torch.cat([p.detach().reshape(-1) for p in params])
        every = [torch.empty_like(mine) for _ in range(ws)]
        dist.all_gather(every, mine)
        want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
        out["steps"].append({
            "vs_one_process": float((mine - want).abs().max()),
            "replicas_equal": all(torch.equal(e, every[0]) for e in every),
            "moved": not torch.equal(mine, before),
            "own_moved": any(not torch.equal(p.detach().reshape(-1), before[o:o + p.numel()])
                             for p, o in _offsets(params) if owner[p] == rank),
            "nbytes": counted.nbytes, "by_op": dict(counted.by_op)})
    return out


def _offsets(params):
    o = 0
    for p in params:
        yield p, o
        o += p.numel()


def diagnose(per_rank: list) -> None:
    errors = {r["rank"]: r["error"] for r in per_rank if r["error"]}
    if any(e[0] == "NotImplementedError" for e in errors.values()):
        raise CheckFailed(NOT_IMPLEMENTED)
    # a broadcast only some ranks make: one rank's wait times out, and the other may see
    # gloo's connection close first (its peer gave up)
    if any("timed out" in t or "Timeout" in n or "Connection closed" in t
           for n, t in errors.values()):
        raise CheckFailed(HUNG, "\n".join(f"rank {r}: {n}: {t}" for r, (n, t) in
                                          sorted(errors.items())) + HUNG_HOW)
    if errors:
        raise CheckFailed(RAISED, "\n".join(f"rank {r}: {n}: {t}" for r, (n, t) in
                                            sorted(errors.items())))
    first = [r["steps"][0] for r in per_rank]
    size = per_rank[0]["param_bytes"]
    if not any(s["own_moved"] or s["moved"] for s in first):
        raise CheckFailed(NO_STEP, "no weight changed on any rank: call local_optimizer.step() "
                                   "first; it updates this rank's share.")
    if all(s["nbytes"] == 0 for s in first) and not all(s["replicas_equal"] for s in first):
        raise CheckFailed(NO_BROADCAST, "each rank updated its own share and sent nothing, so "
                                        "the ranks now hold different weights. After the step, "
                                        "broadcast every parameter from its owner: "
                                        "dist.broadcast(p, src=owner[p]).")
    for r in per_rank:
        for i, s in enumerate(r["steps"]):
            if s["nbytes"] != size or set(s["by_op"]) - {"broadcast"}:
                # zeroing the others' parameters, then all-reducing, ends with the right weights
                reduced = ("" if "all_reduce" not in s["by_op"] else
                           " An all-reduce of parameters the other ranks zeroed gives the right "
                           "weights, but on a ring it sends 2(p-1)/p of the bytes per rank where "
                           "broadcasts from the owners send (p-1)/p on average: twice the traffic.")
                raise CheckFailed(WRONG_BYTES, f"rank {r['rank']}, step {i}: your step handed the "
                                               f"group {s['nbytes']} bytes ({s['by_op']}); the "
                                               f"parameters are {size} bytes, and each one "
                                               "travels once, from its owner." + reduced)
    if not all(s["replicas_equal"] for r in per_rank for s in r["steps"]):
        raise CheckFailed(NOT_RECEIVED, "the ranks hold different weights although every "
                                        "parameter's bytes were sent: what travelled was not "
                                        "the updated parameter itself. Broadcast after "
                                        "local_optimizer.step(), and broadcast p (or p.data) in "
                                        "place, not its gradient or a copy: the receiving "
                                        "ranks' p must be overwritten.")
    worst = max(s["vs_one_process"] for r in per_rank for s in r["steps"])
    if worst > 1e-12:
        mistake = WRONG_SOURCE if all(s["replicas_equal"] for r in per_rank
                                      for s in r["steps"]) else WRONG
        raise CheckFailed(mistake, f"every rank holds the same weights, {worst:.2e} away from "
                                   "one process: a parameter was sent by a rank that did not step "
                                   "it. The source of p's broadcast is owner[p].")


def check_sharded_step(cluster, fn, *, timeout: float = 60.0) -> list:
    """Grade ``fn(local_optimizer, params, owner)`` on every rank against one process."""
    if not callable(fn):
        raise TypeError(f"pass your function itself, got {type(fn).__name__}")
    if getattr(cluster, "world_size", 0) < 2:
        raise ValueError("this check needs a Cluster of at least 2 ranks: ddplab.Cluster(2)")
    passed["sharded_step"] = False
    try:
        per_rank = cluster.run_job(_grade_on_rank, (fn, uuid.uuid4().hex), job_timeout=timeout)
    except RankError as err:
        cluster.ensure_ready(stale="The sharded step stopped halfway: a broadcast may still "
                                   "be posted inside gloo.")
        if isinstance(err, TimeoutError) or "imeout" in str(err):
            raise CheckFailed(HUNG, str(err).splitlines()[0] + HUNG_HOW) from None
        raise CheckFailed(RAISED, str(err).splitlines()[0]) from None
    if all(r["error"] and r["error"][0] == "NotImplementedError" for r in per_rank):
        # the untouched exercise: every rank stopped at the same line, before any broadcast,
        # so nothing is half-done and the ranks stay as they are
        raise CheckFailed(NOT_IMPLEMENTED)
    if any(r["error"] for r in per_rank):  # a broadcast may be left half-done inside gloo
        cluster.ensure_ready(stale="The sharded step stopped halfway: a broadcast may still "
                                   "be posted inside gloo.")
    diagnose(per_rank)
    passed["sharded_step"] = True
    print(f"sharded step: passed. Equal to one process after each of {STEPS} Adam steps on "
          f"{len(per_rank)} ranks; each step sent {per_rank[0]['param_bytes']} bytes "
          "(one copy of the parameters)")
    return per_rank
