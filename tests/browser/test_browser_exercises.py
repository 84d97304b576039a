"""An exercise notebook in a real JupyterLab: filled in like a learner would, graded on live ranks.

The notebook is labs/exercises/02-average-gradients-vs-ddp.ipynb (make test), and those of labs
11 and 12, the sharded optimizer and FSDP (make check: test-browser-more), each cut down to
what its exercises need (set-up, stubs, graders, the cells that use the result; the timing
experiments are left out to keep the browser budget), met as a learner meets it:

- untouched, Run All goes on past the failing graders (they are tagged
  ``raises-exception``), each says "not implemented yet", and the cells after them fall
  back to ddplab's own implementation and say so;
- then the browser types each solution cell of labs/02-... over its stub (one insertText,
  as a paste would), saves, runs every cell again, and sees every grader print "passed"
  (lab 02's graders also draw the learner's timeline beside torch DDP's); the saved
  notebook holds exactly the solution's source.

Skipped without Playwright or Chromium, except with CI=true. It runs in the session's shared
JupyterLab and Chromium (the ``browsing`` fixture in tests/conftest.py).
"""
import shutil

import nbformat
import pytest
from _browser import ARTIFACTS, KERNEL_IDLE_JS, ROOT, notebook_errors, open_notebook, run_all_cells, save_screenshots

from ddplab.course import exercises

pytestmark = pytest.mark.timeout(240)
LABS = ["02-average-gradients-vs-ddp.ipynb",
        pytest.param("11-sharded-optimizer.ipynb", marks=pytest.mark.more),
        pytest.param("12-fsdp.ipynb", marks=pytest.mark.more)]
DRAWS = {"02-average-gradients-vs-ddp.ipynb"}  # graders that draw the learner's timeline
# cells that use the exercise's result (found by what they call: cell ids change as labs are edited)
USES = "checks.yours_or_ours("
CELLS = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell"


def cut_down(nb):
    """Markdown, the set-up cell, stubs, graders and the cells that use what was written."""
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    nb.cells = [c for c in nb.cells if c.cell_type == "markdown" or c is first_code
                or USES in c.source or exercises.role(c)]
    return nb


def write_exercise(root, name):
    ex = cut_down(nbformat.read(str(ROOT / "labs" / "exercises" / name), as_version=4))
    # a file per lab: the server keeps a kernel per path, and each lab gets a fresh one
    nbformat.write(ex, str(root / f"exercise-{name[:2]}.ipynb"))
    solutions = {c.id: c.source for c in nbformat.read(str(ROOT / "labs" / name), as_version=4).cells
                 if exercises.role(c) == "solution"}
    return ex, solutions


def cell_text(page, index) -> str:
    return page.locator(CELLS).nth(index).locator(".jp-OutputArea").inner_text()


@pytest.mark.parametrize("name", LABS)
def test_an_exercise_fails_untouched_then_passes_filled_in(browsing, name):
    lab, root = browsing.lab, browsing.root
    ex, solutions = write_exercise(root, name)
    stubs = [i for i, c in enumerate(ex.cells) if exercises.role(c) == "solution"]
    graders = [i for i, c in enumerate(ex.cells) if exercises.role(c) == "grader"]
    users = [i for i, c in enumerate(ex.cells) if USES in c.source]
    assert len(stubs) == len(graders) >= 1 and len(users) in (0, len(graders))
    with browsing.page(height=2400) as page:
        try:
            open_notebook(page, lab, f"exercise-{name[:2]}.ipynb")
            # untouched: every cell runs (the failed checks do not stop Run All)
            run_all_cells(page, timeout_s=60)
            for i in graders:
                assert "CheckFailed: not implemented yet" in cell_text(page, i), cell_text(page, i)
            for i in users:
                assert "ddplab's own" in cell_text(page, i), cell_text(page, i)
            save_screenshots(page, f"browser-exercise-{name[:2]}-untouched")

            for i in stubs:  # the learner replaces each stub with their code
                page.locator(CELLS).nth(i).locator(".cm-content").click()
                page.keyboard.press("Control+A")
                page.keyboard.insert_text(solutions[ex.cells[i].id])
                page.keyboard.press("Escape")
            page.keyboard.press("Control+S")
            run_all_cells_again(page, timeout_s=90)
            assert notebook_errors(page) == []
            for i in graders:
                assert "passed" in cell_text(page, i), cell_text(page, i)
                if name in DRAWS:  # the learner's timeline beside torch DDP's, drawn by plotly
                    assert page.locator(CELLS).nth(i).locator(".js-plotly-plot .barlayer").count() >= 1
            for i in users:
                assert "ddplab's own" not in cell_text(page, i)
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator(CELLS).nth(graders[-1]).screenshot(
                path=str(ARTIFACTS / f"browser-exercise-passed-{name[:2]}.png"))
            saved = nbformat.read(str(root / f"exercise-{name[:2]}.ipynb"), as_version=4)
            assert [saved.cells[i].source for i in stubs] == [solutions[ex.cells[i].id] for i in stubs]
            assert page.errors == []
        finally:
            shots = save_screenshots(page, f"browser-exercise-{name[:2]}")
            shutil.copy(lab.log_path, shots[0].parent / f"browser-exercise-{name[:2]}-jupyterlab.log")


PROMPTS_JS = "[...document.querySelectorAll('%s .jp-InputPrompt')].map(p => p.textContent)" % (
    ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell")


def run_all_cells_again(page, timeout_s):
    """Run All once more and wait until every code cell has run again (a higher number)."""
    numbers = [int(n) for n in page.evaluate("() => " + PROMPTS_JS + ".join(' ')").replace(
        "[", " ").replace("]", " ").replace(":", " ").split() if n.isdigit()]
    run_all_cells(page, timeout_s=timeout_s)
    page.wait_for_function(
        """(last) => { const ps = %s;
                       return ps.every(p => { const m = /\\[(\\d+)\\]/.exec(p);
                                              return m !== null && +m[1] > last; }); }""" % PROMPTS_JS,
        arg=max(numbers), timeout=timeout_s * 1000)
    page.wait_for_function(KERNEL_IDLE_JS, timeout=timeout_s * 1000)
