"""compare(): every strategy side by side in ONE run, on live ranks.

Teaches how to measure fairly on a shared, noisy machine:
- all strategies run in the same processes, interleaved step by step (and
  the order rotates each step), so drift (thermal, background load, caches)
  hits them all alike;
- warm-up steps are excluded, and so are torch DDP's one-bucket first
  iteration and its rebuild;
- torch DDP is timed untraced (its step time is the reference); a traced copy
  is run alongside for its timeline only. Under a simulated link the timed
  copy sends its buckets through a plain comm hook into ddplab.sync.comm,
  where the link lives, so every row pays the same network (labelled);
- the default bucket cap (2 MB) is below torch's 25 MB on purpose: the
  default model has ~8 MB of gradients, which 25 MB would put in one bucket
  launched after backward; the figure and the JSON say so;
- medians over steps, and every rank's clock aligned to rank 0's with the
  bound reported;
- a simulated link is labelled as such, and so is a run with more ranks
  than usable CPUs (oversubscribed).

The same engine backs ``python -m ddplab compare`` and the notebooks' widgets.

Leaves out: multi-node runs (use torchrun with the same strategies).
"""
from __future__ import annotations

import dataclasses
import json

from ..timeline import Timeline, add_saved_ms, summarize
from .runners import STRATEGIES


@dataclasses.dataclass
class CompareResult:
    world_size: int
    backend: str
    timelines: dict  # strategy -> Timeline (aligned to rank 0's clock)
    metrics: dict  # strategy -> metrics dict (see ddplab.timeline.metrics)
    meta: dict

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "backend": self.backend,
                "simulated_link": self.meta.get("simulated_link"),
                "oversubscribed": self.meta.get("oversubscribed", False),
                "clock": self.meta.get("clock"), "config": self.meta.get("config"),
                "bucket_cap_note": self.meta.get("bucket_cap_note"),
                "strategies": self.metrics}

    def write_json(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2, default=str)


def parse_strategies(strategies) -> list:
    if isinstance(strategies, str):
        strategies = [s.strip() for s in strategies.split(",") if s.strip()]
    strategies = list(dict.fromkeys(strategies))
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        raise ValueError(f"unknown strategy {bad[0] if bad else '(none given)'!r}: choose any of "
                         f"{', '.join(STRATEGIES)}, comma-separated")
    return strategies


def _rank_main(cfg: dict) -> dict:
    """Runs on every rank: build every strategy, interleave their steps, return records."""
    import torch.distributed as dist

    from ..netsim import LinkModel
    from ..netsim.simulated import use_link
    from ..timeline.clock import estimate_offsets
    from .runners import StrategyRunner

    from ..cluster import worker

    worker.preimported.wait(timeout=120)  # keep the rank's start-up imports out of the timings
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    names = list(cfg["strategies"])
    if "ddp" in names and cfg.get("trace_ddp", True):
        names.append("ddp_traced")
    runners = [StrategyRunner(n, cfg, rank, world, backend) for n in names]
    link = LinkModel(**cfg["link"]) if cfg.get("link") else None
    total = cfg["warmup"] + cfg["steps"]
    with use_link(link, world):
        for i in range(total):
            k = i % len(runners)
            for r in runners[k:] + runners[:k]:  # rotate the order to cancel drift
                r.step(i)
            if rank == 0 and cfg.get("progress") and (i + 1) % max(1, total // 5) == 0:
                print(f"step {i + 1}/{total} done ({len(runners)} strategies)", flush=True)
    clock = estimate_offsets()
    return {"clock": clock, "runs": {r.name: r.finish() for r in runners}}


def compare(cluster=None, strategies=("none", "manual", "bucketed", "ddp"), steps: int = 10,
            warmup: int = 3, model: str = "mlp", n_params: float = 2e6, depth: int = 4,
            batch_size: int = 32, bucket_cap_mb: float = 2.0, link=None, straggler=None,
            world_size: int = 2, lr: float = 0.01, seed: int = 0, record: bool = True,
            progress: bool = False) -> CompareResult:
    """Run ``strategies`` side by side on ``cluster`` (or a temporary one of ``world_size``).

    ``link``: a LinkModel, a preset name ("10gbe") or None; ``straggler``:
    (rank, factor) or "RANK:FACTOR".
    """
    from ..cluster import Cluster
    from ..netsim import LinkModel
    from ..sync.bucket import check_bucket_cap

    names = parse_strategies(strategies)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1 (measured steps after warm-up), got {steps!r}")
    if "ddp" in names:
        warmup = max(warmup, 2)  # DDP's iterations 0 and 1 are never measured
    check_bucket_cap(bucket_cap_mb)
    if isinstance(link, str):
        link = LinkModel.preset(link)
    straggler = parse_straggler(straggler)
    cfg = {"strategies": names, "steps": steps, "warmup": warmup, "model": model,
           "model_kwargs": {"n_params": n_params, "depth": depth} if model == "mlp" else {},
           "batch_size": batch_size, "bucket_cap_mb": bucket_cap_mb, "lr": lr, "seed": seed,
           "link": None if link is None else {k: getattr(link, k) for k in
                                              ("bandwidth_gbps", "latency_us", "label")},
           "straggler": straggler, "record": record, "progress": progress}
    own = cluster is None
    cluster = Cluster(world_size) if own else cluster
    try:
        if straggler and not 0 <= straggler[0] < cluster.world_size:
            raise ValueError(f"straggler rank {straggler[0]} is not a rank of this "
                             f"{cluster.world_size}-rank cluster")
        per_rank = cluster.run(_rank_main, cfg)
    finally:
        if own:
            cluster.shutdown()
    return _assemble(per_rank, cfg, cluster, link)


def parse_straggler(straggler):
    if straggler is None or straggler == "":
        return None
    if isinstance(straggler, str):
        try:
            rank, factor = straggler.split(":")
            straggler = (int(rank), float(factor))
        except ValueError:
            raise ValueError(f"straggler must look like RANK:FACTOR (e.g. 1:2.0), got {straggler!r}") from None
    rank, factor = straggler
    if not factor >= 1.0:
        raise ValueError(f"straggler factor must be >= 1 (1 = no slowdown), got {factor}")
    return (int(rank), float(factor))


DDP_VIA_HOOK = "comm hook through ddplab.sync.comm (simulated link)"
DDP_VIA_HOOK_LABEL = ("torch DDP timed with a comm hook through ddplab.sync.comm, "
                      "so it pays the same simulated link")
TORCH_DEFAULT_CAP_MB = 25.0


def bucket_cap_note(cfg, per_rank) -> str | None:
    """Which bucket cap the bucketed rows used, and why when it is not torch's default."""
    if not {"bucketed", "ddp"} & set(cfg["strategies"]):
        return None
    cap = cfg["bucket_cap_mb"]
    grad_mib = max((r["comm_bytes_per_step"] for r in per_rank[0]["runs"].values()), default=0) / 2**20
    note = f"bucket_cap_mb={cap:g}"
    if cap < TORCH_DEFAULT_CAP_MB and 0 < grad_mib <= TORCH_DEFAULT_CAP_MB:
        note += (f" (torch's default {TORCH_DEFAULT_CAP_MB:g} MB would hold all {grad_mib:.1f} MiB "
                 "of gradients in ONE bucket, launched after backward)")
    return note


def _assemble(per_rank, cfg, cluster, link) -> CompareResult:
    from ..cluster.resources import usable_cpus

    world = cluster.world_size
    offsets = per_rank[0]["clock"]["offsets"]
    offsets = {int(k): v for k, v in offsets.items()}
    meta = {"simulated_link": None if link is None else link.describe(),
            "oversubscribed": world > usable_cpus() and cluster.backend == "gloo",
            "clock": {"offsets_s": offsets, "bound_s": per_rank[0]["clock"]["bound_s"]},
            "config": {k: v for k, v in cfg.items() if k != "progress"}}
    timelines, metrics = {}, {}
    for name in per_rank[0]["runs"]:
        parts = [Timeline.from_dict(r["runs"][name]["timeline"]) for r in per_rank]
        tl = Timeline.merge(parts).shifted(offsets)
        tl.meta.update(simulated_link=meta["simulated_link"], oversubscribed=meta["oversubscribed"])
        timelines[name] = tl
        m = summarize(tl)
        m["comm_bytes_per_step"] = per_rank[0]["runs"][name]["comm_bytes_per_step"]
        sums = [r["runs"][name]["checksum"] for r in per_rank]
        m["ranks_agree"] = name == "none" or max(sums) - min(sums) <= 1e-6 * max(1.0, abs(sums[0]))
        metrics[name] = m
    if "ddp_traced" in metrics and "ddp" in metrics:
        traced = metrics.pop("ddp_traced")
        untraced_step = metrics["ddp"]["step_ms"]
        metrics["ddp"] = dict(traced, step_ms=untraced_step, traced_step_ms=traced["step_ms"])
        timelines["ddp"] = timelines.pop("ddp_traced")
        timelines["ddp"].strategy = "ddp"
    if "ddp" in metrics:
        metrics["ddp"]["comm_path"] = DDP_VIA_HOOK if link is not None else "torch (C++ reducer)"
        timelines["ddp"].meta.setdefault("labels", [])
        if link is not None:
            timelines["ddp"].meta["labels"].append(DDP_VIA_HOOK_LABEL)
    note = bucket_cap_note(cfg, per_rank)
    if note:
        for name in ("bucketed", "ddp", "ddp_traced"):
            if name in timelines:
                timelines[name].meta.setdefault("labels", []).append(note)
        meta["bucket_cap_note"] = note
    if "none" in metrics:
        for m in metrics.values():
            m["compute_only_step_ms"] = metrics["none"]["step_ms"]
    add_saved_ms(metrics)
    if meta["simulated_link"]:
        for m in metrics.values():
            m["simulated"] = True
    return CompareResult(world, cluster.backend, timelines, metrics, meta)
