"""What ddplab.record costs a training step: the built-in transformer at 2 gloo ranks.

Two torch DDP instances of the same model live in one run and take turns, one step each
(the order flips every step), so that the machine's load hits both alike. In an A/R round
the second one is recorded for every timed step; in an A/A round neither is, and its ratio
is the noise; in an A/F round the second one was recorded for its first (untimed) step only and
finished: what stays after finish() (the recorder's comm hook, forwarding; torch cannot remove
it). Rounds of the kinds alternate on the same ranks; the figure is the median over rounds of
median(B step) / median(A step), beside the A/A rounds' median.

    python benchmarks/record_overhead.py [--rounds 5] [--steps 40]

The recorder adds a Python comm hook per bucket (torch's own all-reduce is C++ without a hook),
a post-accumulate-grad hook per parameter and two forward hooks.
"""
import argparse
import os
import statistics
import time


def job(kind, steps, batch_size):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddplab
    from ddplab.measure import models

    rank = dist.get_rank()
    ddps = {n: DDP(models.build("transformer", seed=0)) for n in ("A", "B")}
    if kind == "A/R":
        ddplab.record(ddps["B"], steps=range(0, steps + 1))
    elif kind == "A/F":
        ddplab.record(ddps["B"], steps=range(0, 1))  # finished after step 0's optimizer step
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.01) for n, m in ddps.items()}
    times = {n: [] for n in ddps}
    for step in range(steps + 1):
        ids, targets = models.batch("transformer", batch_size, rank, step)
        for n in (("A", "B") if step % 2 else ("B", "A")):
            dist.barrier()
            t0 = time.perf_counter()
            logits = ddps[n](ids)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
            opts[n].step()
            opts[n].zero_grad()
            if step > 0:  # step 0 is torch's one-bucket iteration and the rebuild
                times[n].append(time.perf_counter() - t0)
    # the last B step is the one whose optimizer step finishes an A/R recording (the gather
    # runs in it; the files are written on a thread after it)
    return {**{n: statistics.median(v) for n, v in times.items()}, "B_last": times["B"][-1]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each kind")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    import ddplab

    print(f"load average before: {os.getloadavg()}")
    ratios = {"A/R": [], "A/A": [], "A/F": []}
    with ddplab.Cluster(2) as cluster:
        for r in range(args.rounds):
            for kind in ratios:
                med = cluster.run(job, kind, args.steps, args.batch_size)[0]
                ratios[kind].append(med["B"] / med["A"])
                print(f"round {r} {kind}: A {med['A']*1e3:.1f} ms, B {med['B']*1e3:.1f} ms, "
                      f"B/A {ratios[kind][-1]:.3f}, B's last step {med['B_last']*1e3:.1f} ms", flush=True)
    rec, aa = statistics.median(ratios["A/R"]), statistics.median(ratios["A/A"])
    print(f"recorded/unrecorded: median {rec:.3f} (range {min(ratios['A/R']):.3f}-"
          f"{max(ratios['A/R']):.3f}); A/A noise: median {aa:.3f} (range "
          f"{min(ratios['A/A']):.3f}-{max(ratios['A/A']):.3f})")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
