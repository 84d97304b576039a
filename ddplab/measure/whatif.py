"""What if: the step a recorded run would take with another bucket cap, link, world size or a straggler.

Teaches: a recording already holds what decides a DDP step, so many
questions need no cluster. ``predict`` replays the compute read by
``ddplab.measure.profile`` (pre-backward time, backward work per gradient,
optimizer time) under the new settings:

- buckets: torch's rebuild rule (``ddplab.sync.layout.rebuilt_layout``) over
  the gradients in the order rank 0 saw them ready, with the new cap. A
  recording without per-parameter times re-buckets whole recorded buckets:
  a cap can merge them, never split them.
- launch: a bucket launches once its last gradient is ready and every
  earlier bucket has launched (torch launches in index order); the
  all-reduce starts when EVERY rank has launched it and the link is free
  (one link per rank, transfers queue), so a straggler's lateness shows up
  as waiting on the other ranks.
- cost: ring all-reduce, ``2(p-1) alpha + 2(p-1)/p n / bandwidth``
  (``ddplab.netsim.link.LinkModel.allreduce_seconds``) on the given link: a
  preset, a LinkModel, or the JSON ``python -m ddplab link`` wrote
  (``ddplab.measure.link``: your own link, measured). By
  default, alpha and bandwidth fitted to the recording's own all-reduce times
  (``ddplab.netsim.costmodel.fit``); for a recording made under a simulated
  link, the slower of that link and the fit, as the simulated link itself
  completes no earlier than the real transfer (``SlowerOf``).
- compression: a run recorded under a compressing comm hook (``wire_nbytes``
  below ``nbytes``, e.g. fp16_compress_hook's half) has each new bucket charged
  the recorded wire/held ratio, said on the label.
- contention: while an all-reduce is in flight, compute runs ``1 + c``
  times slower, with c measured from the recording (see profile). c belongs
  to the machine that recorded; pass ``contention=0`` for hardware where
  communication does not slow compute.

The answer is a ``Timeline`` labelled PREDICTED in its meta (every figure
that draws a timeline prints its labels), with one iteration per rank.

When it cannot be trusted (held to 10 % of a measured step), it says so:
``meta["whatif"]["trusted"]`` is False and ``["untrusted"]`` lists why, on the
label too. The rules (``ddplab.measure.profile.untrusted_reasons``), each about the recording:
- its own steps varied by more than 10 % (interquartile range over the
  median): a re-run of the same settings would differ by that much;
- backward was slower than the communication in flight can explain (the
  contention estimate at its limit): other load slowed it, by an amount the
  recording cannot separate;
- the machine was loaded while it recorded: fewer free cores (cores minus
  the load average not due to these ranks) than ranks on it less half a
  core (``SLACK_CORES``), so compute waited for cores by an amount that
  changes from run to run.

Leaves out, compared with torch's DDP: the first iteration's single bucket
and the rebuild (a prediction is a steady-state step), find_unused_parameters
layouts, several dtypes, tree or hierarchical all-reduce, several links per
rank. References: torch/csrc/distributed/c10d/reducer.cpp
(``compute_bucket_assignment_by_size``, ``mark_bucket_ready``); Thakur,
Rabenseifner and Gropp (2005) for the ring cost.
"""
from __future__ import annotations

from types import SimpleNamespace

from ddplab.measure.link import COMMAND, FORMAT, is_link_file, link_from_measurement, load_link
from ddplab.measure.profile import TARGET, Profile, read_profile, untrusted_reasons
from ddplab.netsim.costmodel import fit
from ddplab.netsim.link import LinkModel
from ddplab.sync.layout import Caps, rebuilt_layout
from ddplab.timeline.records import BucketRecord, GradRecord, IterationRecord, Timeline

RECORDED = "recorded"  # keep the recording's buckets


def wall_after(work: float, t0: float, flight, c: float) -> float:
    """Wall time at which ``work`` seconds of compute started at ``t0`` are done."""
    t, left = t0, work
    for a, e in sorted(flight):
        if e <= t:
            continue
        if a > t:
            if left <= a - t:
                return t + left
            left -= a - t
            t = a
        room = (e - t) / (1 + c)  # in flight, compute runs 1 + c times slower
        if left <= room:
            return t + left * (1 + c)
        left -= room
        t = e
    return t + left


def _layout(prof: Profile, bucket_cap_mb) -> list:
    units = prof.ranks[0].nbytes
    if bucket_cap_mb == RECORDED:
        if not prof.recorded_layout:
            raise ValueError("the recorded buckets name parameters, not their indices, so they "
                             "cannot be replayed: give bucket_cap_mb (the recording's own cap)")
        return prof.recorded_layout
    caps = Caps.create(bucket_cap_mb)
    # one dtype: each unit a flat run of bytes (numel = bytes, element_size = 1)
    fake = {u: SimpleNamespace(dtype="bytes", device="any", numel=lambda n=n: n,
                               element_size=lambda: 1) for u, n in units.items()}
    order = list(prof.ready_order)
    buckets = rebuilt_layout([fake[u] for u in order], caps, list(range(len(order))))
    return [[order[k] for k in b] for b in buckets]


class SlowerOf:
    """Two link models raced, the later end winning: a simulated link over a real backend.

    ddplab.netsim.simulated completes an all-reduce no earlier than both the modelled
    transfer and the real one; on 2 CPU cores the real gloo transfer often loses."""

    def __init__(self, simulated: LinkModel, fitted: LinkModel):
        self.simulated, self.fitted = simulated, fitted
        self.label = f"{simulated.label} (simulated) or gloo as fitted, whichever is slower"

    def allreduce_seconds(self, nbytes: int, world_size: int) -> float:
        return self.collective_seconds("all_reduce", nbytes, world_size)

    def collective_seconds(self, op: str, nbytes: int, world_size: int) -> float:
        return max(self.simulated.collective_seconds(op, nbytes, world_size),
                   self.fitted.collective_seconds(op, nbytes, world_size))

    def describe(self) -> dict:
        return dict(self.simulated.describe(), label=self.label, fitted=self.fitted.describe())


def _wire_ratio(recording) -> tuple[str, float]:
    """(label, wire bytes / held bytes) of the recorded buckets. Under a compressing comm hook
    (fp16_compress_hook: half) the link carries less than the buckets hold; the prediction charges
    each new bucket the recorded ratio, and its label says so. ("", 1.0) without compression."""
    held = sum(b.nbytes for b in recording.buckets if b.wire_nbytes is not None)
    wire = sum(b.wire_nbytes for b in recording.buckets if b.wire_nbytes is not None)
    if not held or wire == held:
        return "", 1.0
    return (f"; the comm hook's recorded wire/held ratio {wire / held:.3f} applied to every bucket "
            "(a hook whose bytes change with the bucket, e.g. PowerSGD's rank, is not modelled)"), wire / held


def _link(prof: Profile, link):
    """(link model, its label, the measurement it came from or None)."""
    if is_link_file(link):  # measured by `python -m ddplab link`
        model, source = load_link(link)
        return model, model.label, source
    if isinstance(link, dict) and "format" in link:  # what measure_link returned, not yet written
        model, source = link_from_measurement(link, f"the link= dict (format {link['format']!r}, not {FORMAT!r})"
                                              if link["format"] != FORMAT else "the link= measurement")
        return model, model.label, source
    if link is not None:
        model = LinkModel.parse(link)
        return model, model.label, None
    if prof.simulated_link:
        simulated = LinkModel.parse(prof.simulated_link)
        try:
            return SlowerOf(simulated, _fitted(prof)), "the recording's simulated link over gloo", None
        except ValueError:
            return simulated, "the recording's simulated link", None
    model = _fitted(prof)
    return model, model.label, None


# what each refusal to fit the recording's link ends with: the ways out
WAYS_OUT = ("pass link= (a preset name such as '10gbe', a LinkModel, or your own link measured "
            f"into a file: `{COMMAND}` under the launcher you train with, then link='link.json')")


def _fitted(prof: Profile) -> LinkModel:
    if prof.world_size < 2:
        raise ValueError(f"a 1-rank recording has no communication to learn a link from: {WAYS_OUT}")
    sizes = [n for n, _ in prof.comm_samples]
    if len(set(sizes)) < 2:
        raise ValueError("the recording's all-reduces all have one size, too few to fit alpha "
                         f"and bandwidth: {WAYS_OUT}")
    f = fit(sizes, [s for _, s in prof.comm_samples], prof.world_size)
    if f.per_byte_s <= 0:
        raise ValueError("the recording's all-reduce times do not grow with size, so no "
                         f"bandwidth can be fitted: {WAYS_OUT}")
    return LinkModel(f.bandwidth_gbps, max(0.0, f.alpha_us), "alpha-beta fitted to the recording")


BEYOND = 4  # a bucket this many times past the measured sizes is said in the label


def _beyond_measured(measured_sizes, bucket_sizes) -> str:
    """What the label adds when the buckets lie outside the sizes the link was measured at:
    the line is then carried past its data, and a latency fitted on 4-byte all-reduces, say,
    predicts megabytes badly."""
    lo, hi = min(measured_sizes), max(measured_sizes)
    big, small = max(bucket_sizes, default=0), min(bucket_sizes, default=0)
    mib = 2 ** 20
    if big > BEYOND * hi:
        return (f"; buckets of up to {big / mib:.3g} MiB, the link measured only up to {hi / mib:.3g} MiB: "
                "carried past its sizes by the line (measure larger sizes)")
    if 0 < small < lo / BEYOND:
        return (f"; buckets down to {small} bytes, the link measured only from {lo} bytes: carried "
                "below its sizes by the line")
    return ""


def _check(world_size, straggler):
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number of ranks >= 1, got {world_size!r}")
    if straggler is None:
        return
    ok = isinstance(straggler, (tuple, list)) and len(straggler) == 2
    if not ok or not 0 <= straggler[0] < world_size or not straggler[1] > 0:
        raise ValueError(f"straggler must be (rank, factor) with 0 <= rank < {world_size} and "
                         f"factor > 0 (2.0: that rank computes twice as slowly), got {straggler!r}")


def predict(recording: Timeline, *, bucket_cap_mb=RECORDED, link=None, world_size=None,
            straggler=None, contention=None, baseline: Timeline | None = None) -> Timeline:
    """The predicted step of ``recording`` under the given changes (module docstring).

    ``bucket_cap_mb``: MiB, None for torch's default, or "recorded"; ``link``: a preset
    name, LinkModel, dict, or the path of a file ``python -m ddplab link`` wrote;
    ``world_size``: ranks (the same per-rank batch); ``straggler``: (rank, factor);
    ``contention``: c, None to measure it (against ``baseline`` when given).
    """
    prof = read_profile(recording, baseline, contention)
    p = prof.world_size if world_size is None else world_size
    _check(p, straggler)
    if p == 1 and link is not None:
        raise ValueError("at 1 rank there is nothing to all-reduce, so no link changes the step: pass "
                         "world_size= (the ranks you will train on, e.g. world_size=2) to predict the "
                         "recording on that link")
    model, link_label, measured = _link(prof, link)
    if measured and measured["world_size"] != p:
        link_label += f", measured at {measured['world_size']} ranks and carried to {p} by the ring model"
    layout = _layout(prof, bucket_cap_mb)
    c = prof.contention
    sizes = prof.ranks[0].nbytes
    on_wire, ratio = _wire_ratio(recording)
    if on_wire:
        link_label += on_wire
    ranks = [prof.ranks[r % len(prof.ranks)] for r in range(p)]
    slow = [straggler[1] if straggler and straggler[0] == r else 1.0 for r in range(p)]
    b0 = [rp.pre_s * f for rp, f in zip(ranks, slow)]
    flight, free, launched = [], 0.0, [0.0] * p
    rows = []
    for k, units in enumerate(layout):
        nbytes = sum(sizes[u] for u in units)
        readies, launches = [], []
        for r, (rp, f) in enumerate(zip(ranks, slow)):
            ready = wall_after(max(rp.grad_work_s[u] for u in units) * f, b0[r], flight, c)
            launched[r] = max(ready, launched[r])
            readies.append(ready)
            launches.append(launched[r])
        start = max(max(launches), free)
        free = start + model.allreduce_seconds(round(nbytes * ratio), p)  # what goes on the wire
        flight.append((start, free))
        rows.append((k, units, nbytes, readies, launches, start, free))
    if measured:
        link_label += _beyond_measured(measured["sizes_bytes"], [row[2] * ratio for row in rows])
    tl = Timeline(f"predicted: {recording.strategy}", p, recording.backend)
    # figures show bucket records' params as names, as recorders write them
    unit_names = {u: (f"recorded bucket {u}" if prof.from_buckets else f"parameter {u}")
                  for u in sizes}
    for r, (rp, f) in enumerate(zip(ranks, slow)):
        b1 = wall_after(rp.backward_work_s * f, b0[r], flight, c)
        done = max(b1, free)
        phases = {"forward": (0.0, b0[r]), "backward": (b0[r], b1), "step": (done, done + rp.post_s * f)}
        if free > b1:
            phases["wait"] = (b1, free)
        tl.iterations.append(IterationRecord(r, 0, 0.0, done + rp.post_s * f, phases,
                                             {k: "derived" for k in phases}))
        for k, units, nbytes, readies, launches, start, end in rows:
            first = wall_after(min(rp.grad_work_s[u] for u in units) * f, b0[r], flight, c)
            tl.buckets.append(BucketRecord(
                r, 0, k, nbytes, tuple(unit_names[u] for u in units), first, readies[r], launches[r], start, end,
                {"grads_ready": "derived", "launch": "derived", "comm_start": "simulated",
                 "comm_end": "simulated"}, simulated=True))
        for u, w in rp.grad_work_s.items():
            tl.grads.append(GradRecord(r, 0, u, sizes[u], wall_after(w * f, b0[r], flight, c),
                                       "derived"))
    changes = {"bucket_cap_mb": bucket_cap_mb, "link": model.describe(), "world_size": p,
               "straggler": list(straggler) if straggler else None, "contention": c}
    label = (f"PREDICTED from a recording, not measured: {len(layout)} bucket(s), "
             f"{link_label}, {p} rank(s); {prof.contention_note}")
    if prof.from_buckets:
        label += "; re-bucketed from whole recorded buckets (no per-parameter times)"
    untrusted = untrusted_reasons(recording, prof)
    changes.update(trusted=not untrusted, untrusted=untrusted)
    if untrusted:
        label += f"; NOT TRUSTED to {100 * TARGET:.0f} %: " + "; ".join(untrusted)
    tl.meta.update(predicted=True, whatif=changes, labels=[label], simulated_link=model.describe(),
                   contention_note=prof.contention_note, recorded_world_size=prof.world_size)
    if measured:  # which file, machines and date the link was measured on
        tl.meta["measured_link"] = measured
    if straggler:
        tl.meta["straggler"] = (straggler[0], straggler[1])
    return tl


def exposed_buckets(tl: Timeline) -> list:
    """Buckets whose all-reduce ends after backward on the rank that waits longest:
    dicts with the bucket, its exposed seconds and why it ended late."""
    def wait(r):
        it = tl.iteration(r, 0)
        return max((b.comm_end for b in tl.buckets_of(r, 0)), default=0.0) - it.phases["backward"][1]

    rank = max(sorted({it.rank for it in tl.iterations}), key=wait)
    b1 = tl.iteration(rank, 0).phases["backward"][1]
    out, prev_end = [], None
    for b in tl.buckets_of(rank, 0):
        exposed = b.comm_end - max(b1, b.comm_start)
        last = max((x for x in tl.buckets if x.iteration == 0 and x.index == b.index),
                   key=lambda x: (x.launch, -x.rank))  # the rank that launched it last
        if b.comm_end > b1:
            if last.launch > b.launch and (prev_end is None or last.launch >= prev_end):
                why = f"waited for rank {last.rank} to launch it"
            elif b.comm_start > b.launch:
                why = f"queued behind bucket {b.index - 1} on the link"
            elif b.grads_ready >= b1 - 1e-12:
                why = "its last gradient is ready only when backward ends"
            else:
                why = "its all-reduce takes longer than the backward left after it"
            out.append({"index": b.index, "nbytes": b.nbytes, "exposed_s": max(0.0, exposed),
                        "why": why, "rank": rank})
        prev_end = b.comm_end
    return out


def choose_cap(recording: Timeline, caps_mb=(0.25, 1, 4, 16, 64), **changes) -> dict:
    """Predicted step for each cap (other changes as in ``predict``), the fastest, and why.

    Returns {"rows": [...], "best": cap, "reason": text, "predictions": {cap: Timeline},
    "trusted": bool, "untrusted": [why, ...]} (``untrusted_reasons``)."""
    from ddplab.timeline.metrics import summarize

    rows, preds = [], {}
    for cap in caps_mb:
        tl = predict(recording, bucket_cap_mb=cap, **changes)
        m, exp = summarize(tl), exposed_buckets(tl)
        preds[cap] = tl
        rows.append({"bucket_cap_mb": cap, "n_buckets": m["n_buckets"], "step_ms": m["step_ms"],
                     "exposed_comm_ms": m["exposed_comm_ms"], "exposed": exp,
                     "trusted": tl.meta["whatif"]["trusted"],
                     "untrusted": tl.meta["whatif"]["untrusted"]})
    best = min(rows, key=lambda r: (round(r["step_ms"], 9), r["n_buckets"]))
    reason = [f"{best['bucket_cap_mb']:g} MiB: {best['step_ms']:.2f} ms per step, "
              f"{best['exposed_comm_ms']:.2f} ms of it exposed communication"]
    for e in best["exposed"]:
        reason.append(f"bucket {e['index']} ({e['nbytes'] / 2**20:.2f} MiB) is exposed for "
                      f"{1e3 * e['exposed_s']:.2f} ms: {e['why']}")
    for r in rows:
        if r is not best and r["exposed"]:
            e = max(r["exposed"], key=lambda x: x["exposed_s"])
            reason.append(f"{r['bucket_cap_mb']:g} MiB is slower ({r['step_ms']:.2f} ms): bucket "
                          f"{e['index']} exposed {1e3 * e['exposed_s']:.2f} ms, {e['why']}")
    untrusted = best["untrusted"]
    if untrusted:  # the same recording for every cap: the same reasons
        reason.insert(0, f"NOT TRUSTED to {100 * TARGET:.0f} % (measure before you rely on "
                         "it): " + "; ".join(untrusted))
    return {"rows": rows, "best": best["bucket_cap_mb"], "reason": "\n".join(reason),
            "predictions": preds, "trusted": not untrusted, "untrusted": untrusted}
