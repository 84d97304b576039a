"""One source, two notebooks: each lab is its own solution, and its exercise twin is generated.

``labs/NN-topic.ipynb`` is the complete notebook (nbval runs it in
``make test``). Cells tagged ``solution`` hold the learner's code, with the
part the learner writes between two marker lines::

    def my_average_gradients(model):
        # BEGIN SOLUTION
        ...
        # END SOLUTION

``labs/exercises/NN-topic.ipynb`` is the same notebook with every such part
replaced by ``raise NotImplementedError`` (indented like the marker), no
outputs, a first cell saying where the solution is, and every cell tagged
``grader`` also tagged ``raises-exception``, so that "Run All" goes on past a
failing check (the cells after it fall back to ddplab's own code).

    python -m ddplab.course.exercises           # rewrite labs/exercises/ from labs/
    python -m ddplab.course.exercises --check   # exit 1 if they are not in step

Leaves out: hidden tests and points (nbgrader does those); a solution cell
is stubbed only between its markers, so what is outside them is shown to
the learner as given.
"""
from __future__ import annotations

import copy
import pathlib
import sys

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
STUB = "raise NotImplementedError  # your code here"
LABS = pathlib.Path(__file__).resolve().parents[2] / "labs"
HEADER_ID = "exercise-header"


def stub_source(source: str, where: str = "a cell") -> str:
    """``source`` with every BEGIN/END SOLUTION block replaced by an indented stub."""
    out, inside, found = [], None, 0
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            if inside is not None:
                raise ValueError(f"{where}: '{BEGIN}' inside another solution block")
            inside = line[: len(line) - len(line.lstrip())]
            out.append(inside + STUB)
            found += 1
        elif stripped == END:
            if inside is None:
                raise ValueError(f"{where}: '{END}' without '{BEGIN}'")
            inside = None
        elif inside is None:
            out.append(line)
    if inside is not None:
        raise ValueError(f"{where}: '{BEGIN}' without '{END}'")
    if not found:
        raise ValueError(f"{where} is tagged 'solution' but has no '{BEGIN}' ... '{END}' block")
    return "\n".join(out)


def header(solution_name: str) -> str:
    return (f"> **Exercise version.** Cells with `{STUB}` are yours to write; the cell after "
            "each one grades it on the live ranks and names the mistake if there is one. "
            "If you skip an exercise, later cells use ddplab's own implementation and say so. "
            f"The complete notebook, with solutions, is [`../{solution_name}`](../{solution_name}).")


def tags(cell) -> list:
    return list(cell.get("metadata", {}).get("tags", []))


def make_exercise(nb, solution_name: str):
    """The exercise twin of the solution notebook ``nb`` (an nbformat node)."""
    import nbformat

    ex = copy.deepcopy(nb)
    for i, cell in enumerate(ex.cells):
        t = tags(cell)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        if "solution" in t:
            cell.source = stub_source(cell.source, f"{solution_name} cell {i}")
        if "grader" in t and "raises-exception" not in t:
            cell.metadata["tags"] = t + ["raises-exception"]
    note = nbformat.v4.new_markdown_cell(header(solution_name))
    note.id = HEADER_ID
    ex.cells.insert(1 if ex.cells and ex.cells[0].cell_type == "markdown" else 0, note)
    return ex


def pairs(labs: pathlib.Path = LABS):
    """``(solution path, exercise path)`` for every numbered lab."""
    return [(p, labs / "exercises" / p.name) for p in sorted(labs.glob("[0-9][0-9]-*.ipynb"))]


def write_all(labs: pathlib.Path = LABS) -> list:
    import nbformat

    written = []
    for sol, ex in pairs(labs):
        ex.parent.mkdir(exist_ok=True)
        nbformat.write(make_exercise(nbformat.read(str(sol), as_version=4), sol.name), str(ex))
        written.append(ex)
    return written


def out_of_step(labs: pathlib.Path = LABS) -> list:
    """What differs between each exercise notebook and the one its solution generates."""
    import nbformat

    problems = []
    for sol, ex in pairs(labs):
        want = make_exercise(nbformat.read(str(sol), as_version=4), sol.name)
        if not ex.exists():
            problems.append(f"{ex.relative_to(labs.parent)} is missing")
            continue
        have = nbformat.read(str(ex), as_version=4)
        if len(have.cells) != len(want.cells):
            problems.append(f"{ex.name}: {len(have.cells)} cells, its solution gives {len(want.cells)}")
            continue
        for i, (h, w) in enumerate(zip(have.cells, want.cells)):
            if (h.cell_type, h.source, sorted(tags(h))) != (w.cell_type, w.source, sorted(tags(w))):
                problems.append(f"{ex.name} cell {i} differs from what {sol.name} gives")
            if h.cell_type == "code" and (h.outputs or h.execution_count is not None):
                problems.append(f"{ex.name} cell {i} has outputs (commit exercises without them)")
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
