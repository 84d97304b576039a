"""Sweeps: bucket size against step time (measured next to predicted), and scaling.

Teaches two claims to test rather than believe:
- "larger buckets give more overlap": a bucket can only launch once its LAST
  gradient is ready, so bigger buckets start later; smaller buckets pay the
  per-all-reduce latency more often. The best size sits between, and moves
  with the link. The sweep measures it and puts the alpha-beta prediction
  beside it.
- scaling: strong scaling keeps the global batch and splits it (efficiency =
  T1 / (p * Tp) for the same global work); weak scaling keeps the per-rank
  batch (efficiency = T1 / Tp). Runs with more ranks than usable CPUs are
  oversubscribed and labelled: their numbers describe a crowded laptop, not
  DDP.

Leaves out: multi-node scaling (the labs say how to run the same code under
torchrun).
"""
from __future__ import annotations

import statistics

from ddplab.measure.compare import compare
from ddplab.netsim import LinkModel
from ddplab.netsim.costmodel import predict_step
from ddplab.timeline.metrics import scaling_efficiency


def _ready_profile(tl, iteration_numbers):
    """Median (bucket ready times, backward end, compute step) relative to step start."""
    ranks = sorted({it.rank for it in tl.iterations})
    readies, back_ends, sizes = [], [], None
    for i in iteration_numbers:
        for r in ranks:
            it = tl.iteration(r, i)
            buckets = tl.buckets_of(r, i)
            if it is None or not buckets or "backward" not in it.phases:
                continue
            readies.append([b.grads_ready - it.start for b in buckets])
            back_ends.append(it.phases["backward"][1] - it.start)
            sizes = [b.nbytes for b in buckets]
    if not readies:
        return None
    n = min(len(x) for x in readies)
    ready = [statistics.median(x[k] for x in readies) for k in range(n)]
    return ready, statistics.median(back_ends), sizes[:n]


def bucket_sweep(cluster, caps_mb=(0.25, 1, 4, 16, 64), link=None, steps: int = 4,
                 n_params: float = 4e6, depth: int = 8, batch_size: int = 32,
                 fitted_link: LinkModel | None = None, progress: bool = False,
                 model="mlp", batch=None, loss=None) -> dict:
    """Step time and exposed communication of BucketedDDP for each bucket cap.

    ``model``/``batch``/``loss``: a built-in model name or your own functions, as in compare().

    ``progress``: print one line per cap as it finishes (a sweep takes seconds per cap).

    ``link``: simulated link (preset name or LinkModel) or None for the real
    backend; predictions use ``link`` or, without one, ``fitted_link`` (see
    ddplab.netsim.costmodel.fit) when given.
    """
    if isinstance(link, str):
        link = LinkModel.preset(link)
    model_link = link or fitted_link
    rows = []
    for cap in caps_mb:
        r = compare(cluster, "none,bucketed", steps=steps, n_params=n_params, depth=depth,
                    batch_size=batch_size, bucket_cap_mb=cap, link=link, model=model,
                    batch=batch, loss=loss)
        m, tl = r.metrics["bucketed"], r.timelines["bucketed"]
        row = {"bucket_cap_mb": cap, "step_ms": m["step_ms"], "exposed_comm_ms": m["exposed_comm_ms"],
               "n_buckets": m["n_buckets"], "overlap_pct": m["overlap_pct"],
               "compute_only_ms": r.metrics["none"]["step_ms"],
               "predicted_step_ms": None, "predicted_exposed_ms": None}
        profile = _ready_profile(tl, tl.iteration_numbers())
        if model_link is not None and profile is not None:
            ready, back_end, sizes = profile
            p = predict_step(r.metrics["none"]["step_ms"] / 1000, back_end, ready, sizes,
                             model_link, cluster.world_size)
            row["predicted_step_ms"] = 1000 * p["step_s"]
            row["predicted_exposed_ms"] = 1000 * p["exposed_comm_s"]
        rows.append(row)
        if progress:
            print(f"  cap {cap:g} MB done ({len(rows)}/{len(caps_mb)}): {row['n_buckets']} buckets, "
                  f"step {row['step_ms']:.1f} ms", flush=True)
    return {"rows": rows, "simulated_link": None if link is None else link.describe(),
            "world_size": cluster.world_size, "n_params": n_params}


def scaling(world_sizes=(1, 2, 4), strategy: str = "bucketed", global_batch: int = 64,
            steps: int = 4, n_params: float = 1e6, link=None, progress: bool = False) -> dict:
    """Strong and weak scaling efficiency; starts a Cluster per world size.

    ``progress``: print one line per world size as it finishes (each starts its own ranks).
    """
    from ddplab.cluster import Cluster
    from ddplab.placement.resources import usable_cpus

    if 1 not in world_sizes:
        world_sizes = (1, *world_sizes)
    rows = []
    for p in sorted(set(world_sizes)):
        with Cluster(p) as c:
            strong = compare(c, strategy, steps=steps, n_params=n_params,
                             batch_size=max(1, global_batch // p), link=link)
            weak = compare(c, strategy, steps=steps, n_params=n_params,
                           batch_size=global_batch, link=link)
        rows.append({"world_size": p, "strong_step_ms": strong.metrics[strategy]["step_ms"],
                     "weak_step_ms": weak.metrics[strategy]["step_ms"],
                     "oversubscribed": strong.labels["oversubscribed"]})
        if progress:
            print(f"  {p} rank(s) done: strong {rows[-1]['strong_step_ms']:.1f} ms, "
                  f"weak {rows[-1]['weak_step_ms']:.1f} ms per step", flush=True)
    for mode in ("strong", "weak"):
        eff = scaling_efficiency({r["world_size"]: r[f"{mode}_step_ms"] for r in rows}, mode)
        for row in rows:
            row[f"{mode}_efficiency"] = eff[row["world_size"]]
    return {"rows": rows, "usable_cpus": usable_cpus(), "strategy": strategy,
            "global_batch": global_batch}
