"""``python -m ddplab view run.json [other.json ...]``: saved runs drawn with the labs' figures.

Teaches: a recorded run is a file you keep, compare and send. Two runs of the same model (say,
before and after a change of ``bucket_cap_mb``) are drawn side by side on one time scale, with
the metrics the labs use (step time, exposed communication, overlap), and each in full below.
A run whose communication was not measured, or that was predicted rather than measured (the
what-if), carries that label on the page. The page lists the stamp source labels its runs hold
(``cpu``, ``cuda_event``, ``derived``, ...) with what each means, and its legends name only
what is drawn (no "saved vs manual" without a manual run). A recorded ``fully_shard`` run
(ddplab.measure.recording_fsdp) draws its all-gathers and reduce-scatters on rows of their own
under each rank's compute row, so it can sit beside a DDP run of the same model.

Leaves out: anything the recording did not stamp (kernels, memory).
References: ddplab.measure.recording (the files), ddplab.widgets.html (the page).
"""
from __future__ import annotations

import argparse
import webbrowser
from pathlib import Path


def runs_page(path, timelines: dict, title: str = "ddplab: saved runs") -> str:
    """Write the page for ``{label: Timeline}`` (what ``ddplab.record(..., out=)`` writes)."""
    from ddplab.launchers.jobstore import place_words
    from ddplab.timeline.metrics import summarize_run
    from ddplab.widgets.html import compare_report

    notes = [f"{name}: {tl.meta['comm_not_measured']}" for name, tl in timelines.items()
             if tl.meta.get("comm_not_measured")]
    notes += [f"{name} ran as {place_words(tl.meta['ranks'])}." for name, tl in timelines.items()
              if any(r.get("job") or r.get("node") for r in tl.meta.get("ranks", ()))]  # a job's ranks: where
    html = compare_report(timelines, {name: summarize_run(tl) for name, tl in timelines.items()}, title)
    if notes:  # said at the top of the page, not only in the JSON
        html = html.replace("<body>", "<body><p><b>" + " ".join(notes) + "</b></p>", 1)
    Path(path).write_text(html, encoding="utf-8")
    return str(path)


def load_runs(paths) -> dict:
    """``{label: Timeline}`` for saved runs: each labelled by its run's name and trainer
    (``ddplab.record``'s meta; else the file's name); two alike get their folders' names."""
    from ddplab.measure.recording import load_run, run_label

    loaded = [(Path(p), load_run(p)) for p in paths]
    labels = [run_label(tl, p.name.removesuffix(".json")) for p, tl in loaded]
    runs = {}
    for (p, tl), label in zip(loaded, labels):
        if labels.count(label) > 1:
            label = f"{p.resolve().parent.name}/{label}"
        base, n = label, 2
        while label in runs:
            label, n = f"{base} #{n}", n + 1
        runs[label] = tl
    return runs


def view(*paths, out=None):
    """In a notebook: draw saved runs side by side (plotly figures); with ``out``, also write
    the page there. Returns the figures (the side-by-side timeline, then the metrics)."""
    from ddplab.timeline.metrics import summarize_run
    from ddplab.widgets.compare import compare_figures

    if not paths:
        raise ValueError("view() needs at least one saved run, e.g. view('run.json')")
    runs = load_runs(paths)
    if out is not None:
        runs_page(out, runs)
    return compare_figures(runs, {name: summarize_run(tl) for name, tl in runs.items()})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="run.json files written by ddplab.record(..., out=)")
    parser.add_argument("--html", default=None,
                        help="where to write the page (default: the first run's name + .view.html)")
    parser.add_argument("--open", action="store_true", help="open the page in a browser")


def run(args) -> int:
    missing = [p for p in args.runs if not Path(p).is_file()]
    if missing:
        raise SystemExit(f"no such run: {', '.join(missing)} (write one with "
                         "ddplab.record(ddp_model, out='run'))")
    out = args.html or str(Path(args.runs[0]).with_suffix("")) + ".view.html"
    runs_page(out, load_runs(args.runs))
    print(f"wrote {out} ({len(args.runs)} run(s) side by side)")
    if args.open:
        webbrowser.open(Path(out).resolve().as_uri())
    return 0
