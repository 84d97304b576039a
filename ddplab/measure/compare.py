"""compare(): every strategy side by side in ONE run, on live ranks.

Teaches how to measure fairly on a shared, noisy machine:
- all strategies run in the same processes, interleaved step by step (and
  the order rotates each step), so drift (thermal, background load, caches)
  hits them all alike;
- warm-up steps are excluded, and so are torch DDP's one-bucket first
  iteration and its rebuild;
- torch DDP is timed unrecorded (its step time is the reference); a traced
  copy is run alongside for its timeline only. It, the reference reducers
  and your own code are drawn from the observing process group, ddplab's
  strategies from their own stamps (each row's ``comm_path`` says which);
- a simulated link sits on the process group, so every row pays the same
  network, whoever makes the all-reduce;
- the default bucket cap (2 MB, see RunSpec) is below torch's 25 MB on
  purpose, and the figure and the JSON say why;
- medians over steps, and every rank's clock aligned to rank 0's with the
  bound reported;
- the run's facts (simulated link, oversubscribed, straggler, clock bound)
  are decided once, here, from the Cluster's own facts, and carried in the
  result and in every timeline's meta: pictures read them, never re-derive.

The same engine backs ``python -m ddplab compare`` and the notebooks' widgets.
Leaves out: multi-node runs (use torchrun with the same strategies:
``run_on_rank`` is the rank side).
"""
from __future__ import annotations

import dataclasses
import json

from ddplab.measure.spec import RunSpec, parse_straggler  # noqa: F401 - parse_straggler: public before RunSpec
from ddplab.timeline import Timeline, add_saved_ms, summarize

TORCH_DEFAULT_CAP_MB = 25.0


@dataclasses.dataclass
class CompareResult:
    world_size: int
    backend: str
    timelines: dict  # strategy -> Timeline (aligned to rank 0's clock)
    metrics: dict  # strategy -> metrics dict (see ddplab.timeline.metrics)
    meta: dict  # "labels" (the run's facts), "clock", "config", "simulated_link", "oversubscribed"

    @property
    def labels(self) -> dict:
        return self.meta["labels"]

    def to_json(self) -> dict:
        """The layout docs/design.md documents (pinned by tests/golden/compare_layout.json)."""
        return {"world_size": self.world_size, "backend": self.backend,
                "simulated_link": self.meta.get("simulated_link"),
                "oversubscribed": self.meta.get("oversubscribed", False),
                "clock": self.meta.get("clock"), "config": self.meta.get("config"),
                "labels": self.meta.get("labels"), "strategies": self.metrics}

    def write_json(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2, default=str)


def parse_strategies(strategies) -> list:
    """Names (a list or "a,b,c"), checked against the registry."""
    return list(RunSpec(strategies=strategies).strategies)


def _wait_for_start_up_imports() -> None:
    # A Cluster rank imports torch._dynamo in the background at start (the first
    # DDP(...) needs it); importing it here waits for that import to finish (the
    # import lock) instead of letting it land inside a measured step. Under
    # torchrun there is no background import: this simply does it now.
    try:
        import torch._dynamo  # noqa: F401
        import torch.nn.parallel  # noqa: F401
    except Exception:  # noqa: BLE001 - only a timing courtesy
        pass


def run_on_rank(spec: RunSpec, strategies: dict | None = None) -> dict:
    """Runs on every rank: build every strategy, interleave their steps, return records.

    ``strategies``: name -> ``ddplab.sync.registry.Strategy``, looked up by the
    caller (so entries registered in a notebook travel with the job).
    """
    import torch.distributed as dist

    from ddplab.measure.runners import StrategyRunner
    from ddplab.netsim.simulated import SimulatedLink
    from ddplab.sync import comm
    from ddplab.sync.registry import get_strategy
    from ddplab.timeline.clock import estimate_offsets

    _wait_for_start_up_imports()
    from ddplab.pg.backend import backend_name

    rank, world, backend = dist.get_rank(), dist.get_world_size(), backend_name()
    entries = [(strategies or {}).get(n) or get_strategy(n) for n in spec.strategies]
    runners = [StrategyRunner(s, spec, rank, world, backend) for s in entries]
    if spec.record:  # the drawn copies of strategies timed unrecorded
        runners += [StrategyRunner(s, spec, rank, world, backend, traced=True)
                    for s in entries if s.time_unrecorded]
    link = None if spec.link is None else SimulatedLink(spec.link, world)
    total = spec.warmup + spec.steps
    try:
        with comm.using_link(link):
            for i in range(total):
                k = i % len(runners)
                for r in runners[k:] + runners[:k]:  # rotate the order to cancel drift
                    r.step(i)
                if rank == 0 and spec.progress and (i + 1) % max(1, total // 5) == 0:
                    print(f"step {i + 1}/{total} done ({_counted(entries, runners)})", flush=True)
    finally:
        if link is not None:
            link.close()  # its clock thread ends with the run
    return {"clock": estimate_offsets(), "runs": {r.name: r.finish() for r in runners}}


def _counted(entries, runners) -> str:
    """"6 strategies, and a traced copy of ddp": what a progress line says it trains."""
    from ddplab.measure.runners import TRACED_SUFFIX

    text = f"{len(entries)} strateg{'y' if len(entries) == 1 else 'ies'}"
    traced = [r.name[:-len(TRACED_SUFFIX)] for r in runners[len(entries):]]
    return text + (f", and a traced copy of {', '.join(traced)} to draw" if traced else "")


def compare(cluster=None, strategies=RunSpec.strategies, steps: int = RunSpec.steps,
            warmup: int = RunSpec.warmup, model: str = RunSpec.model,
            n_params: float = RunSpec.n_params, depth: int = RunSpec.depth,
            batch_size: int = RunSpec.batch_size, bucket_cap_mb: float = RunSpec.bucket_cap_mb,
            link=None, straggler=None, world_size: int | None = None, lr: float = RunSpec.lr,
            seed: int = RunSpec.seed, record: bool = True, progress: bool = False,
            spec: RunSpec | None = None, batch=None, loss=None) -> CompareResult:
    """Run ``strategies`` side by side on ``cluster`` (or a temporary one of ``world_size``).

    ``model``: "mlp", "convnet", "transformer" or your own ``model()`` function (then
    ``batch(batch_size, rank, step) -> (inputs, target)`` too, and optionally
    ``loss(output, target)``; see ddplab.measure.workload). They are checked here,
    before any rank starts, and travel to the ranks by value.
    ``link``: a LinkModel, a preset name ("10gbe") or None; ``straggler``:
    (rank, factor) or "RANK:FACTOR". Or pass one ``spec`` (a RunSpec) instead.
    """
    from ddplab.cluster import Cluster
    from ddplab.sync.registry import get_strategy

    if spec is None:
        size = world_size or getattr(cluster, "world_size", None) or RunSpec.world_size
        spec = RunSpec(strategies, steps, warmup, model, n_params, depth, batch_size, bucket_cap_mb,
                       link, straggler, size, lr, seed, record, progress, batch, loss)
    if cluster is not None and cluster.world_size != spec.world_size:
        spec = spec.replace(world_size=cluster.world_size)  # re-checks the straggler's rank
    entries = {n: get_strategy(n) for n in spec.strategies}
    own = cluster is None
    cluster = Cluster(spec.world_size) if own else cluster
    try:
        per_rank = cluster.run(run_on_rank, spec, entries)
    finally:
        if own:
            cluster.shutdown()
    return assemble(per_rank, spec, entries, cluster)


def run_labels(spec: RunSpec, entries: dict, cluster, clock: dict, per_rank) -> dict:
    """The run's facts, decided once: every table, figure and JSON reads these."""
    from ddplab.placement.resources import usable_cpus

    note = None
    if any(s.shape in ("buckets", "torch_ddp") for s in entries.values()):
        grad = max((r["timeline"]["meta"].get("comm_bytes_per_step", 0)
                    for r in per_rank[0]["runs"].values()), default=0) / 2**20
        note = f"bucket_cap_mb={spec.bucket_cap_mb:g}"
        if spec.bucket_cap_mb < TORCH_DEFAULT_CAP_MB and 0 < grad <= TORCH_DEFAULT_CAP_MB:
            note += (f" (torch's default {TORCH_DEFAULT_CAP_MB:g} MB would hold all {grad:.1f} MiB "
                     "of gradients in ONE bucket, launched after backward)")
    return {"simulated_link": None if spec.link is None else spec.link.describe(),
            "oversubscribed": bool(getattr(cluster, "oversubscribed", False)),
            "usable_cpus": usable_cpus(), "straggler": None if spec.straggler is None
            else list(spec.straggler), "clock_bound_s": clock["bound_s"], "bucket_cap_note": note}


def assemble(per_rank, spec: RunSpec, entries: dict, cluster) -> CompareResult:
    """Rank records -> aligned timelines, metrics (one definition each) and labels."""
    world = cluster.world_size
    offsets = {int(k): v for k, v in per_rank[0]["clock"]["offsets"].items()}
    clock = {"offsets_s": offsets, "bound_s": per_rank[0]["clock"]["bound_s"]}
    labels = run_labels(spec, entries, cluster, clock, per_rank)
    timelines, metrics = {}, {}
    for name in per_rank[0]["runs"]:
        parts = [Timeline.from_dict(r["runs"][name]["timeline"]) for r in per_rank]
        tl = Timeline.merge(parts).shifted(offsets)
        tl.meta.update({k: labels[k] for k in ("simulated_link", "oversubscribed", "usable_cpus",
                                                "straggler")})
        timelines[name] = tl
        m = summarize(tl)
        sums = [r["runs"][name]["checksum"] for r in per_rank]
        m["ranks_agree"] = name == "none" or max(sums) - min(sums) <= 1e-6 * max(1.0, abs(sums[0]))
        if "memory" in per_rank[0]["runs"][name]:  # bytes each rank held (ddplab.measure.memory)
            m["memory_per_rank"] = [r["runs"][name]["memory"] for r in per_rank]
        metrics[name] = m
    for name, entry in entries.items():
        traced = name + "_traced"
        if traced in metrics:  # timed unrecorded, drawn from the traced copy
            t = metrics.pop(traced)
            metrics[name] = dict(t, step_ms=metrics[name]["step_ms"], traced_step_ms=t["step_ms"],
                                 comm_bytes_per_step=metrics[name]["comm_bytes_per_step"])
            timelines[name] = timelines.pop(traced)
            timelines[name].strategy = name
        metrics[name]["comm_path"] = timelines[name].meta.get("comm_path", "ddplab.sync.comm")
        if labels["bucket_cap_note"] and entry.shape in ("buckets", "torch_ddp"):
            timelines[name].meta.setdefault("labels", []).append(labels["bucket_cap_note"])
    if "none" in metrics:
        for m in metrics.values():
            m["compute_only_step_ms"] = metrics["none"]["step_ms"]
    add_saved_ms(metrics)
    for m in metrics.values():
        m["simulated"] = spec.link is not None
    meta = {"labels": labels, "clock": clock, "config": spec.to_dict(),
            "simulated_link": labels["simulated_link"], "oversubscribed": labels["oversubscribed"]}
    return CompareResult(world, cluster.backend, timelines, metrics, meta)
