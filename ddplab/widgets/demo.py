"""Made-up timelines with the shapes real ones have, for pictures without a cluster.

Teaches nothing about speed (every number here is invented); it lets a
learner without ranks (Binder preview, a docs page), the widget tests and the
browser test draw the same pictures the real engine feeds. The shapes follow
what the strategies really do: ``manual`` all-reduces after backward,
``overlap`` and ``bucketed`` launch during backward, ``ddp`` starts with one
bucket and rebuilds before its second iteration, a simulated link stretches
transfers by the alpha-beta model, a straggler's backward runs long and the
other ranks wait for it.

Everything is deterministic: ``DemoRunner`` varies its timings a little from
call to call (as real runs do) from a seed that is the call number.

Leaves out: everything measured. Use ``ddplab.measure.compare`` for that.
References: torch's Reducer (bucket order, the rebuild after iteration 0);
ddplab.netsim.link for the alpha-beta transfer time.
"""
from __future__ import annotations

import math
import random

from ddplab.netsim import LinkModel
from ddplab.sync.registry import get_strategy
from ddplab.timeline import BucketRecord, IterationRecord, Timeline, add_saved_ms, summarize

FAKE_CPU_BYTES_PER_S = 1.5e9  # an invented "real gloo on CPU" speed


def synthetic_timeline(strategy="bucketed", world_size=2, n_iterations=4, n_params=5e6,
                       bucket_cap_mb=25.0, batch_size=32, link=None, straggler=None,
                       oversubscribed=False, seed=0) -> Timeline:
    """A Timeline shaped like ``strategy``'s (times in seconds from 0)."""
    rng = random.Random(f"{strategy}-{seed}")
    link = LinkModel.parse(link)
    shape = get_strategy(strategy).shape  # how its communication sits (ddplab.sync.registry)
    total_bytes = int(4 * n_params)
    layers = 8
    layer_bytes = total_bytes // layers
    compute = 2e-9 * n_params * batch_size ** 0.5 + 0.01  # invented, grows with both
    fwd, bwd, opt = 0.3 * compute, 0.6 * compute, 0.1 * compute
    if shape in ("none", "after_backward", "after_backward_flat"):
        groups = {"none": [], "after_backward": [[i] for i in range(layers)],
                  "after_backward_flat": [list(range(layers))]}[shape]
    elif shape == "per_parameter":
        groups = [[i] for i in reversed(range(layers))]  # one per parameter, as ready
    else:  # buckets, torch_ddp: reverse order, a bucket closes once it reaches the cap (torch)
        cap = bucket_cap_mb * 2**20
        groups, current = [], []
        for i in reversed(range(layers)):
            current.append(i)
            if len(current) * layer_bytes >= cap:
                groups.append(current)
                current = []
        if current:
            groups.append(current)
    slow_rank, factor = straggler if straggler else (None, 1.0)
    tl = Timeline(strategy, world_size, "gloo", meta={
        "simulated_link": link.describe() if link else None,
        "oversubscribed": bool(oversubscribed), "usable_cpus": 2, "demo": True,
        "straggler": list(straggler) if straggler else None})
    t0 = 0.0
    for i in range(n_iterations):
        jitter = 1.0 + 0.05 * rng.random()
        torch_first = shape == "torch_ddp" and i == 0  # one bucket, before the rebuild
        layout = [list(range(layers))] if torch_first else groups
        after_backward = shape.startswith("after_backward") or torch_first
        bwd_end = {r: t0 + (fwd + bwd * (factor if r == slow_rank else 1.0)) * jitter
                   for r in range(world_size)}
        slowest = max(bwd_end.values())
        # a collective starts when the LAST rank launches it, and ends together everywhere
        free, ends = t0, []
        for k, g in enumerate(layout):
            nbytes = layer_bytes * len(g)
            ready_frac = 1.0 if after_backward else (layers - min(g)) / layers
            ready = t0 + (fwd + bwd * ready_frac * (factor if slow_rank is not None else 1.0)) * jitter
            start = max(ready, free, slowest if after_backward else ready)
            cost = link.allreduce_seconds(nbytes, world_size) if link else nbytes / FAKE_CPU_BYTES_PER_S
            end = start + cost + 2e-4
            free = end
            ends.append((k, g, nbytes, ready_frac, start, end))
        comm_end = max((e[5] for e in ends), default=slowest)
        for r in range(world_size):
            wait_end = max(bwd_end[r], comm_end)
            end = wait_end + opt * jitter
            it = IterationRecord(r, i, start=t0, end=end, phases={
                "forward": (t0, t0 + fwd * jitter), "backward": (t0 + fwd * jitter, bwd_end[r]),
                "wait": (bwd_end[r], wait_end), "step": (wait_end, end)},
                sources={p: "cpu" for p in ("forward", "backward", "wait", "step")})
            if torch_first:
                it.flags.add("ddp_one_bucket")
            elif shape == "torch_ddp" and i == 1:
                it.flags.add("ddp_rebuild")
            elif i == 0:
                it.flags.add("warmup")
            tl.iterations.append(it)
            launched = t0
            for k, g, nbytes, frac, start, end in ends:
                own = factor if r == slow_rank else 1.0
                own_ready = t0 + (fwd + bwd * frac * own) * jitter
                launched = max(launched, own_ready)  # index order
                tl.buckets.append(BucketRecord(
                    r, i, k, nbytes, tuple(f"layers.{j}.weight" for j in g),
                    grads_ready=own_ready, launch=launched,
                    comm_start=max(start, launched), comm_end=end, simulated=link is not None,
                    sources={"grads_ready": "cpu", "launch": "cpu",
                             "comm_start": "simulated" if link else "derived",
                             "comm_end": "simulated" if link else "cpu"}))
        t0 = max(it.end for it in tl.iterations if it.iteration == i) + 0.002
    return tl


class DemoRunner:
    """A stand-in for ``ddplab.measure.compare`` with the panel's calling convention.

    ``runner(**config) -> {"timelines": {name: Timeline}, "metrics": {name: dict}}``;
    remembers every config it was called with (``.configs``).
    """

    def __init__(self, fail_with: BaseException | None = None):
        self.configs: list[dict] = []
        self.fail_with = fail_with

    @property
    def calls(self) -> int:
        return len(self.configs)

    def __call__(self, strategies=("manual", "bucketed"), world_size=2, steps=4, link=None,
                 straggler=None, bucket_cap_mb=25.0, n_params=5e6, batch_size=32,
                 progress=None, **_ignored):
        self.configs.append(dict(strategies=list(strategies), world_size=world_size, steps=steps,
                                 link=link, straggler=straggler, bucket_cap_mb=bucket_cap_mb,
                                 n_params=n_params, batch_size=batch_size))
        if self.fail_with is not None:
            raise self.fail_with
        timelines, metrics = {}, {}
        for k, s in enumerate(strategies):
            if progress is not None:
                progress(k, len(strategies), f"running {s}")
            early = 2 if get_strategy(s).shape == "torch_ddp" else 1  # flagged, not averaged
            tl = synthetic_timeline(s, world_size, n_iterations=max(1, steps) + early,
                                    n_params=n_params, bucket_cap_mb=bucket_cap_mb,
                                    batch_size=batch_size, link=link, straggler=straggler,
                                    oversubscribed=world_size > 2, seed=self.calls)
            timelines[s] = tl
            metrics[s] = summarize(tl)
        add_saved_ms(metrics)
        if progress is not None:
            progress(len(strategies), len(strategies), "done")
        return {"timelines": timelines, "metrics": metrics}


def demo_result(strategies=("manual", "overlap", "bucketed", "ddp"), **config) -> dict:
    """One DemoRunner result: timelines and metrics, for a picture in one line."""
    return DemoRunner()(strategies=strategies, **config)


def expected_buckets(n_params=5e6, bucket_cap_mb=25.0) -> int:
    """How many buckets ``synthetic_timeline`` gives bucketed/ddp after the rebuild."""
    layer_bytes = int(4 * n_params) // 8
    per_bucket = max(1, math.ceil(bucket_cap_mb * 2**20 / layer_bytes))  # closed on reaching it
    return math.ceil(8 / per_bucket)
