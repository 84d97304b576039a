"""Graders for lab 05: DistributedSampler's indices, and BatchNorm statistics over all ranks.

``check_sampler_indices(fn)`` compares ``fn(dataset_len, world_size, rank,
drop_last)`` with torch's own ``DistributedSampler(shuffle=False)`` on lengths
that divide and lengths that do not, and names: no padding (ranks get
different numbers of samples), padding with the wrong indices (torch repeats
from the START), contiguous blocks instead of dealing round-robin, and
``drop_last`` ignored, padding when the length already divides.

``check_batch_stats(cluster, fn)`` calls ``fn(x)`` on every rank, ``x`` of
shape (batch, channels) with a DIFFERENT batch size on every rank, and wants
the per-channel mean and biased variance of all ranks' batches together (what
SyncBatchNorm normalizes with). It names: only this rank's statistics; the
mean of the ranks' means (wrong when the batch sizes differ); the mean of the
ranks' variances (misses how far the ranks' means are apart); the unbiased
variance (BatchNorm normalizes with the biased one); a ``keepdim`` shape; the
count taken as the local batch size times the world size.

Leaves out: SyncBatchNorm's backward pass (the gradient of the statistics)
and the running-statistics update.
"""
from __future__ import annotations

from ddplab.checks import graders
from ddplab.checks.mistakes import EXPLAIN, NOT_IMPLEMENTED, RAISED, CheckFailed
from ddplab.cluster.errors import RankError

NO_PADDING = "no padding: ranks get different numbers of samples"
PAD_FROM_END = "padded with the wrong indices"
BLOCKS = "contiguous blocks instead of round-robin"
DROP_LAST_IGNORED = "drop_last ignored"
LOCAL_STATS = "only this rank's statistics"
MEAN_OF_MEANS = "mean of the ranks' means"
MEAN_OF_VARS = "mean of the ranks' variances"
UNBIASED = "unbiased variance"
PAD_WHEN_DIVIDES = "padded although the length divides by the world size"
KEEPDIM = "statistics of shape (1, C): keepdim"
COUNT_LOCAL_TIMES_WORLD = "the count taken as local n x world size"
SAMPLER_WRONG = "the indices differ from DistributedSampler's"
STATS_WRONG = "the statistics differ from those of all ranks' samples together"

EXPLAIN.update({
    NO_PADDING: "every rank must get ceil(n / world_size) samples (or floor with drop_last): ranks "
                "that run different numbers of steps wait for each other's all-reduce for ever.",
    PAD_FROM_END: "DistributedSampler pads the list by repeating it from its START "
                  "(indices 0, 1, ...), before dealing it out.",
    BLOCKS: "DistributedSampler deals the (padded) list round-robin: rank r takes positions "
            "r, r + world_size, r + 2 * world_size, ... (indices[rank::world_size]).",
    DROP_LAST_IGNORED: "with drop_last=True the list is cut to a multiple of world_size "
                       "(the tail is dropped) instead of padded.",
    LOCAL_STATS: "the statistics must be those of all ranks' samples together: all-reduce "
                 "the sums, the sums of squares and the counts, then divide.",
    MEAN_OF_MEANS: "averaging the ranks' means weighs a rank with 3 samples like one with 9. "
                   "All-reduce the SUM of x and the COUNT, then divide.",
    MEAN_OF_VARS: "the variance of the union is not the mean of the variances: it also "
                  "includes how far each rank's mean is from the global mean. Use "
                  "E[x^2] - E[x]^2 from all-reduced sums of x and of x * x.",
    PAD_WHEN_DIVIDES: "DistributedSampler pads only up to the next multiple of world_size: when "
                      "dataset_len divides, nothing is added (total = ceil(n / world_size) * "
                      "world_size, not (n // world_size + 1) * world_size).",
    KEEPDIM: "return one value per channel, shape (C,): x.sum(0), not x.sum(0, keepdim=True) "
             "(a (1, C) result broadcasts silently and breaks the next shape check).",
    COUNT_LOCAL_TIMES_WORLD: "the batch sizes differ between ranks, so the total count is not "
                             "x.shape[0] * world_size: all-reduce the count too.",
    SAMPLER_WRONG: "",
    STATS_WRONG: "",
    UNBIASED: "BatchNorm normalizes with the biased variance (divide by N, not N - 1).",
})
graders.TITLES.setdefault("sampler", "DistributedSampler indices")
graders.TITLES.setdefault("batch_stats", "batch statistics over ranks")

SAMPLER_CASES = [(10, 4), (8, 4), (7, 2), (3, 8), (11, 3)]


def check_sampler_indices(fn) -> None:
    """Grade ``fn(dataset_len, world_size, rank, drop_last)`` against DistributedSampler."""
    from ddplab.lessons.data import sampler_indices

    graders.passed["sampler"] = False
    for n, world in SAMPLER_CASES:
        for drop_last in (False, True):
            try:
                mine = [list(graders.attempt(fn, n, world, r, drop_last)) for r in range(world)]
            except CheckFailed:
                raise
            except Exception as exc:  # noqa: BLE001 - the learner's error, in words
                raise CheckFailed(RAISED, f"my_sampler_indices({n}, {world}, rank, {drop_last}) raised "
                                          f"{type(exc).__name__}: {exc}") from None
            want = sampler_indices(n, world, drop_last)
            if mine == want:
                continue
            where = f"dataset_len={n}, world_size={world}, drop_last={drop_last}: yours {mine}, torch's {want}"
            if drop_last and mine == sampler_indices(n, world, False):
                raise CheckFailed(DROP_LAST_IGNORED, where)
            if not drop_last and n % world == 0 and sum(map(len, mine)) > n:
                raise CheckFailed(PAD_WHEN_DIVIDES, where)
            if len({len(s) for s in mine}) > 1 or sum(map(len, mine)) < sum(map(len, want)):
                raise CheckFailed(NO_PADDING, where)
            if sorted(i for s in mine for i in s) != sorted(i for s in want for i in s):
                raise CheckFailed(PAD_FROM_END, where)
            if [sorted(s) for s in mine] != [sorted(s) for s in want]:
                raise CheckFailed(BLOCKS, where)
            raise CheckFailed(SAMPLER_WRONG, where)
    graders.passed["sampler"] = True
    print(f"my_sampler_indices matches DistributedSampler on {len(SAMPLER_CASES)} sizes, "
          "with and without drop_last.")


def _rank_batch(rank: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    # different sizes AND different means on every rank: that is where the shortcuts go wrong
    return torch.randn(3 + 4 * rank, 3, generator=g, dtype=torch.float64) * (1 + rank) + 2.0 * rank


def stats_on_rank(fn):
    import torch
    import torch.distributed as dist

    from ddplab.pg.backend import device

    rank, p = dist.get_rank(), dist.get_world_size()
    x = _rank_batch(rank).to(device())
    try:
        mean, var = fn(x)
    except NotImplementedError:
        return {"not_implemented": True}
    everyone = [_rank_batch(r) for r in range(p)]
    full = torch.cat(everyone)
    return {"mean": torch.as_tensor(mean).detach().cpu().double(),
            "var": torch.as_tensor(var).detach().cpu().double(),
            "want_mean": full.mean(0), "want_var": full.var(0, unbiased=False),
            "local": (x.cpu().mean(0), x.cpu().var(0, unbiased=False)),
            "mean_of_means": torch.stack([e.mean(0) for e in everyone]).mean(0),
            "mean_of_vars": torch.stack([e.var(0, unbiased=False) for e in everyone]).mean(0),
            # squares around each rank's OWN mean, summed and divided by the total count
            "local_times_world": full.sum(0) / (len(x) * p),
            "weighted_vars": sum(e.var(0, unbiased=False) * len(e) for e in everyone) / len(full),
            "unbiased": full.var(0, unbiased=True)}


def check_batch_stats(cluster, fn, *, timeout: float = 30.0) -> list:
    """Grade ``fn(x) -> (mean, var)``: per-channel statistics of every rank's ``x`` together."""
    import torch

    if not callable(fn):
        raise TypeError(f"pass your function itself, got {type(fn).__name__}")
    if getattr(cluster, "world_size", 0) < 2:
        raise ValueError("the check needs at least 2 ranks: ddplab.Cluster(2)")
    graders.passed["batch_stats"] = False
    try:
        per_rank = cluster.run_job(stats_on_rank, (fn,), job_timeout=timeout)
    except RankError as err:
        raise graders.from_rank_error(err) from None
    if any(f.get("not_implemented") for f in per_rank):
        raise CheckFailed(NOT_IMPLEMENTED, "your function raised NotImplementedError.")

    def close(a, b):
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=1e-9)

    for r, f in enumerate(per_rank):
        if close(f["mean"], f["want_mean"]) and close(f["var"], f["want_var"]):
            continue
        where = (f"rank {r}: mean {f['mean'].tolist()} (want {f['want_mean'].tolist()}), "
                 f"var {f['var'].tolist()} (want {f['want_var'].tolist()})")
        if f["mean"].shape != f["want_mean"].shape and f["mean"].numel() == f["want_mean"].numel() and \
                f["mean"].reshape(-1).shape == f["want_mean"].shape:
            raise CheckFailed(KEEPDIM, f"rank {r}: mean of shape {tuple(f['mean'].shape)}, var of shape "
                                       f"{tuple(f['var'].shape)}; want {tuple(f['want_mean'].shape)}.")
        if close(f["mean"], f["local"][0]):
            raise CheckFailed(LOCAL_STATS, where)
        if close(f["mean"], f["local_times_world"]) and not close(f["mean"], f["want_mean"]):
            raise CheckFailed(COUNT_LOCAL_TIMES_WORLD, where)
        if close(f["mean"], f["mean_of_means"]):
            raise CheckFailed(MEAN_OF_MEANS, where)
        if close(f["mean"], f["want_mean"]) and close(f["var"], f["unbiased"]):
            raise CheckFailed(UNBIASED, where)
        if close(f["mean"], f["want_mean"]) and (close(f["var"], f["mean_of_vars"])
                                                 or close(f["var"], f["weighted_vars"])):
            raise CheckFailed(MEAN_OF_VARS, where)
        raise CheckFailed(STATS_WRONG, where)
    graders.passed["batch_stats"] = True
    sizes = [3 + 4 * r for r in range(len(per_rank))]
    print(f"batch statistics: passed on {len(per_rank)} ranks with batch sizes {sizes}; "
          "every rank has the mean and variance of all samples together.")
    return per_rank
