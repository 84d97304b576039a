"""Exercise notebooks are nbgrader's output for the labs, in step with them; untouched, their graders fail.

The in-step check is static (no kernel): run nbgrader's generate_assignment on every lab and
compare its notebooks with labs/exercises/ byte for byte. The last test runs only what the
graders need (the set-up cell, the stub cells and the grader cells) in a real kernel, and
expects every grader to fail with "not implemented yet" rather than a traceback from inside
ddplab. Budget: ~1 minute.
"""
import nbformat
import pytest
from _kernel import execute, running_kernel

from ddplab.course import exercises

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

LABS = exercises.LABS


@pytest.mark.slow
def test_every_exercise_is_byte_for_byte_what_nbgrader_generates_from_its_lab():
    assert exercises.out_of_step() == [], "run: python -m ddplab.course.exercises"
    assert len(exercises.pairs()) >= 4


def test_labs_are_nbgrader_source_notebooks_with_a_grader_after_each_solution():
    for sol, _ in exercises.pairs():
        cells = nbformat.read(str(sol), as_version=4).cells
        roles = [exercises.role(c) for c in cells]
        assert "solution" in roles and "grader" in roles, sol.name
        ids = [c.metadata.nbgrader["grade_id"] for c in cells if exercises.role(c)]
        assert len(ids) == len(set(ids)), sol.name
        for cell, r in zip(cells, roles):
            if r is None:
                assert "nbgrader" not in cell.metadata and exercises.BEGIN not in cell.source
                continue
            meta = cell.metadata.nbgrader
            assert meta["schema_version"] == 3 and cell.cell_type == "code"
            if r == "solution":
                assert exercises.BEGIN in cell.source and exercises.END in cell.source
                assert not meta["grade"] and not meta["locked"]
            else:
                assert meta["points"] > 0 and meta["locked"] and not meta["solution"]
            # the old tags are gone: nbgrader's metadata is the one source
            assert not {"solution", "grader", "raises-exception"} & set(exercises.tags(cell))
        # the first exercise's grader comes after its solution
        assert roles.index("solution") < roles.index("grader"), sol.name


def test_each_exercise_has_stubs_and_graders_and_no_solution_left():
    from nbgrader.utils import compute_checksum

    for sol, ex in exercises.pairs():
        nb = nbformat.read(str(ex), as_version=4)
        stubs = [c for c in nb.cells if exercises.role(c) == "solution"]
        graders = [c for c in nb.cells if exercises.role(c) == "grader"]
        assert stubs and graders, ex.name
        assert all(exercises.STUB in c.source and exercises.BEGIN not in c.source for c in stubs)
        # "Run All" goes on past a failed grader (JupyterLab honours this tag)
        assert all("raises-exception" in exercises.tags(c) for c in graders)
        # nbgrader's checksums: autograde sees an untouched grader as untouched
        assert all(c.metadata.nbgrader["checksum"] == compute_checksum(c) for c in graders)
        assert all(c.metadata["editable"] is False for c in graders)
        assert nb.cells[1].id == exercises.HEADER_ID
        # says where the solution is, without a link that a learner's fetched folder cannot follow
        assert f"labs/{sol.name}" in nb.cells[1].source and f"](../{sol.name})" not in nb.cells[1].source
        assert all(c.get("outputs", []) == [] for c in nb.cells)


def _one_lab(labs, source, nbgrader):
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                                           "display_name": "Python 3"}})
    nb.cells = [nbformat.v4.new_markdown_cell("# Lab 42"), nbformat.v4.new_code_cell(source)]
    if nbgrader is not None:
        nb.cells[1].metadata["nbgrader"] = nbgrader
    (labs / "exercises").mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(labs / "42-x.ipynb"))


@pytest.mark.slow
def test_an_edited_lab_is_out_of_step_until_regenerated(tmp_path):
    labs = tmp_path / "labs"
    (labs / "exercises").mkdir(parents=True)
    sol, _ = exercises.pairs()[1]
    nb = nbformat.read(str(sol), as_version=4)
    nbformat.write(nb, str(labs / sol.name))
    exercises.write_all(labs)
    assert exercises.out_of_step(labs) == []
    cell = next(c for c in nb.cells if exercises.role(c) == "solution")
    cell.source = cell.source.replace("def ", "def renamed_", 1)
    nbformat.write(nb, str(labs / sol.name))
    assert any("differs" in p for p in exercises.out_of_step(labs))


@pytest.mark.slow
def test_stubbing_keeps_the_indentation_and_what_is_outside_the_markers(tmp_path):
    solution = {"solution": True, "grade": False, "locked": False, "grade_id": "f",
                "schema_version": 3, "task": False}
    labs = tmp_path / "labs"
    _one_lab(labs, "def f(x):\n    y = 1\n    # BEGIN SOLUTION\n    return x + y\n    # END SOLUTION",
             solution)
    (out,) = exercises.write_all(labs)
    cells = nbformat.read(str(out), as_version=4).cells
    assert [c.id for c in cells][1] == exercises.HEADER_ID
    assert cells[2].source == "def f(x):\n    y = 1\n    " + exercises.STUB
    # nbgrader refuses a solution region outside a solution cell, and an unclosed one
    _one_lab(labs, "x = 1\n# BEGIN SOLUTION\nx = 2\n# END SOLUTION", None)
    with pytest.raises(ValueError, match="non-solution cell"):
        exercises.write_all(labs)
    _one_lab(labs, "# BEGIN SOLUTION\nx = 2", solution)
    with pytest.raises(ValueError, match="no end solution"):
        exercises.write_all(labs)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_untouched_exercises_fail_their_graders_with_not_implemented_yet():
    with running_kernel() as (km, kc):
        start = execute(kc, "import ddplab\ncluster = ddplab.Cluster(world_size=2)", timeout=120)
        assert start["status"] == "ok", start["traceback"]
        for _, ex in exercises.pairs():
            nb = nbformat.read(str(ex), as_version=4)
            code = [c for c in nb.cells if c.cell_type == "code"]
            # the set-up cell's imports; its Cluster is the one above, shared by the notebooks
            # (a set-up cell written differently simply runs as it is)
            source = code[0].source
            for spelling in ("cluster = ddplab.Cluster(world_size=2)",
                             "cluster = ddplab.Cluster(ddplab.lab_world_size())"):
                source = source.replace(spelling, "")
            setup = execute(kc, source, timeout=120)
            assert setup["status"] == "ok", (ex.name, setup["traceback"])
            for cell in code:
                if exercises.role(cell) == "solution":
                    assert execute(kc, cell.source)["status"] == "ok"
                elif exercises.role(cell) == "grader":
                    out = execute(kc, cell.source, timeout=120)
                    assert out["ename"] == "CheckFailed", (ex.name, cell.id, out["traceback"][-2000:])
                    assert out["evalue"].startswith("not implemented yet"), (ex.name, out["evalue"])
        execute(kc, "cluster.shutdown()")
