"""The what-if against measurement, side by side: predicted / measured step time, per row.

    .venv/bin/python benchmarks/whatif.py                        # 2 models x 4 caps, as found and loaded
    .venv/bin/python benchmarks/whatif.py --models transformer --caps 0.25,1 --runs 3

Plain gloo, 2 ranks, lab 10's path: ``ddplab.lessons.yourmodel.record_on_rank`` (torch DDP with
``ddplab.record``, per-parameter ready times) records ``--steps`` steps of a model at
``--recorded-cap``; ``ddplab.measure.whatif.predict`` predicts every cap from that one
recording, and the same function measures each cap (the median of ``--runs`` runs). Each row
gives predicted / measured, and whether the what-if trusted itself (``meta["whatif"]["trusted"]``)
and why not. The A/A row measures the recorded cap again: measured / recording, the noise
between two runs of the same settings.

Two conditions, one after the other: ``as found`` (whatever else runs on the machine; the
load average is printed) and ``loaded`` (two more processes spinning on the CPUs for the whole
condition). The worst row is reported over the trusted rows and over all rows; a trusted row
beyond 10 % is a failure of the what-if, an untrusted one is the what-if saying it cannot.
Figures: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddplab.cluster import Cluster  # noqa: E402
from ddplab.lessons.yourmodel import measured_step_ms, record_on_rank  # noqa: E402
from ddplab.measure.whatif import TARGET, predict  # noqa: E402
from ddplab.timeline import Timeline  # noqa: E402
from ddplab.timeline.metrics import summarize  # noqa: E402


def spin(stop):  # a process that takes a core for as long as the condition runs
    while not stop.is_set():
        sum(range(10_000))


def record(c, model, cap, steps) -> Timeline:
    return Timeline.from_dict(c.run(record_on_rank, model, None, None, cap, steps)[0])


def condition(c, name, models, caps, args) -> list:
    rows = []
    load0 = os.getloadavg()[0]
    for model in models:
        rec = record(c, model, args.recorded_cap, args.steps)
        again = measured_step_ms(record(c, model, args.recorded_cap, args.steps))
        rows.append(dict(condition=name, model=model, cap="A/A", buckets=len(rec.meta["logged_bucket_sizes"]),
                         measured=again, predicted=measured_step_ms(rec), trusted=None, why=[]))
        for cap in caps:
            runs = [record(c, model, cap, args.steps) for _ in range(args.runs)]
            measured = statistics.median(measured_step_ms(r) for r in runs)
            pred = predict(rec, bucket_cap_mb=cap)
            w = pred.meta["whatif"]
            rows.append(dict(condition=name, model=model, cap=cap, buckets=summarize(pred)["n_buckets"],
                             measured=measured, predicted=summarize(pred)["step_ms"],
                             trusted=w["trusted"], why=w["untrusted"]))
            print(f"  {name} {model} cap {cap:g}: measured {measured:.1f} ms, predicted "
                  f"{rows[-1]['predicted']:.1f} ms, trusted {w['trusted']}", flush=True)
    print(f"{name}: load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after", flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="transformer,mlp")
    ap.add_argument("--caps", default="0.25,1,4,25", help="bucket caps in MiB to predict")
    ap.add_argument("--recorded-cap", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3, help="measured runs per cap (median)")
    ap.add_argument("--conditions", default="as found,loaded")
    args = ap.parse_args(argv)
    models, caps = args.models.split(","), [float(x) for x in args.caps.split(",")]
    rows = []
    with Cluster(2) as c:
        for name in args.conditions.split(","):
            stop, spinners = mp.Event(), []
            if name == "loaded":
                spinners = [mp.Process(target=spin, args=(stop,), daemon=True) for _ in range(2)]
                for p in spinners:
                    p.start()
            try:
                rows += condition(c, name, models, caps, args)
            finally:
                stop.set()
                for p in spinners:
                    p.join(10)
    print("\n| condition | model | cap MiB | buckets | measured ms | predicted ms | predicted / "
          "measured | trusted | why not |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cap = r["cap"] if isinstance(r["cap"], str) else f"{r['cap']:g}"
        trusted = "A/A" if r["trusted"] is None else ("yes" if r["trusted"] else "no")
        print(f"| {r['condition']} | {r['model']} | {cap} | {r['buckets']} | {r['measured']:.1f} | "
              f"{r['predicted']:.1f} | {r['predicted'] / r['measured']:.2f} | {trusted} | "
              f"{'; '.join(r['why'])} |")
    judged = [r for r in rows if r["trusted"] is not None]
    worst = max(judged, key=lambda r: abs(r["predicted"] / r["measured"] - 1))
    trusted = [r for r in judged if r["trusted"]]
    print(f"\nworst row: {worst['condition']} {worst['model']} cap {worst['cap']:g}: "
          f"{worst['predicted'] / worst['measured']:.2f} (trusted: {worst['trusted']})")
    if trusted:
        tw = max(trusted, key=lambda r: abs(r["predicted"] / r["measured"] - 1))
        verdict = "within" if abs(tw["predicted"] / tw["measured"] - 1) <= TARGET else "BEYOND"
        print(f"worst trusted row: {tw['condition']} {tw['model']} cap {tw['cap']:g}: "
              f"{tw['predicted'] / tw['measured']:.2f} ({verdict} {100 * TARGET:.0f} %)")
    print(f"rows the what-if refused to trust: {len(judged) - len(trusted)} of {len(judged)}")


if __name__ == "__main__":
    main()
