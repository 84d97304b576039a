"""One source, two notebooks: each lab is an nbgrader source notebook, its exercise twin nbgrader's output.

``labs/NN-topic.ipynb`` is the complete notebook (nbval runs it in
``make test``) and an nbgrader *source* notebook: its cells carry
``metadata.nbgrader`` (schema 3). A solution cell (``solution: true``)
holds the learner's code, with the part the learner writes between two
marker lines::

    def my_average_gradients(model):
        # BEGIN SOLUTION
        ...
        # END SOLUTION

and the cell after it is its grader (``grade: true``, ``points``,
``locked: true``): autograded tests, in nbgrader's words.

``labs/exercises/NN-topic.ipynb`` is, byte for byte, what nbgrader's own
``generate_assignment`` writes for that notebook (run here in a course folder
under a temporary directory), configured by :func:`configure`:

- each solution region becomes ``raise NotImplementedError  # your code here``,
  indented like its marker (``ClearSolutions.code_stub``); nbgrader's default
  delimiter ``BEGIN SOLUTION`` is matched inside the line, so ddplab's
  ``# BEGIN SOLUTION`` markers are nbgrader's markers as they are;
- two small preprocessors of ddplab's own, run after nbgrader's: a header cell
  saying where the solution is, and the ``raises-exception`` tag on every
  grader, so that "Run All" in JupyterLab goes on past a failing check (the
  cells after it fall back to ddplab's own code). nbgrader has neither.

    python -m ddplab.course.exercises           # rewrite labs/exercises/ from labs/
    python -m ddplab.course.exercises --check   # exit 1 if they are not in step

An instructor's ``nbgrader_config.py`` calls ``configure(c)`` so that
``nbgrader generate_assignment`` in a course gives the same notebooks.

Leaves out: hidden tests (every check is visible to the learner), manually
graded answers and tasks. References: nbgrader's "Creating and grading
assignments" and its ``GenerateAssignment`` / ``ClearSolutions`` docs.
"""
from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

from nbconvert.preprocessors import Preprocessor
from traitlets import Bool

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
STUB = "raise NotImplementedError  # your code here"
LABS = pathlib.Path(__file__).resolve().parents[2] / "labs"
HEADER_ID = "exercise-header"
ASSIGNMENT = "exercises"  # the assignment the temporary course generates


def header(solution_name: str) -> str:
    return (f"> **Exercise version.** Cells with `{STUB}` are yours to write; the cell after "
            "each one grades it on the live ranks and names the mistake if there is one. "
            "If you skip an exercise, later cells use ddplab's own implementation and say so. "
            f"The complete notebook, with solutions, is `labs/{solution_name}` in a ddplab "
            "checkout (one folder up from this one there); in a class, your instructor has it.")


def tags(cell) -> list:
    return list(cell.get("metadata", {}).get("tags", []))


def role(cell) -> str | None:
    """``"solution"``, ``"grader"`` or None, from the cell's nbgrader metadata."""
    meta = cell.get("metadata", {}).get("nbgrader", {})
    if meta.get("solution"):
        return "solution"
    if meta.get("grade"):
        return "grader"
    return None


class ExerciseHeader(Preprocessor):
    """Inserts the header cell (after the title) that points at the solution notebook."""

    enabled = Bool(True).tag(config=True)  # nbgrader registers its preprocessors disabled

    def preprocess(self, nb, resources):
        import nbformat

        note = nbformat.v4.new_markdown_cell(header(resources["unique_key"] + ".ipynb"))
        note.id = HEADER_ID
        nb.cells.insert(1 if nb.cells and nb.cells[0].cell_type == "markdown" else 0, note)
        return nb, resources


class GradersRaise(Preprocessor):
    """Tags every grader ``raises-exception``: JupyterLab's Run All then goes on past it."""

    enabled = Bool(True).tag(config=True)

    def preprocess_cell(self, cell, resources, index):
        if role(cell) == "grader" and "raises-exception" not in tags(cell):
            cell.metadata["tags"] = tags(cell) + ["raises-exception"]
        return cell, resources


def configure(c):
    """Sets ddplab's stub and preprocessors on an nbgrader ``Config`` ``c``; returns ``c``."""
    from nbgrader.converters import GenerateAssignment

    c.ClearSolutions.code_stub = {"python": STUB}
    c.ClearSolutions.begin_solution_delimeter = BEGIN  # nbgrader's spelling ("delimeter")
    c.ClearSolutions.end_solution_delimeter = END
    nbgraders_own = GenerateAssignment.class_traits()["preprocessors"].default()
    c.GenerateAssignment.preprocessors = list(nbgraders_own) + [ExerciseHeader, GradersRaise]
    return c


def pairs(labs: pathlib.Path = LABS):
    """``(solution path, exercise path)`` for every numbered lab."""
    return [(p, labs / "exercises" / p.name) for p in sorted(labs.glob("[0-9][0-9]-*.ipynb"))]


def generate(labs: pathlib.Path, out: pathlib.Path) -> list:
    """Runs nbgrader's generate_assignment on the labs; writes its notebooks into ``out``."""
    try:
        from nbgrader.converters import GenerateAssignment
        from nbgrader.coursedir import CourseDirectory
        from nbgrader.utils import capture_log
        from traitlets.config import Config
    except ImportError as e:
        raise SystemExit(f"{e}: nbgrader is needed; pip install -c constraints.txt -e '.[test]'")
    with tempfile.TemporaryDirectory(prefix="ddplab-nbgrader-") as tmp:
        course = pathlib.Path(tmp)
        source = course / "source" / ASSIGNMENT
        source.mkdir(parents=True)
        for sol, _ in pairs(labs):
            shutil.copyfile(sol, source / sol.name)
        c = configure(Config())
        c.CourseDirectory.root = str(course)
        c.CourseDirectory.assignment_id = ASSIGNMENT
        c.Application.log_level = "WARN"
        # `nbgrader generate_assignment --no-db`: the notebooks are the same, and no gradebook
        # (nbgrader's gradebook runs the `alembic` command, found only on an activated PATH)
        c.SaveCells.enabled = False
        c.GenerateAssignment.no_database = True
        app = GenerateAssignment(coursedir=CourseDirectory(config=c), config=c)
        app.force = True
        result = capture_log(app)
        if not result["success"]:
            raise ValueError("nbgrader generate_assignment failed on labs/:\n"
                             + result.get("log", "") + result.get("error", ""))
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for sol, _ in pairs(labs):
            (out / sol.name).write_bytes((course / "release" / ASSIGNMENT / sol.name).read_bytes())
            written.append(out / sol.name)
        return written


def write_all(labs: pathlib.Path = LABS) -> list:
    return generate(labs, labs / "exercises")


def out_of_step(labs: pathlib.Path = LABS) -> list:
    """What differs, byte for byte, between labs/exercises/ and what nbgrader generates now."""
    with tempfile.TemporaryDirectory() as tmp:
        problems = []
        for fresh in generate(labs, pathlib.Path(tmp)):
            have = labs / "exercises" / fresh.name
            if not have.exists():
                problems.append(f"{have.relative_to(labs.parent)} is missing")
            elif have.read_bytes() != fresh.read_bytes():
                problems.append(f"{have.relative_to(labs.parent)} differs from what nbgrader generates")
        return problems


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--check" in argv:
        problems = out_of_step()
        for p in problems:
            print(p)
        if problems:
            print("run: python -m ddplab.course.exercises   (regenerates labs/exercises/ from labs/)")
        return 1 if problems else 0
    for path in write_all():
        print("wrote", path.relative_to(LABS.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
