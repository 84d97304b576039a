"""An exercise notebook in a real JupyterLab: filled in like a learner would, graded on live ranks.

The notebook is labs/exercises/02-average-gradients-vs-ddp.ipynb, cut down to what its two
exercises need (set-up, stubs, graders, the cells that use the result; the timing experiments
are left out to keep the browser budget). Two copies:

- ``filled``: the browser types each solution cell of labs/02-... over its stub (one
  insertText, as a paste would), runs every cell, and sees every grader print "passed"
  and draw the learner's timeline beside torch DDP's; the saved notebook holds exactly the
  solution's source;
- ``untouched``: Run All goes on past the failing graders (they are tagged
  ``raises-exception``), each says "not implemented yet", and the cells after them fall
  back to ddplab's own implementation and say so.

Skipped without Playwright or Chromium, except with CI=true. Budget: under a minute.
"""
import shutil

import nbformat
import pytest

from _browser import (ARTIFACTS, ROOT, chromium, jupyterlab, notebook_errors, open_notebook,
                      require_browser, run_all_cells, save_screenshots)
from ddplab import exercises

pytestmark = pytest.mark.timeout(240)
NAME = "02-average-gradients-vs-ddp.ipynb"
KEEP = {"cell-03b", "exercise-overlap-use"}  # cells that use the exercise's result
CELLS = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell"


def cut_down(nb):
    """Markdown, the set-up cell, stubs, graders and the cells that use what was written."""
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    nb.cells = [c for c in nb.cells if c.cell_type == "markdown" or c is first_code
                or c.id in KEEP or {"solution", "grader"} & set(exercises.tags(c))]
    return nb


def write_copies(root):
    ex = cut_down(nbformat.read(str(ROOT / "labs" / "exercises" / NAME), as_version=4))
    for name in ("filled.ipynb", "untouched.ipynb"):
        nbformat.write(ex, str(root / name))
    solutions = {c.id: c.source for c in nbformat.read(str(ROOT / "labs" / NAME), as_version=4).cells
                 if "solution" in exercises.tags(c)}
    return ex, solutions


def cell_text(page, index) -> str:
    return page.locator(CELLS).nth(index).locator(".jp-OutputArea").inner_text()


def test_an_exercise_filled_in_passes_its_graders_and_untouched_fails_them(tmp_path):
    executable = require_browser()
    root = tmp_path / "root"
    root.mkdir()
    ex, solutions = write_copies(root)
    stubs = [i for i, c in enumerate(ex.cells) if "solution" in exercises.tags(c)]
    graders = [i for i, c in enumerate(ex.cells) if "grader" in exercises.tags(c)]
    users = [i for i, c in enumerate(ex.cells) if c.id in KEEP]
    assert len(stubs) == len(graders) == len(users) == 2
    with jupyterlab(root, tmp_path / "lab") as lab, chromium(executable, height=2400) as page:
        try:
            open_notebook(page, lab, "filled.ipynb")
            for i in stubs:  # the learner replaces each stub with their code
                page.locator(CELLS).nth(i).locator(".cm-content").click()
                page.keyboard.press("Control+A")
                page.keyboard.insert_text(solutions[ex.cells[i].id])
                page.keyboard.press("Escape")
            page.keyboard.press("Control+S")
            run_all_cells(page, timeout_s=90)
            assert notebook_errors(page) == []
            for i in graders:
                assert "passed" in cell_text(page, i), cell_text(page, i)
                # the learner's timeline beside torch DDP's, drawn by plotly
                assert page.locator(CELLS).nth(i).locator(".js-plotly-plot .barlayer").count() >= 1
            for i in users:
                assert "ddplab's own" not in cell_text(page, i)
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator(CELLS).nth(graders[-1]).screenshot(path=str(ARTIFACTS / "browser-exercise-passed.png"))
            saved = nbformat.read(str(root / "filled.ipynb"), as_version=4)
            assert [saved.cells[i].source for i in stubs] == [solutions[ex.cells[i].id] for i in stubs]

            open_notebook(page, lab, "untouched.ipynb")
            run_all_cells(page, timeout_s=60)  # every cell ran: the failures did not stop Run All
            for i in graders:
                assert "CheckFailed: not implemented yet" in cell_text(page, i), cell_text(page, i)
            for i in users:
                assert "ddplab's own" in cell_text(page, i), cell_text(page, i)
            assert page.errors == []
        finally:
            shots = save_screenshots(page, "browser-exercise")
            shutil.copy(lab.log_path, shots[0].parent / "browser-exercise-jupyterlab.log")
