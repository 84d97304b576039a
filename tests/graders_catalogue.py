"""The graders' mutation catalogue: every exercise's grader against many learner solutions, on live ranks.

    PYTHONPATH=. python tests/graders_catalogue.py [exercise ...]    (make test-graders)

For every exercise: at least 3 correct solutions written differently (each must
pass) and at least 8 wrong ones (each must end in a CheckFailed, ideally naming
the mistake listed beside it). Prints, per exercise, false rejects (a correct
solution failed), false accepts (a wrong one passed), raw errors (anything but a
CheckFailed came out of a grader: the learner would see a traceback, not words)
and "named otherwise" (a CheckFailed, but not the mistake listed). Exits 1 on
any false reject or raw error. One Cluster per world size, shared by every
check. tests/checks/test_graders_catalogue.py runs the first correct and first wrong
solution of each exercise (the fast subset, in ``make test``).
"""
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the catalogue's modules and _exercise_solutions

import _catalogue_fsdp as FSDP  # noqa: E402
import _catalogue_new as NEW  # noqa: E402
import _catalogue_p2p as P2P  # noqa: E402
import _catalogue_sharding as SHARDING  # noqa: E402
import _catalogue_small as SMALL  # noqa: E402
import _catalogue_sync as SYNC  # noqa: E402
import _catalogue_yourmodel as YOURS  # noqa: E402
import _exercise_solutions  # noqa: E402
import cloudpickle  # noqa: E402

for _m in (FSDP, NEW, P2P, SMALL, SYNC, YOURS, SHARDING, _exercise_solutions):
    cloudpickle.register_pickle_by_value(_m)  # the ranks cannot import tests/

# exercise -> {"check": f(cluster, solution), "world": ranks, "correct": [...], "wrong": [(fn, mistake)]}
CATALOGUE = {
    "00 send/recv warm-up": NEW.WARM_UP,
    "00 warm-up judged for NCCL": NEW.WARM_UP_NCCL,
    "00 ring all-reduce": P2P.RING,
    "00 ring judged for NCCL": P2P.RING_NCCL,
    "02 average_gradients": SYNC.AVERAGE,
    "02 OverlapDDP": SYNC.OVERLAP,
    "03 BucketedDDP": SYNC.BUCKETED,
    "03 no_sync accumulation": SYNC.NO_SYNC,
    "05 sampler indices": SMALL.SAMPLER,
    "05 batch statistics": SMALL.BATCH_STATS,
    "06 agreed steps": SMALL.AGREED,
    "07 comm hook": SMALL.COMM_HOOK,
    "08 pipeline step": P2P.PIPELINE,
    "09 bucket assignment": NEW.BUCKET_ASSIGNMENT,
    "10 exposed buckets": YOURS.EXPOSED,
    "11 sharded step": SHARDING.SHARDED_STEP,
    "11 sharded step, 3 ranks": SHARDING.SHARDED_STEP_3,
    "12 FSDP hooks": FSDP.FSDP_HOOKS,
    "12 FSDP hooks, 3 ranks": FSDP.FSDP_HOOKS_3,
}


def grade(entry, cluster, fn, expected):
    """One verdict: ("pass" | "fail" | "raw", mistake or error text)."""
    from ddplab.checks import CheckFailed

    try:
        entry["check"](cluster, fn)
    except CheckFailed as failed:
        return "fail", failed.mistake
    except Exception as exc:  # noqa: BLE001 - the catalogue's finding
        return "raw", f"{type(exc).__name__}: {str(exc)[:300]}\n{traceback.format_exc()[-800:]}"
    return "pass", None


def run(names=None, subset=None, out=print) -> dict:
    """Run the catalogue (``subset(entry) -> entry`` picks solutions); return the findings."""
    import contextlib
    import io

    import ddplab

    chosen = {n: e for n, e in CATALOGUE.items() if not names or any(k in n for k in names)}
    if subset:
        chosen = {n: subset(e) for n, e in chosen.items()}
    report = {}
    for world in sorted({e["world"] for e in chosen.values()}):
        with ddplab.Cluster(world_size=world, timeout=5) as cluster:
            for name, entry in chosen.items():
                if entry["world"] != world:
                    continue
                t0 = time.perf_counter()
                rows = report[name] = {"false_reject": [], "false_accept": [], "raw": [], "otherwise": [],
                                       "named": 0, "correct": len(entry["correct"]), "wrong": len(entry["wrong"])}
                cases = [(fn, "ok") for fn in entry["correct"]] + list(entry["wrong"])
                for fn, expected in cases:
                    with contextlib.redirect_stdout(io.StringIO()):  # the checks' summaries
                        verdict, what = grade(entry, cluster, fn, expected)
                    label = fn.__name__
                    if verdict == "raw":
                        rows["raw"].append((label, what))
                    elif expected == "ok" and verdict == "fail":
                        rows["false_reject"].append((label, what))
                    elif expected != "ok" and verdict == "pass":
                        rows["false_accept"].append((label, None))
                    elif expected not in ("ok", None) and what != expected:
                        rows["otherwise"].append((label, f"named {what!r}, listed {expected!r}"))
                    elif expected != "ok":
                        rows["named"] += 1
                rows["seconds"] = time.perf_counter() - t0
                out(_line(name, rows))
    return report


def _line(name, rows) -> str:
    text = (f"{name:26s} {rows['correct']} correct, {rows['wrong']} wrong: false rejects "
            f"{len(rows['false_reject'])}, false accepts {len(rows['false_accept'])}, raw errors "
            f"{len(rows['raw'])}, named as listed {rows['named']}, named otherwise "
            f"{len(rows['otherwise'])} ({rows['seconds']:.1f} s)")
    for kind in ("false_reject", "false_accept", "raw", "otherwise"):
        for label, what in rows[kind]:
            text += f"\n    {kind.replace('_', ' ')}: {label}" + (f": {what}" if what else "")
    return text


def main(argv) -> int:
    t0 = time.perf_counter()
    report = run(argv or None)
    bad = sum(len(r["false_reject"]) + len(r["raw"]) for r in report.values())
    accepts = sum(len(r["false_accept"]) for r in report.values())
    print(f"catalogue: {len(report)} exercises, "
          f"{sum(r['correct'] + r['wrong'] for r in report.values())} solutions in "
          f"{time.perf_counter() - t0:.0f} s; false rejects + raw errors {bad}, false accepts {accepts}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
