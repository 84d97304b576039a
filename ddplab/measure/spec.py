"""RunSpec: every setting of one comparison, checked once, in one frozen object.

Teaches: a measurement is only as good as its record of what was measured.
The command line, the control panel, the benchmarks and compare() all build
a ``RunSpec``; the ranks receive the same object; the JSON carries
``spec.to_dict()`` as its "config". Validation happens here, once, with
errors that say what to do, so a bad value never reaches the ranks.

Strategy names are checked against ``ddplab.sync.registry`` in the process that
builds the spec (a notebook's own registrations included). Importing this
module imports no torch.

``model`` is a built-in name or the user's own ``model()`` function, with
``batch`` and ``loss`` beside it (see ``ddplab.measure.workload``, which checks
them in this process, on the CPU or the meta device, before any rank starts).

Leaves out: settings of individual strategies beyond the bucket cap (build
your own entry in the registry for those).
"""
from __future__ import annotations

import dataclasses
import math

from ddplab.netsim.link import LinkModel
from ddplab.sync.registry import get_strategy

MODELS = ("mlp", "convnet", "transformer")


def parse_straggler(straggler):
    """None, (rank, factor) or "RANK:FACTOR" -> None or (int rank, float factor >= 1)."""
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


def _int_at_least(name, value, low, what=""):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}{what}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    strategies: tuple = ("none", "manual", "bucketed", "ddp")
    steps: int = 10  # measured steps after warm-up
    warmup: int = 3
    model: str = "mlp"
    n_params: float = 2e6
    depth: int = 4
    batch_size: int = 32
    # 2, not torch's 25: the default model's ~8 MB of gradients would sit in ONE
    # bucket at 25 MB, launched after backward, and nothing would overlap.
    bucket_cap_mb: float = 2.0
    link: LinkModel | None = None
    straggler: tuple | None = None
    world_size: int = 2
    lr: float = 0.01
    seed: int = 0
    record: bool = True
    progress: bool = False
    batch: object = None  # batch(batch_size, rank, step) -> (inputs, target); None: built-in
    loss: object = None  # loss(output, target) -> scalar tensor; None: cross-entropy

    def __post_init__(self):
        names = self.strategies
        if isinstance(names, str):
            names = [s.strip() for s in names.split(",") if s.strip()]
        # get_strategy raises for an unknown name, naming the choices
        names = tuple(dict.fromkeys(get_strategy(s).name for s in names))
        if not names:
            raise ValueError("no strategy given: name at least one, comma-separated")
        set_ = object.__setattr__  # frozen: normalized values are written once, here
        set_(self, "strategies", names)
        _int_at_least("steps", self.steps, 1, " (measured steps after warm-up)")
        _int_at_least("warmup", self.warmup, 0)
        _int_at_least("depth", self.depth, 2)
        _int_at_least("batch_size", self.batch_size, 1)
        _int_at_least("world_size", self.world_size, 1)
        if isinstance(self.model, str) and self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}: use {', '.join(MODELS)}, "
                             "or your own function model=make_model")
        if not (isinstance(self.n_params, (int, float)) and self.n_params > 0):
            raise ValueError(f"n_params must be > 0, got {self.n_params!r}")
        cap = self.bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MB (2**20 bytes), got {cap!r}")
        set_(self, "bucket_cap_mb", float(cap))
        set_(self, "link", LinkModel.parse(self.link))
        set_(self, "straggler", parse_straggler(self.straggler))
        if self.straggler and not 0 <= self.straggler[0] < self.world_size:
            raise ValueError(f"straggler rank {self.straggler[0]} is not a rank of this "
                             f"{self.world_size}-rank run")
        if not isinstance(self.model, str) or self.batch is not None or self.loss is not None:
            from ddplab.measure.workload import check  # imports torch: only for user code

            check(self.model, self.batch, self.loss, self.batch_size, self.seed,
                  tuple(self.model_kwargs.items()))
        # torch DDP's iterations 0 (one bucket) and 1 (the rebuild) are never measured
        if any(get_strategy(s).time_unrecorded for s in names) and self.warmup < 2:
            set_(self, "warmup", 2)

    def replace(self, **changes) -> "RunSpec":
        return dataclasses.replace(self, **changes)

    @property
    def model_kwargs(self) -> dict:
        if self.model == "mlp":
            return {"n_params": self.n_params, "depth": self.depth}
        return {"n_layer": self.depth} if self.model == "transformer" else {}

    def to_dict(self) -> dict:
        """JSON-ready settings (the "config" of compare's JSON)."""
        d = dataclasses.asdict(self)
        d["strategies"] = list(self.strategies)
        d["link"] = None if self.link is None else self.link.describe()
        d["straggler"] = None if self.straggler is None else list(self.straggler)
        d.pop("progress")
        from ddplab.measure.workload import describe

        for k in ("model", "batch", "loss"):
            d[k] = describe(getattr(self, k))
        return d
