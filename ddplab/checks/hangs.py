"""Grader for lab 06: a training loop that hangs on uneven data, and the fix the learner writes.

The exercise: every rank has its own number of batches (``n_local``); a
loop of ``n_local`` DDP steps hangs, because the rank with more batches
calls one more all-reduce than the others. The learner writes
``agreed_steps(n_local)``, which every rank calls and which must return the
number of steps EVERY rank can take: the minimum over ranks, found with one
collective (``all_reduce`` with ``ReduceOp.MIN``).

``check_agreed_steps(cluster, fn)`` calls ``fn`` on the live ranks with
uneven counts (the smallest on the first rank, then on the last, then all
equal), names the mistake from what came back, and on a pass trains torch
DDP for that many steps on every rank to show that the loop now ends.

Mistakes it names (each planted in tests/checks/test_checks_labs06_08.py):
not implemented; hung (a collective only some ranks call); each rank's own
count (no collective); rank 0's count broadcast; the maximum (a rank runs out of data); the sum; a
wrong number otherwise.
Leaves out: torch's ``Join`` context manager (``with model.join():``), the
other fix, which keeps every sample by shadowing the missing all-reduces; lab
06 shows it.
"""
from __future__ import annotations

from ddplab.checks.graders import passed  # exercise -> last verdict in this kernel
from ddplab.checks.mistakes import HUNG, NOT_IMPLEMENTED, CheckFailed
from ddplab.cluster.errors import RankError

OWN_COUNT = "each rank used its own count"
MAXIMUM = "the maximum instead of the minimum"
SUMMED = "the counts were summed"
NOT_MIN = "not the smallest count"
NOT_A_NUMBER = "not a whole number"
BROADCAST = "rank 0's count broadcast, not the minimum"


def counts_for(world_size: int) -> list:
    """The configurations graded: ``[counts by rank, ...]``."""
    return [[5 + 2 * r for r in range(world_size)],  # the first rank has fewest
            [9 - 2 * r + world_size for r in range(world_size)],  # the last rank has fewest
            [4] * world_size]  # even: every answer that is a count passes here


def _ask_on_rank(fn, configurations):
    import torch.distributed as dist

    rank = dist.get_rank()
    return [fn(counts[rank]) for counts in configurations]


def _as_int(value):
    try:
        number = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return int(number) if number == int(number) else None


def _train_on_rank(counts, steps):
    import torch.distributed as dist

    return train_uneven_on_rank(counts[dist.get_rank()], steps)


def train_all_batches_on_rank(counts) -> dict:
    """The loop that hangs: every rank trains on all ``counts[rank]`` of its batches."""
    import torch.distributed as dist

    n_local = counts[dist.get_rank()]
    return train_uneven_on_rank(n_local, n_local)


def train_uneven_on_rank(n_local: int, steps: int) -> dict:
    """Train torch DDP for ``steps`` steps on a rank that holds ``n_local`` batches."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if steps > n_local:
        raise IndexError(f"rank {dist.get_rank()} has {n_local} batches and was asked for step {n_local}")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randn(8, 4, generator=g) for _ in range(n_local)]
    for x in batches[:steps]:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return {"steps": steps, "skipped": n_local - steps, "weight": model.module.weight.detach().clone()}


def diagnose(configurations, answers) -> None:
    """``answers[rank][i]``: what ``fn`` returned on ``rank`` for configuration ``i``."""
    for i, counts in enumerate(configurations):
        got = [_as_int(per_rank[i]) for per_rank in answers]
        shown = f"counts by rank {counts}, your function returned {[a[i] for a in answers]}"
        if any(g is None for g in got):
            raise CheckFailed(NOT_A_NUMBER, f"{shown}. Return the number of steps (an int, or a "
                                            "one-element tensor holding it).")
        if len(set(got)) > 1:
            raise CheckFailed(OWN_COUNT, f"{shown}: the ranks disagree, so the loop still hangs. "
                                         "Combine the counts across ranks with a collective first "
                                         "(dist.all_reduce(t, op=dist.ReduceOp.MIN)).")
        answer = got[0]
        if answer == min(counts):
            continue
        if answer == counts[0]:
            raise CheckFailed(BROADCAST, f"{shown}: every rank took rank 0's count. dist.broadcast "
                                         "copies one rank's value, it compares nothing; the minimum "
                                         "is dist.all_reduce(t, op=dist.ReduceOp.MIN).")
        if answer == max(counts):
            raise CheckFailed(MAXIMUM, f"{shown}: a rank with fewer batches would run out of data "
                                       "(or the others would wait for it forever). Every rank "
                                       "can take only as many steps as the rank with FEWEST batches.")
        if answer == sum(counts):
            raise CheckFailed(SUMMED, f"{shown}: all_reduce sums by default; ask for "
                                      "op=dist.ReduceOp.MIN.")
        raise CheckFailed(NOT_MIN, f"{shown}; the answer is the smallest count, {min(counts)}.")


def check_agreed_steps(cluster, fn, *, train: bool = True) -> dict:
    """Grade ``fn(n_local) -> steps``; on a pass, train torch DDP on uneven data for that many steps."""
    if not callable(fn):
        raise TypeError(f"pass your function itself, got {type(fn).__name__}")
    if getattr(cluster, "world_size", 0) < 2:
        raise ValueError("this check needs a Cluster of at least 2 ranks: ddplab.Cluster(2)")
    configurations = counts_for(cluster.world_size)
    passed["agreed_steps"] = False
    try:
        answers = cluster.run_job(_ask_on_rank, (fn, configurations), job_timeout=2 * cluster.timeout + 10)
    except RankError as err:
        errors = [e for e in err.exceptions.values() if e is not None]
        if any(isinstance(e, NotImplementedError) for e in errors):
            raise CheckFailed(NOT_IMPLEMENTED) from None
        if isinstance(err, TimeoutError):
            status = "; ".join(f"rank {r}: {s}" for r, s in sorted(err.status.items()))
            raise CheckFailed(HUNG, f"stopped after the Cluster's timeout ({status}). A collective "
                                    "called on some ranks only waits forever: every rank must call "
                                    "it (the ranks were replaced).") from None
        from ddplab.checks.graders import raised

        raise raised(err) from None
    diagnose(configurations, answers)
    passed["agreed_steps"] = True
    summary = {"configurations": configurations, "answers": [[_as_int(a) for a in r] for r in answers]}
    if train:
        counts = configurations[0]
        steps = summary["answers"][0][0]
        trained = cluster.run(_train_on_rank, counts, steps)
        same = all(bool((t["weight"] == trained[0]["weight"]).all()) for t in trained)
        summary.update(trained_steps=steps, skipped=[t["skipped"] for t in trained], weights_equal=same)
    print(f"agreed_steps: passed. Counts {configurations[0]} -> every rank takes {summary['answers'][0][0]} "
          "steps" + (f"; DDP trained on uneven data and ended (batches left unused by rank: "
                     f"{summary['skipped']}; weights equal on every rank: {summary['weights_equal']})."
                     if train else "."))
    return summary
