"""A simulated link: what 10 GbE or NVLink would do to the same step, on a laptop.

Teaches the alpha-beta model of a ring all-reduce over p ranks of n bytes:

    time = 2(p-1) * alpha  +  2(p-1)/p * n / bandwidth

(2(p-1) steps, each paying the latency alpha; every rank sends and receives
2(p-1)/p of the payload). Small buckets pay alpha many times; large buckets
start late because they wait for more gradients: that tension is why bucket
size matters.

The other collectives go round the ring once where an all-reduce goes twice
(it IS a reduce-scatter, then an all-gather): a reduce-scatter of n bytes
(the full input), an all-gather whose gathered output is n bytes, and a
broadcast of n bytes each cost (p-1) * alpha + (p-1)/p * n / bandwidth, half
an all-reduce of the same full size (``collective_seconds``; for the
broadcast that is a ring's average per rank: ddplab.measure.fits says more).
The simulated link and ``ddplab.measure.fits`` both call it, so what is
predicted and what is simulated cannot drift apart.

How it is applied (clearly labelled "simulated" wherever shown): each rank
has one link, modelled identically on every rank as a queue. A transfer
starts when it is launched AND the link is free, lasts the model's time for
its collective, and the collective completes no earlier than both that and the real transfer.
The delay lives in the future of the work the process group returns
(``ddplab.netsim.simulated``): the hooks never sleep.

Units: bandwidth in Gbit/s, latency in microseconds, sizes in bytes (MiB when
shown), bus bandwidth in GB/s.

Leaves out: tree algorithms, NCCL protocols (LL/LL128/Simple), congestion,
several links per rank, contention between ranks sharing a switch.
References: Thakur, Rabenseifner, Gropp, "Optimization of collective
communication operations in MPICH" (2005); nccl-tests' bus bandwidth notes.
"""
from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass

# Nominal figures; real links deliver less (protocol overhead, NIC, PCIe).
PRESETS = {
    "1gbe": {"bandwidth_gbps": 1.0, "latency_us": 50.0, "label": "1 Gb Ethernet"},
    "10gbe": {"bandwidth_gbps": 10.0, "latency_us": 20.0, "label": "10 Gb Ethernet"},
    "100gb-ib": {"bandwidth_gbps": 100.0, "latency_us": 2.0, "label": "100 Gb InfiniBand"},
    "nvlink": {"bandwidth_gbps": 2400.0, "latency_us": 1.0, "label": "NVLink (300 GB/s per direction)"},
}


# How many times each collective goes round a ring of p ranks (p-1 steps each, every rank
# sending 1/p of the full size per step), by the names the observing process group
# (ddplab.pg.group) and ddplab.measure.fits give them.
RING_PASSES = {
    "all_reduce": 2,  # a reduce-scatter, then an all-gather
    "reduce_scatter": 1, "reduce_scatter_tensor": 1,
    "all_gather": 1, "all_gather_into_tensor": 1,
    "broadcast": 1,  # a chain pipelined in pieces: the ring's (p-1)/p N per rank on average
}


def ring_passes(op: str) -> int:
    """2 for an all-reduce, 1 for an all-gather, a reduce-scatter or a broadcast."""
    if op not in RING_PASSES:
        raise ValueError(f"no ring cost for a {op!r}; the link models {', '.join(RING_PASSES)}")
    return RING_PASSES[op]


@dataclass(frozen=True)
class LinkModel:
    bandwidth_gbps: float
    latency_us: float
    label: str = "custom link"

    def __post_init__(self):
        for name in ("bandwidth_gbps", "latency_us"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.bandwidth_gbps <= 0:
            raise ValueError(f"bandwidth_gbps must be > 0 (Gbit/s), got {self.bandwidth_gbps}")
        if self.latency_us < 0:
            raise ValueError(f"latency_us must be >= 0 (microseconds), got {self.latency_us}")

    @classmethod
    def preset(cls, name: str) -> "LinkModel":
        key = name.lower().replace("_", "-")
        if key not in PRESETS:
            raise ValueError(f"unknown link preset {name!r}; choose one of {', '.join(PRESETS)}, or give "
                             "a LinkModel(bandwidth_gbps=..., latency_us=...) (on the command line: "
                             "--bandwidth-gbps and --latency-us), or the path of a link file ending in .json")
        p = PRESETS[key]
        return cls(p["bandwidth_gbps"], p["latency_us"], p["label"])

    @classmethod
    def parse(cls, link) -> "LinkModel | None":
        """None, a preset name ("10gbe"), a LinkModel, or its ``describe()`` dict."""
        if link is None or isinstance(link, LinkModel):
            return link
        if isinstance(link, str):
            return cls.preset(link)
        if isinstance(link, dict):
            missing = [k for k in ("bandwidth_gbps", "latency_us") if k not in link]
            if missing:
                raise ValueError(f"a link given as a dict needs bandwidth_gbps (Gbit/s) and latency_us "
                                 f"(microseconds); this one lacks {', '.join(missing)}: {link!r}")
            return cls(link["bandwidth_gbps"], link["latency_us"], link.get("label", "custom link"))
        raise ValueError(f"link must be a preset name ({', '.join(PRESETS)}), a LinkModel or None, "
                         f"got {link!r}")

    def allreduce_seconds(self, nbytes: int, world_size: int) -> float:
        """Ring all-reduce time for ``nbytes`` over ``world_size`` ranks."""
        return self.collective_seconds("all_reduce", nbytes, world_size)

    def collective_seconds(self, op: str, nbytes: int, world_size: int) -> float:
        """Ring time of one ``op`` (a name in ``RING_PASSES``) of ``nbytes``, the FULL size
        (an all-gather's gathered output, a reduce-scatter's input), over ``world_size`` ranks:
        ``ring_passes(op)`` times (p-1) * alpha + (p-1)/p * nbytes / bandwidth."""
        passes, p = ring_passes(op), world_size
        if p <= 1:
            return 0.0
        alpha = self.latency_us * 1e-6
        bytes_per_s = self.bandwidth_gbps * 1e9 / 8
        return passes * ((p - 1) * alpha + (p - 1) / p * nbytes / bytes_per_s)

    def describe(self) -> dict:
        return dict(asdict(self), simulated=True)


class LinkQueue:
    """One rank's link: transfers queue behind each other in launch order."""

    def __init__(self, model: LinkModel, world_size: int):
        self.model = model
        self.world_size = world_size
        self.free_at = 0.0
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self.free_at = 0.0

    def schedule(self, launch: float, nbytes: int, op: str = "all_reduce") -> tuple[float, float]:
        """(simulated start, simulated end) for an ``op`` of ``nbytes`` (its full size)
        launched at ``launch``."""
        with self._lock:
            start = max(launch, self.free_at)
            end = start + self.model.collective_seconds(op, nbytes, self.world_size)
            self.free_at = end
            return start, end
