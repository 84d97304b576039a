"""Memory per rank against the number of ranks N: ZeRO's formula, fits' prediction, measured.

Teaches: what each way to train keeps per rank as ranks are added. The ZeRO
paper (Rajbhandari et al. 2020, sections 5.1 to 5.3 and figure 1) counts, for Psi
parameters trained with Adam in mixed precision, 2 Psi bytes of parameters,
2 Psi of gradients and K Psi of optimizer state (K = 12: a float32 master
copy, the momentum and the variance), and divides by N what each stage
shards:

    DDP (baseline)    (2 + 2 + K) Psi
    ZeRO-1 (P_os)     2 Psi + 2 Psi + K Psi / N
    ZeRO-2 (P_os+g)   2 Psi + (2 + K) Psi / N
    ZeRO-3 (P_os+g+p) (2 + 2 + K) Psi / N         (FSDP)

Here everything is float32: parameters and gradients 4 bytes each, and K is
what the row's optimizer keeps per parameter: Adam's two moments, 8, where the
parameters are their own masters (``ddp``, ``zero1``, ``fsdp``); 12 for
ddplab's ``zero2``, whose float32 copy of its slice plays the paper's master
copy. ``formula`` is that count; ``predicted`` is ``ddplab.measure.fits``'s
figure from the model's real parameter sizes (parameters + gradients +
optimizer state of the rank holding the most); ``measured`` reads them on
ranks (``ddplab.measure.memory``).

The two differ where the formula's 1/N meets whole tensors. ``zero1``
(ddplab's ``ShardedOptimizer``, as torch's ``ZeroRedundancyOptimizer``) deals
whole parameters to ranks, so its largest share, and with it the largest
rank's memory, falls in steps: with four equal weights it is the same at 2
and 3 ranks, and stops falling at 4. ``zero2`` here cuts one flat vector of
the parameters into even slices and ``fsdp`` every weight into even pieces,
so they follow 1/N, up to a few padding elements. Adam's step count (4 bytes
per parameter tensor it steps) is in the prediction, not in the formula.

Leaves out: the peak (activations and temporaries come on top, and do not
fall with N: ``fits.predict_memory``'s ``peak``), mixed precision.
References: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models" (SC 2020), sections 3 and 5.1 to 5.3, figure 1.
"""
from __future__ import annotations

ROWS = ("ddp", "zero1", "zero2", "fsdp")
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}
STATE_BYTES = {"ddp": 8, "zero1": 8, "zero2": 12, "fsdp": 8}  # K: Adam's moments (+ zero2's copy)
HELD = ("params", "grads", "optimizer_state")


def formula(psi: int, n: int, row: str) -> float:
    """ZeRO's count of bytes per rank for ``row`` at ``n`` ranks, float32 (4 + 4 + K)."""
    a, g, k = 4, 4, STATE_BYTES[row]
    return {0: (a + g + k) * psi, 1: (a + g) * psi + k * psi / n,
            2: a * psi + (g + k) * psi / n, 3: (a + g + k) * psi / n}[STAGE[row]]


def predicted(model, world_sizes=range(1, 9), rows=ROWS) -> dict:
    """``{row: [bytes]}``: fits' parameters + gradients + Adam state of the rank holding the
    most, at each world size (from the sizes alone: no forward)."""
    from ddplab.measure.fits import predict_memory

    def largest(row, n):
        return max(sum(predict_memory(model, n, None, row, rank=r)[f] for f in HELD)
                   for r in range(n))
    return {row: [largest(row, n) for n in world_sizes] for row in rows}


def measured(cluster, world_sizes=(1, 2, 3, 4), rows=ROWS, **kwargs) -> list:
    """Measure every row at each world size on one set of ranks (``memory.measure_sizes``):
    ``cluster``'s, where it has as many ranks as the largest size, else a Cluster of that
    size started for it. One dict per (row, size, rank)."""
    from ddplab.measure import memory

    rows, world_sizes = memory.checked(rows, world_sizes)
    if cluster is not None and cluster.world_size >= max(world_sizes):
        return memory.measure_sizes(cluster, rows, world_sizes, **kwargs)
    return memory.measure(rows, world_sizes, **kwargs)


def largest_held(results) -> dict:
    """``{(row, world size): bytes}``: parameters + gradients + optimizer state of the rank
    that holds the most, from ``measured``'s dicts."""
    out = {}
    for r in results:
        key = (r["row"], r["world_size"])
        out[key] = max(out.get(key, 0), sum(r[f] for f in HELD))
    return out


def curve(model, world_sizes=range(1, 9), rows=ROWS) -> dict:
    """What the figure draws: the world sizes, ``predicted``, and ``formula`` for the model."""
    psi = sum(p.numel() for p in model.parameters())
    ns = list(world_sizes)
    return {"world_sizes": ns, "psi": psi,
            "predicted": predicted(model, ns, rows),
            "formula": {row: [formula(psi, n, row) for n in ns] for row in rows}}


def default_curve(world_sizes=range(1, 9)) -> dict:
    """The curve for ``memory.default_model()``, the model labs 11 and 12 measure."""
    from ddplab.measure.memory import default_model

    return curve(default_model(), world_sizes)
