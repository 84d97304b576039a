"""A timeline made by hand, with round numbers, for the figures' tests (widgets and the browser)."""
from ddplab.timeline import BucketRecord, IterationRecord, Timeline


def hand_timeline(strategy="bucketed", ranks=2, iterations=3, buckets=2, flags=None, simulated=False,
                  oversubscribed=False, backend="gloo"):
    """Every iteration 100 ms: forward 0-20, backward 20-80, step 90-100 (ms);
    bucket k in flight 50+10k .. 60+10k ms. ``flags`` maps iteration -> set of flags."""
    link = {"bandwidth_gbps": 10.0, "latency_us": 20.0, "label": "10 Gb Ethernet", "simulated": True}
    tl = Timeline(strategy, ranks, backend, meta={"simulated_link": link if simulated else None,
                                                  "oversubscribed": oversubscribed, "usable_cpus": 2})
    for i in range(iterations):
        t0 = 0.1 * i
        for r in range(ranks):
            it = IterationRecord(r, i, start=t0, end=t0 + 0.1, phases={
                "forward": (t0, t0 + 0.02), "backward": (t0 + 0.02, t0 + 0.08),
                "step": (t0 + 0.09, t0 + 0.1)}, sources={"forward": "cpu", "backward": "cpu",
                                                         "step": "cpu"})
            it.flags |= (flags or {}).get(i, set())
            tl.iterations.append(it)
            for k in range(buckets):
                tl.buckets.append(BucketRecord(
                    r, i, k, 1000 * (k + 1), (f"layer{k}.weight", f"layer{k}.bias"),
                    grads_ready=t0 + 0.05 + 0.01 * k, launch=t0 + 0.05 + 0.01 * k,
                    comm_end=t0 + 0.06 + 0.01 * k, simulated=simulated,
                    sources={"launch": "cpu", "comm_end": "simulated" if simulated else "cpu"}))
    return tl
