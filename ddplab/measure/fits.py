"""Which fits, and what does it cost? Memory per rank and bytes per step, predicted.

Teaches: before starting ranks, the sizes of a model say what each rank will
hold under each way to train, and the alpha-beta model of a link says what
the step's communication costs. For a model, a world size p and a link:

- ``ddp``: every rank holds the parameters P, the gradients P, the optimizer
  state S (Adam: 2P and a 4-byte step per parameter) and DDP's buckets (a
  flat copy of the gradients, P). It all-reduces P per step.
- ``zero1``: as ddp, but the state of its share only (whole parameters dealt
  largest first to the rank with the least, torch's rule). It all-reduces P
  and broadcasts P (every rank passes the whole tensor to the broadcast).
- ``zero2`` (asked for by name): the parameters P; of the gradients and the
  state only an even slice, 1/p of the flattened model (ceil), with its
  float32 copy (counted as state: the paper's K counts the masters). It
  reduce-scatters the gradients and all-gathers the slices: DDP's ring bytes.
- ``fsdp``: the rank's shard of each sharded weight (ceil(numel/p) elements,
  padded), of its gradient and of its state; replicated parameters whole. The
  units are ddplab.FSDP's (``unit_owners``: an ``nn.MultiheadAttention`` is one
  with its ``out_proj``). Per unit it all-gathers its shards twice (forward and
  backward) and reduce-scatters the whole (padded) gradient; the replicated
  gradients are all-reduced, after a flag per replicated parameter.
- peak during the step: what is held, plus the activations the forward saves
  (sized by one forward on this process, no ranks), plus the largest
  temporary: the optimizer's (Adam makes one tensor the size of a parameter)
  and, under FSDP, a layer gathered whole with its full gradient, the
  padded copy it reduce-scatters, and the full weights kept from call to call.

Ring bytes per rank, for each call of N bytes (the full size) over p
ranks: an all-reduce sends 2(p-1)/p N (a reduce-scatter, then an
all-gather), an all-gather or a reduce-scatter (p-1)/p N, a broadcast
passed along a ring (every rank but the last forwards N) (p-1)/p N on
average. ``ring_bytes`` sums them; ``sent_by_op`` is what a rank hands the
group (the tensors it passes, as ``memory.measure`` counts them), another
figure.

Communication time (ring, ``ddplab.netsim.link.LinkModel.collective_seconds``,
which a simulated link charges too): an all-reduce of
N bytes 2(p-1) alpha + 2(p-1)/p N / bandwidth; an all-gather, a
reduce-scatter or a broadcast of N bytes half of that, (p-1) alpha +
(p-1)/p N / bandwidth, each call paying its own alpha. For the broadcast that is the ring's average per rank: a chain
pipelined in small pieces takes nearer N / bandwidth (plus its latencies), so
its bandwidth term is (p-1)/p of the chain's (half at 2 ranks). Every collective is waited
for (no overlap with compute), and DDP's buckets are cut at the cap in bytes,
not by torch's rebuild rule (ddplab.measure.whatif has that).

Leaves out: the allocator (its caching and rounding, on GPU), the Python
heap, gloo's and NCCL's own buffers, buffers (BatchNorm statistics),
temporaries smaller than the largest one, mixed precision. Checked against
``ddplab.measure.memory.measure`` within 10 % (tests/measure/test_fits.py).

References: Rajbhandari et al., "ZeRO" (SC 2020), section 3 (2 + 2 + K bytes
per parameter, mixed precision; here float32: 4 + 4 + 8); Zhao et al.,
"PyTorch FSDP" (VLDB 2023); ddplab.netsim.costmodel for alpha and bandwidth.
"""
from __future__ import annotations

import torch
from torch import nn

from ddplab.netsim.link import LinkModel, ring_passes
from ddplab.sync.core.fsdp import DEFAULT_SHARD, unit_owners

ROWS = ("ddp", "zero1", "fsdp")
KNOWN = (*ROWS, "zero2")  # zero2: ddplab.sync.core.zero2, the paper's stage 2 (asked for by name)
STATE_TENSORS = {torch.optim.Adam: 2, torch.optim.AdamW: 2, torch.optim.SGD: 0}


def _state(numels, optimizer_cls, momentum=False) -> int:
    """Bytes of optimizer state for float32 parameters of these sizes."""
    if optimizer_cls not in STATE_TENSORS:
        raise ValueError(f"fits knows Adam, AdamW and SGD, not {optimizer_cls.__name__}: "
                         "measure it instead (ddplab.measure.memory.measure_rank)")
    per = STATE_TENSORS[optimizer_cls] + (optimizer_cls is torch.optim.SGD and momentum)
    step = 4 * len(numels) if per == 2 else 0  # Adam's step count: a float32 scalar each
    return sum(4 * n * per for n in numels) + step


def _share(numels, world_size, rank) -> list:
    """torch's ZeroRedundancyOptimizer deal: largest first, to the rank with the least."""
    loads, mine = [0] * world_size, [[] for _ in range(world_size)]
    for n in sorted(numels, reverse=True):
        r = loads.index(min(loads))
        loads[r] += n
        mine[r].append(n)
    return mine[rank]


def units(model: nn.Module, shard=DEFAULT_SHARD) -> tuple:
    """The sizes of each FSDP unit's parameters, one list per unit (ddplab.FSDP's units:
    ``unit_owners``, so an ``nn.MultiheadAttention`` is one unit with its ``out_proj``), and
    of the parameters outside every unit (replicated)."""
    owners, by_unit, seen = unit_owners(model, shard), {}, set()
    for name, m in model.named_modules():
        for q in m.parameters(recurse=False):
            if id(q) not in seen:  # a weight tied within a unit counts once
                seen.add(id(q))
                unit = owners[name]
                by_unit.setdefault(None if unit is None else id(unit), []).append(q.numel())
    replicated = by_unit.pop(None, [])
    return list(by_unit.values()), replicated


def activation_bytes(model: nn.Module, example) -> int:
    """Bytes of the outputs of the model's leaf modules in one forward (what autograd saves,
    about), and of the input: one forward on this process, no ranks."""
    total = [example.numel() * example.element_size()]
    hooks = [m.register_forward_hook(
        lambda m, a, out: total.append(out.numel() * out.element_size()
                                       if torch.is_tensor(out) else 0))
        for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            model(example)
    finally:
        for h in hooks:
            h.remove()
    return sum(total)


def predict_memory(model: nn.Module, world_size: int, example, row: str,
                   optimizer_cls=torch.optim.Adam, shard=DEFAULT_SHARD,
                   rank: int = 0) -> dict:
    """Bytes one rank holds under ``row``: params, grads, optimizer_state, peak (``example=None``:
    no peak, and no forward to size the activations)."""
    if row not in KNOWN:
        raise ValueError(f"row must be one of {', '.join(KNOWN)}, not {row!r}")
    p, params = world_size, list(model.parameters())
    numels = [t.numel() for t in params]
    full = 4 * sum(numels)
    acts = 0 if example is None else activation_bytes(model, example)
    largest = 4 * max(numels)
    if row in ("ddp", "zero1"):
        share = numels if row == "ddp" else _share(numels, p, rank)
        state = _state(share, optimizer_cls)
        held = {"params": full, "grads": full, "optimizer_state": state}
        extra = full + largest  # DDP's buckets, the optimizer's temporary
    elif row == "zero2":  # an even slice of n elements: its gradient, state and float32 copy
        n = -(-sum(numels) // p)
        held = {"params": full, "grads": 4 * n,
                "optimizer_state": _state([n], optimizer_cls) + 4 * n}
        # backward's whole gradients with the activations, or in the step the whole gradients,
        # their flat padded copy and the gathered parameters
        extra = max(acts + full, 2 * full + 4 * n * p) - acts - 4 * n
    else:
        unit_sizes, replicated = units(model, shard)
        sharded = [-(-n // p) for unit in unit_sizes for n in unit]
        mine = 4 * (sum(sharded) + sum(replicated))
        held = {"params": mine, "grads": mine,
                "optimizer_state": _state(sharded + replicated, optimizer_cls)}
        layer = max((4 * sum(unit) for unit in unit_sizes), default=0)
        # a layer gathered whole, its full gradient and the padded copy it reduce-scatters, and
        # the layer's full weights FSDP keeps from call to call (their storage refilled at each
        # gather, so that a graph that saved them finds them again): four layers at the worst
        # moment, as measured at 1 to 4 ranks (tests/measure/test_fits_more.py)
        extra = max(4 * layer, 4 * max(sharded + replicated))
    if example is not None:
        held["peak"] = sum(held.values()) + acts + extra
    return held


def predict_bytes(model: nn.Module, world_size: int, row: str, shard=DEFAULT_SHARD) -> dict:
    """Bytes one rank hands the group per step, by collective (as memory.measure counts)."""
    p, full = world_size, 4 * sum(t.numel() for t in model.parameters())
    if row == "ddp":
        return {"all_reduce": full}  # DDP all-reduces on one rank too
    if row == "zero1":
        return {"all_reduce": full, "broadcast": full}
    if row == "zero2":  # the whole padded gradient in, this rank's slice out to the gather
        n = -(-full // 4 // p)
        return {"reduce_scatter_tensor": 4 * n * p, "all_gather_into_tensor": 4 * n}
    unit_sizes, replicated = units(model, shard)
    sharded = [n for unit in unit_sizes for n in unit]
    out = {"all_gather_into_tensor": 2 * 4 * sum(-(-n // p) for n in sharded),
           "reduce_scatter_tensor": 4 * sum(-(-n // p) * p for n in sharded)}
    # the replicated gradients, after a flag per replicated parameter: which ones any rank has
    rest = full - 4 * sum(sharded) + 4 * len(replicated)
    return {**out, "all_reduce": rest} if replicated else out


def predict_calls(model: nn.Module, world_size: int, row: str,
                  shard=DEFAULT_SHARD, bucket_cap_mb: float = 25) -> list:
    """The step's collectives as (op, full bytes): DDP's buckets (gradients in order, cut at
    the cap), ShardedOptimizer's broadcast per parameter, FSDP's two all-gathers and one
    reduce-scatter per layer, an all-reduce of one flag per replicated parameter (which ones a
    rank has a gradient for) and an all-reduce per replicated parameter."""
    p, params = world_size, list(model.parameters())
    if row in ("ddp", "zero1"):
        full, cap = 4 * sum(t.numel() for t in params), bucket_cap_mb * 2 ** 20
        n = max(1, -(-full // int(cap)))
        calls = [("all_reduce", full / n)] * n
        return calls + ([("broadcast", 4 * t.numel()) for t in params] if row == "zero1" else [])
    if row == "zero2":
        padded = 4 * -(-sum(t.numel() for t in params) // p) * p
        return [("reduce_scatter", padded), ("all_gather", padded)]
    calls, (unit_sizes, replicated) = [], units(model, shard)
    for unit in unit_sizes:
        padded = 4 * sum(-(-n // p) * p for n in unit)
        calls += [("all_gather", padded)] * 2 + [("reduce_scatter", padded)]
    flags = [("all_reduce", 4 * len(replicated))] if replicated else []  # which have gradients
    return calls + flags + [("all_reduce", 4 * n) for n in replicated]


def ring_bytes(calls, world_size: int) -> float:
    """What one rank sends in a ring for these (op, full bytes) calls: an all-reduce
    2(p-1)/p N, an all-gather, a reduce-scatter or a broadcast (p-1)/p N
    (``ddplab.netsim.link.ring_passes``)."""
    p = world_size
    return sum(ring_passes(op) * (p - 1) / p * n for op, n in calls)


def comm_seconds(calls, world_size: int, link: LinkModel) -> float:
    """The alpha-beta time of the step's collectives on ``link`` (ring, nothing overlapped):
    an all-gather, a reduce-scatter or a broadcast is half an all-reduce of the full size.
    Each call is timed by ``link.collective_seconds``, the rule a simulated link
    (ddplab.netsim.simulated) charges the same calls."""
    return sum(link.collective_seconds(op, n, world_size) for op, n in calls)


def which_fits(model: nn.Module, world_size: int, example, link="10gbe",
               budget_bytes: int | None = None, optimizer_cls=torch.optim.Adam) -> list:
    """One dict per row: predicted memory of the rank holding the most, bytes per step,
    communication seconds on ``link``, and ``fits`` (peak <= budget; None without one)."""
    link = LinkModel.parse(link)
    out = []
    for row in ROWS:
        mem = max((predict_memory(model, world_size, example, row, optimizer_cls, rank=r)
                   for r in range(world_size)), key=lambda m: m["peak"])
        sent, calls = predict_bytes(model, world_size, row), predict_calls(model, world_size, row)
        out.append({"row": row, "world_size": world_size, **mem, "sent_by_op": sent,
                    "ring_bytes": ring_bytes(calls, world_size),
                    "comm_s": comm_seconds(calls, world_size, link),
                    "link": link.label,
                    "fits": None if budget_bytes is None else mem["peak"] <= budget_bytes})
    return out


def fits_table(answers) -> str:
    """The answers as text, in MiB and milliseconds; ``ring MiB``: what one rank sends per
    step in a ring (``ring_bytes``)."""
    mb = 2 ** 20
    lines = [(f"{'row':<7}{'ranks':>6}{'params':>9}{'grads':>9}{'state':>9}{'peak':>9}"
              f"{'ring MiB':>10}{'comm ms':>9}  fits")]
    for a in answers:
        lines.append(f"{a['row']:<7}{a['world_size']:>6}" + "".join(
            f"{a[f] / mb:>9.2f}" for f in ("params", "grads", "optimizer_state", "peak"))
            + f"{a['ring_bytes'] / mb:>10.2f}{a['comm_s'] * 1e3:>9.2f}  "
            + {None: "-", True: "yes", False: "NO"}[a["fits"]])
    return "\n".join(lines)
