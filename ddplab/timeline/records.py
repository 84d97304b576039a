"""What a timeline is made of: per-iteration phases and per-bucket communication.

Teaches: to see data-parallel training you need, on every rank and for every
iteration, when forward and backward ran, when each bucket's gradients were
all ready, when its all-reduce was launched and when it finished, and when the
optimizer stepped. Those few stamps answer "when is the sync?", "how much of
the communication hides behind backward?" and "who waits for whom?".

Honesty rules kept by these records:
- every stamp says where it came from (``SOURCES``): the CPU clock, a CUDA
  event, NCCL's own work timing, the profiler, derived from other stamps, or
  the simulated link. On GPUs a CPU stamp is when the host *asked* for a
  collective, not when NCCL ran it; such stamps are never drawn as execution.
- simulated and oversubscribed runs carry that label in the timeline's meta.

Times are seconds on the rank's monotonic clock until ``align`` shifts them
onto rank 0's clock with the estimated offsets.

Leaves out, compared with torch's profiler traces: kernel-level events,
memory, CPU sampling. References: torch.autograd.profiler; Chrome Trace
Event Format.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SOURCES = ("cpu", "cuda_event", "nccl_timing", "profiler", "derived", "simulated")
PHASES = ("no_sync", "forward", "backward", "wait", "step")


@dataclass
class BucketRecord:
    rank: int
    iteration: int
    index: int
    nbytes: int
    params: tuple = ()
    grads_ready_first: float | None = None  # first gradient of the bucket ready
    grads_ready: float | None = None  # last gradient ready: the bucket may launch
    launch: float | None = None  # all-reduce handed to the backend
    comm_start: float | None = None  # transfer really started (when it can be known)
    comm_end: float | None = None  # result available on this rank
    sources: dict = field(default_factory=dict)  # stamp name -> one of SOURCES
    simulated: bool = False
    # What the bucket's collectives were handed, when it differs from what the bucket held
    # (``nbytes``): a comm hook that compresses (torch's fp16_compress_hook) sends half.
    # None: not counted apart, the same as nbytes.
    wire_nbytes: int | None = None

    def sent_bytes(self) -> int:
        """The payload handed to the collectives: ``wire_nbytes`` when counted, else ``nbytes``."""
        return self.nbytes if self.wire_nbytes is None else self.wire_nbytes

    def comm_interval(self):
        start = self.comm_start if self.comm_start is not None else self.launch
        if start is None or self.comm_end is None:
            return None
        return (start, self.comm_end)


@dataclass
class GradRecord:
    """One parameter's gradient became ready (accumulated into ``.grad``) on one rank.

    Kept per parameter, not only per bucket, so that a recording can be re-bucketed
    afterwards: which bucket would close when under another ``bucket_cap_mb``.
    """
    rank: int
    iteration: int
    param: int  # index in model.parameters()
    nbytes: int
    ready: float
    source: str = "cpu"  # one of SOURCES


@dataclass
class IterationRecord:
    rank: int
    iteration: int
    start: float | None = None
    end: float | None = None
    # phase name -> (start, end); see PHASES
    phases: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    # "warmup", "ddp_one_bucket" (torch DDP's first iteration), "ddp_rebuild",
    # "no_sync": excluded from averages, shown and labelled in pictures.
    flags: set = field(default_factory=set)

    def span(self, phase):
        return self.phases.get(phase)


@dataclass
class Timeline:
    strategy: str
    world_size: int
    backend: str = "gloo"
    iterations: list = field(default_factory=list)  # IterationRecord
    buckets: list = field(default_factory=list)  # BucketRecord
    # simulated_link (dict or None), oversubscribed, clock offsets and bound,
    # bucket layout, anything a picture must label.
    meta: dict = field(default_factory=dict)
    grads: list = field(default_factory=list)  # GradRecord, when recorded per parameter

    def for_rank(self, rank):
        return ([it for it in self.iterations if it.rank == rank],
                [b for b in self.buckets if b.rank == rank])

    def iteration_numbers(self, include_flagged=False):
        nums = sorted({it.iteration for it in self.iterations
                       if include_flagged or not (it.flags - {"no_sync"})})
        return nums

    def buckets_of(self, rank, iteration):
        return sorted((b for b in self.buckets if b.rank == rank and b.iteration == iteration),
                      key=lambda b: b.index)

    def iteration(self, rank, iteration):
        for it in self.iterations:
            if it.rank == rank and it.iteration == iteration:
                return it
        return None

    # -- plain data, for JSON and for crossing process boundaries --------------
    def to_dict(self) -> dict:
        def rec(r):
            d = dataclasses.asdict(r)
            if "flags" in d:
                d["flags"] = sorted(d["flags"])
            if "params" in d:
                d["params"] = list(d["params"])
            if "phases" in d:
                d["phases"] = {k: list(v) for k, v in d["phases"].items()}
            return d

        return {"strategy": self.strategy, "world_size": self.world_size, "backend": self.backend,
                "meta": self.meta, "iterations": [rec(i) for i in self.iterations],
                "buckets": [rec(b) for b in self.buckets],
                "grads": [rec(g) for g in self.grads]}

    @classmethod
    def from_dict(cls, d: dict) -> "Timeline":
        its = []
        for i in d["iterations"]:
            i = dict(i, flags=set(i.get("flags", ())),
                     phases={k: tuple(v) for k, v in i.get("phases", {}).items()})
            its.append(IterationRecord(**i))
        bks = [BucketRecord(**dict(b, params=tuple(b.get("params", ())))) for b in d["buckets"]]
        grads = [GradRecord(**g) for g in d.get("grads", ())]
        return cls(d["strategy"], d["world_size"], d.get("backend", "gloo"), its, bks,
                   dict(d.get("meta", {})), grads)

    @classmethod
    def merge(cls, parts: list) -> "Timeline":
        """One timeline from each rank's own part (as gathered after a run)."""
        first = parts[0]
        merged = cls(first.strategy, first.world_size, first.backend, [], [], dict(first.meta))
        for p in parts:
            merged.iterations += p.iterations
            merged.buckets += p.buckets
            merged.grads += p.grads
        return merged

    def shifted(self, offsets: dict) -> "Timeline":
        """A copy with rank r's stamps moved by ``-offsets[r]`` (onto rank 0's clock)."""
        def move(t, r):
            return None if t is None else t - offsets.get(r, 0.0)

        its = [dataclasses.replace(
            it, start=move(it.start, it.rank), end=move(it.end, it.rank),
            phases={k: (move(a, it.rank), move(b, it.rank)) for k, (a, b) in it.phases.items()},
            flags=set(it.flags)) for it in self.iterations]
        bks = [dataclasses.replace(
            b, **{k: move(getattr(b, k), b.rank) for k in
                  ("grads_ready_first", "grads_ready", "launch", "comm_start", "comm_end")})
            for b in self.buckets]
        grads = [dataclasses.replace(g, ready=move(g.ready, g.rank)) for g in self.grads]
        return Timeline(self.strategy, self.world_size, self.backend, its, bks, dict(self.meta),
                        grads)
