"""What ddplab.record costs a training step: the built-in transformer at 2 gloo ranks.

Three torch DDP instances of the same model live in one run on the same ranks: A and A2 are
never recorded, B is recorded for every timed step. They take turns, one step each, in rounds:
every round runs A, B and A2 once, in an order that cycles through all six orders of the three
(so no instance always runs first, or after the same one). A round gives two paired ratios, each
from steps that ran seconds apart under the same load: B/A (what recording costs) and A2/A
(the A/A: what two unrecorded instances differ by, the noise and any instance effect). Per step
the slower rank's time counts (the ranks wait for each other at the next barrier anyway).

Printed: the median of each ratio over the rounds and a 95 % confidence interval for that
median, distribution-free (order statistics of the per-round ratios: the interval between the
k-th smallest and k-th largest, k from the binomial(n, 1/2) distribution). The verdict on the
target (recorded/unrecorded <= 1.02) is "met" when B/A's upper bound is at most 1.02, "missed"
when its lower bound is above it, and "undecided" otherwise (run it longer, or quieter). The
A/A interval should hold 1.00; when it does not, the instances differ by themselves and B/A
must be read against A2/A, not against 1.

Before the timed rounds, ``--warmup`` untimed rounds (torch's one-bucket step and the rebuild,
the allocator, the caches). After them, B's recording finishes in one more untimed round (the
hooks taken out, the reducer built again) and the gathering runs on the recorder's thread; that
finishing step and the one after it are printed over the median A step, not counted.

    python benchmarks/record_overhead.py                 # ~3 min on an idle 2-core machine
    python benchmarks/record_overhead.py --rounds 100    # a quick look (~1 min)

Run it on a quiet machine (load average well under the core count): each rank is one process
with one compute thread, and the printed load says what the machine was doing.
"""
import argparse
import math
import os
import statistics
import time

ORDERS = ("ABC", "BCA", "CAB", "ACB", "CBA", "BAC")  # every order of A, B, A2 (C), in turn


def job(rounds, warmup, batch_size):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddplab
    from ddplab.measure import models

    rank = dist.get_rank()
    ddps = {n: DDP(models.build("transformer", seed=0)) for n in "ABC"}
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.01) for n, m in ddps.items()}
    # B's steps are its optimizer steps: warm-up, then the timed ones, all recorded; it finishes
    # at the end of the step after the last timed one (untimed), and gathers on its thread
    rec = ddplab.record(ddps["B"], steps=range(0, warmup + rounds + 1))
    times = {n: [] for n in "ABC"}
    for r in range(warmup + rounds + 2):
        if r == warmup:
            began = time.perf_counter()
        elif r == warmup + 6 and rank == 0:  # one cycle of the six orders: how long it will take
            each = (time.perf_counter() - began) / 6
            print(f"rank 0: {1e3 * each:.0f} ms a round; the {rounds} timed rounds take about "
                  f"{each * rounds:.0f} s", flush=True)
        ids, targets = models.batch("transformer", batch_size, rank, r)
        for n in ORDERS[r % len(ORDERS)]:
            dist.barrier()
            t0 = time.perf_counter()
            logits = ddps[n](ids)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
            opts[n].step()
            opts[n].zero_grad()
            times[n].append(time.perf_counter() - t0)
    rec.wait()
    assert rec.finished
    mine = torch.tensor([times[n] for n in "ABC"], dtype=torch.float64)
    slowest = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(slowest, mine)
    worst = torch.stack(slowest).amax(0).tolist()  # per step, the slower rank
    return {n: worst[i] for i, n in enumerate("ABC")}


def median_interval(values, confidence=0.95):
    """(median, low, high): a distribution-free interval for the median from order statistics."""
    x, n = sorted(values), len(values)
    # the largest k with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2
    tail, k, cum = (1 - confidence) / 2, 0, 0.0
    while True:
        cum += math.comb(n, k) / 2 ** n
        if cum > tail:
            break
        k += 1
    k = max(k, 1)
    return statistics.median(x), x[k - 1], x[n - k]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300, help="timed rounds (each: A, B, A2 once)")
    parser.add_argument("--warmup", type=int, default=12, help="untimed rounds first")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--target", type=float, default=1.02)
    args = parser.parse_args()
    import ddplab

    start = time.monotonic()
    print(f"load average before: {' / '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} cores)", flush=True)
    with ddplab.Cluster(2) as cluster:
        t = cluster.run(job, args.rounds, args.warmup, args.batch_size)[0]
    w, n = args.warmup, args.rounds
    a, b, c = (t[k][w:w + n] for k in "ABC")
    print(f"{n} timed rounds after {w} warm-up; median step: A {1e3 * statistics.median(a):.1f} ms, "
          f"B (recorded) {1e3 * statistics.median(b):.1f} ms, A2 {1e3 * statistics.median(c):.1f} ms")
    verdict = None
    for name, x in (("B/A  (recorded / unrecorded)", b), ("A2/A (A/A: the noise)", c)):
        med, lo, hi = median_interval([p / q for p, q in zip(x, a)])
        print(f"{name}: median {med:.4f}, 95% interval {lo:.4f}-{hi:.4f}")
        if verdict is None:
            verdict = ("met" if hi <= args.target else "missed" if lo > args.target else
                       "undecided: the interval straddles it (run longer, or on a quieter machine)")
    print(f"target B/A <= {args.target}: {verdict}")
    a_med = statistics.median(a)
    print(f"B's finishing step (untimed) {t['B'][w + n] / a_med:.2f} x the median A step; "
          f"the step after it (gathering on the recorder's thread) {t['B'][w + n + 1] / a_med:.2f} x")
    print(f"load average after: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{time.monotonic() - start:.0f} s in all")


if __name__ == "__main__":
    main()
