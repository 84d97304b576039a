"""The what-if against measurement: predicted step time from ONE recording, measured at each cap.

    .venv/bin/python benchmarks/whatif.py                       # real gloo and a simulated 10 GbE
    .venv/bin/python benchmarks/whatif.py --links 10gbe --steps 20

For each link (``none``: gloo itself on this machine; a preset: the simulated
link over gloo), one ``compare`` run of ``none,ddp`` at a small cap (0.25 MiB)
is the recording: torch DDP's per-bucket timeline and, beside it, the same
model without communication (the baseline contention is measured against).
Then, for every cap, ``compare`` measures torch DDP at that cap (timed
without recording; ``none,ddp`` again, as the recording ran; the median of
``--runs`` runs) and ``ddplab.measure.whatif.predict`` predicts it from the
recording alone. Printed per row: measured and predicted step time, the
error, and the prediction with contention ignored (``contention=0``).

The recording has no per-parameter times (compare records per bucket), so the
prediction re-buckets whole recorded buckets: caps above the recorded one
only. Under a simulated link the link's cost is the same model on both sides,
so the agreement checks the scheduling (which bucket waits for which), not the
link model. The load (``os.getloadavg``) is printed before and after: other
work on the 2 cores moves every figure. Figures: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddplab.cluster import Cluster  # noqa: E402
from ddplab.measure.compare import compare  # noqa: E402
from ddplab.measure.whatif import predict  # noqa: E402
from ddplab.timeline.metrics import summarize  # noqa: E402

RECORDED_CAP = 0.25


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", default="none,10gbe", help="comma list: none or link presets")
    ap.add_argument("--caps", default="0.25,1,4,64", help="bucket caps in MiB to predict")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--runs", type=int, default=3, help="measured runs per cap (median)")
    args = ap.parse_args(argv)
    caps = [float(c) for c in args.caps.split(",")]
    print(f"load before: {os.getloadavg()}")
    rows = []
    with Cluster(2) as c:
        for name in args.links.split(","):
            link = None if name == "none" else name
            rec = compare(c, "none,ddp", steps=args.steps, bucket_cap_mb=RECORDED_CAP, link=link)
            recording, baseline = rec.timelines["ddp"], rec.timelines["none"]
            for cap in caps:
                # measured as the recording was (none beside ddp), the median of --runs runs
                runs = [compare(c, "none,ddp", steps=args.steps, bucket_cap_mb=cap, link=link)
                        for _ in range(args.runs)]
                got = rec if cap == RECORDED_CAP else runs[0]
                steps = [r.metrics["ddp"]["step_ms"] for r in runs]
                measured, spread = statistics.median(steps), f"{min(steps):.1f}-{max(steps):.1f}"
                pred = predict(recording, bucket_cap_mb=cap, baseline=baseline)
                plain = predict(recording, bucket_cap_mb=cap, contention=0)
                p, q = summarize(pred)["step_ms"], summarize(plain)["step_ms"]
                rows.append((name, cap, got.metrics["ddp"]["n_buckets"], measured, spread, p,
                             100 * (p - measured) / measured, q, pred.meta["whatif"]["contention"]))
                print(f"  {name} cap {cap:g}: measured {measured:.1f} ms, predicted {p:.1f} ms",
                      flush=True)
    print(f"load after: {os.getloadavg()}")
    print("\n| link | cap MiB | buckets (measured) | measured ms | runs' range | predicted ms | "
          "error | predicted, contention ignored | c |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, cap, nb, m, spread, p, err, q, cont in rows:
        print(f"| {name} | {cap:g} | {nb} | {m:.1f} | {spread} | {p:.1f} | {err:+.0f} % | {q:.1f} "
              f"| {cont:.2f} |")


if __name__ == "__main__":
    main()
