"""Exercise notebooks are generated from the labs and in step with them; untouched, their graders fail.

The in-step check is static (no kernel): regenerate every labs/exercises/ notebook from its
lab and compare. The second test runs only what the graders need (the set-up cell, the stub
cells and the grader cells) in a real kernel, and expects every grader to fail with
"not implemented yet" rather than a traceback from inside ddplab. Budget: ~1 minute.
"""
import nbformat
import pytest

from _kernel import execute, running_kernel
from ddplab.course import exercises

LABS = exercises.LABS


def test_every_lab_has_an_exercise_twin_in_step_with_it():
    assert exercises.out_of_step() == [], "run: python -m ddplab.course.exercises"
    assert len(exercises.pairs()) >= 4


def test_each_exercise_has_stubs_and_graders_and_no_solution_left():
    for sol, ex in exercises.pairs():
        nb = nbformat.read(str(ex), as_version=4)
        stubs = [c for c in nb.cells if "solution" in exercises.tags(c)]
        graders = [c for c in nb.cells if "grader" in exercises.tags(c)]
        assert stubs and graders, ex.name
        assert all(exercises.STUB in c.source and exercises.BEGIN not in c.source for c in stubs)
        # "Run All" goes on past a failed grader (JupyterLab honours this tag)
        assert all("raises-exception" in exercises.tags(c) for c in graders)
        assert "raises-exception" not in str(nbformat.read(str(sol), as_version=4).cells)
        assert f"../{sol.name}" in nb.cells[1].source  # says where the solution is


def test_an_edited_lab_is_out_of_step_until_regenerated(tmp_path):
    labs = tmp_path / "labs"
    (labs / "exercises").mkdir(parents=True)
    sol, _ = exercises.pairs()[1]
    nb = nbformat.read(str(sol), as_version=4)
    nbformat.write(nb, str(labs / sol.name))
    exercises.write_all(labs)
    assert exercises.out_of_step(labs) == []
    cell = next(c for c in nb.cells if "solution" in exercises.tags(c))
    cell.source = cell.source.replace("def ", "def renamed_", 1)
    nbformat.write(nb, str(labs / sol.name))
    assert any("differs" in p for p in exercises.out_of_step(labs))


def test_stubbing_keeps_the_indentation_and_what_is_outside_the_markers():
    src = "def f(x):\n    y = 1\n    # BEGIN SOLUTION\n    return x + y\n    # END SOLUTION\n"
    assert exercises.stub_source(src) == "def f(x):\n    y = 1\n    " + exercises.STUB
    with pytest.raises(ValueError, match="without"):
        exercises.stub_source("# BEGIN SOLUTION\nx = 1\n")
    with pytest.raises(ValueError, match="no '# BEGIN SOLUTION'"):
        exercises.stub_source("x = 1\n")


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
                if "solution" in exercises.tags(cell):
                    assert execute(kc, cell.source)["status"] == "ok"
                elif "grader" in exercises.tags(cell):
                    out = execute(kc, cell.source, timeout=120)
                    assert out["ename"] == "CheckFailed", (ex.name, cell.id, out["traceback"][-2000:])
                    assert out["evalue"].startswith("not implemented yet"), (ex.name, out["evalue"])
        execute(kc, "cluster.shutdown()")
