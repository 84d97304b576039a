"""What ddplab.record costs a training step: the built-in transformer at 2 gloo ranks.

Two torch DDP instances of the same model live in one run and take turns, one step each
(the order flips every step), so that the machine's load hits both alike. In an A/R round
the second one is recorded for every timed step; in an A/A round neither is, and its ratio
is the noise; in an A/F round the second one was recorded for its first (untimed) step only and
finished: what stays after finish() (a fresh reducer with no hook: torch's own all-reduce); in
an A/W round B is recorded as in A/R, but its last timed step calls rec.finish(), which waits for
the gathering inside the step, as every finishing step did before the gathering moved to a thread
of its own (the "before" beside A/R's "after"). Rounds of the kinds alternate on the same ranks;
the figure is the median over rounds of median(B step) / median(A step), beside the A/A rounds'
median, and for A/R and A/W the finishing step (B's last timed one) and the step after it, each
over the median A step.

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
    rec = None
    if kind == "A/R":
        rec = ddplab.record(ddps["B"], steps=range(0, steps + 1))  # finishes in B's last timed step
    elif kind == "A/W":
        rec = ddplab.record(ddps["B"], steps=range(0, steps + 2))  # finish() called in that step
    elif kind == "A/F":
        ddplab.record(ddps["B"], steps=range(0, 1))  # finished after step 0's optimizer step
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.01) for n, m in ddps.items()}
    times = {n: [] for n in ddps}
    for step in range(steps + 2):  # the last one: the step after the finishing one (not in the medians)
        ids, targets = models.batch("transformer", batch_size, rank, step)
        for n in (("A", "B") if step % 2 else ("B", "A")):
            dist.barrier()
            t0 = time.perf_counter()
            logits = ddps[n](ids)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
            opts[n].step()
            if kind == "A/W" and n == "B" and step == steps:
                rec.finish()  # the gathering inside the step, as before it had a thread
            opts[n].zero_grad()
            if step > 0:  # step 0 is torch's one-bucket iteration and the rebuild
                times[n].append(time.perf_counter() - t0)
    if rec is not None:
        rec.wait()
    # B's last timed step finishes an A/R or A/W recording; the step after it runs while an
    # A/R recording gathers on its thread
    return {**{n: statistics.median(v[:-1]) for n, v in times.items()},
            "B_last": times["B"][-2], "B_next": times["B"][-1]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each kind")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    import ddplab

    print(f"load average before: {os.getloadavg()}")
    ratios = {"A/R": [], "A/A": [], "A/F": [], "A/W": []}
    ends = {"A/R": [], "A/W": []}  # (finishing step, the step after) / median A step
    with ddplab.Cluster(2) as cluster:
        for r in range(args.rounds):
            for kind in ratios:
                med = cluster.run(job, kind, args.steps, args.batch_size)[0]
                ratios[kind].append(med["B"] / med["A"])
                if kind in ends:
                    ends[kind].append((med["B_last"] / med["A"], med["B_next"] / med["A"]))
                print(f"round {r} {kind}: A {med['A']*1e3:.1f} ms, B {med['B']*1e3:.1f} ms, "
                      f"B/A {ratios[kind][-1]:.3f}, B's last timed step {med['B_last']*1e3:.1f} ms, "
                      f"the step after {med['B_next']*1e3:.1f} ms", flush=True)
    for kind, values in ratios.items():
        print(f"{kind}: median B/A {statistics.median(values):.3f} (range {min(values):.3f}-{max(values):.3f})")
    for kind, values in ends.items():
        last, after = zip(*values)
        print(f"{kind}: finishing step / median A step: median {statistics.median(last):.2f} (range "
              f"{min(last):.2f}-{max(last):.2f}); the step after: median {statistics.median(after):.2f} "
              f"(range {min(after):.2f}-{max(after):.2f})")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
