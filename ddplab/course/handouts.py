"""Handouts: every lab executed once and saved as a static HTML page with its figures.

Teaches nothing about DDP; it serves the people around a lesson. Notebooks are
committed without outputs (so CI and git stay clean), which leaves an
instructor nothing to put on a slide and a learner whose machine cannot start
ranks nothing to look at. ``python -m ddplab.course.handouts`` (``make handouts``)
runs each notebook top to bottom on live ranks, exactly as a learner would,
and writes ``NAME.html`` beside an ``index.html`` that lists them with how
long each took.

How figures survive: plotly figures are written with plotly.js embedded once
per page (``PLOTLY_RENDERER=notebook``), so a handout opens offline; widget
state (sliders, the control panel) is stored in the notebook, so widgets show
as they were left, without a kernel behind them (they no longer react).

A notebook that fails still gets a page, with the error where it happened, and
the command exits non-zero naming it: CI builds the handouts as a check.

References: nbclient (execution, ``store_widget_state``), nbconvert's
HTMLExporter, plotly.io renderers.
"""
from __future__ import annotations

import argparse
import html
import os
import sys
import time
from pathlib import Path


def build(notebooks: list[Path], out_dir: Path, timeout: int = 600) -> list[dict]:
    """Execute each notebook and write its HTML page; return one summary per notebook."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from nbconvert import HTMLExporter

    out_dir.mkdir(parents=True, exist_ok=True)
    # The kernel inherits this: plotly embeds its JavaScript in the page instead of
    # expecting a live JupyterLab to render the figure.
    os.environ.setdefault("PLOTLY_RENDERER", "notebook")
    exporter = HTMLExporter(template_name="lab")
    done = []
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}},
                                store_widget_state=True)
        t0 = time.monotonic()
        error = None
        try:
            client.execute()
        except CellExecutionError as exc:
            error = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        seconds = time.monotonic() - t0
        body, _ = exporter.from_notebook_node(nb)
        target = out_dir / (path.stem + ".html")
        target.write_text(body, encoding="utf-8")
        done.append({"notebook": str(path), "html": target.name, "seconds": round(seconds, 1),
                     "error": error, "bytes": target.stat().st_size})
        status = f"FAILED: {error}" if error else "ok"
        print(f"{path}: {seconds:.1f} s, {target.stat().st_size / 1e6:.1f} MB, {status}", flush=True)
    (out_dir / "index.html").write_text(_index(done), encoding="utf-8")
    return done


def _index(done: list[dict]) -> str:
    rows = "\n".join(
        f"<tr><td><a href='{html.escape(d['html'])}'>{html.escape(Path(d['notebook']).stem)}</a></td>"
        f"<td>{d['seconds']} s</td><td>{'failed: ' + html.escape(d['error']) if d['error'] else 'ok'}"
        "</td></tr>" for d in done)
    return ("<!doctype html><meta charset='utf-8'><title>ddplab handouts</title>"
            "<h1>ddplab handouts</h1><p>Each lab executed once on live ranks; figures are static "
            "copies of what the notebook drew. Timings are for the machine that built them.</p>"
            f"<table><tr><th>lab</th><th>ran in</th><th>status</th></tr>{rows}</table>")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddplab.course.handouts", description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to execute (default: labs/*.ipynb, the solutions)")
    parser.add_argument("-o", "--out", type=Path, default=Path("build/handouts"))
    parser.add_argument("--timeout", type=int, default=600, help="seconds one cell may take")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or sorted(Path("labs").glob("*.ipynb"))
    if not notebooks:
        parser.error("no notebooks found: run from the repository root or name them")
    t0 = time.monotonic()
    done = build(notebooks, args.out, args.timeout)
    failed = [d["notebook"] for d in done if d["error"]]
    print(f"{len(done)} handout(s) in {args.out}/ in {time.monotonic() - t0:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
