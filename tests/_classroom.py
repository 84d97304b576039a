"""The instructor's side of a class, as the classroom tests drive it: nbgrader on a course folder.

``make_room`` runs ``python -m ddplab classroom``; ``nbgrader`` runs what the instructor's README
says (students into the gradebook, generate the assignment, autograde the submissions found
under ``submitted/<student>/<assignment>/``) and ``scores`` reads each student's score from the
gradebook. nbgrader runs as a command, the way an instructor runs it; its gradebook migrations
run ``alembic``, which is found on PATH only, so the venv's bin goes first on PATH.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
LAB = "00-first-process-group"


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
                PYTHONUNBUFFERED="1")


def classroom(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddplab", "classroom", str(folder), *args],
                          capture_output=True, text=True, env=env(), timeout=300)


def make_room(folder: Path, *args: str) -> Path:
    out = classroom(folder, *args)
    assert out.returncode == 0, out.stderr
    return folder


def passwords(printed: str) -> dict:
    """name -> password from what `classroom` printed (the lines under "Passwords")."""
    found, table = {}, False
    for line in printed.splitlines():
        if line.startswith("Passwords"):
            table = True
        elif table and line.startswith("  ") and len(line.split()) == 2:
            name, password = line.split()
            found[name] = password
        elif table and line.startswith("Start"):
            break
    return found


def as_user(user: str, cwd: Path, *command: str, extra: dict | None = None, timeout=600):
    """``command`` run as the Unix account ``user`` (runuser) with a clean environment: HOME,
    PATH (the environment's bin first: nbgrader's gradebook runs `alembic`) and ``extra``."""
    import pwd

    home = pwd.getpwnam(user).pw_dir
    variables = {"HOME": home, "USER": user, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                 "PYTHONUNBUFFERED": "1", **(extra or {})}
    return subprocess.run(["runuser", "-u", user, "--", "env", "-i",
                           *(f"{k}={v}" for k, v in variables.items()), *command],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


def nbgrader(course: Path, *args: str, timeout=600) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, capture_output=True,
                         text=True, env=env(), timeout=timeout)
    assert out.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def exercise(lab: str = LAB):
    """The released exercise notebook (what `nbgrader fetch_assignment` gives a learner)."""
    return nbformat.read(ROOT / "labs" / "exercises" / f"{lab}.ipynb", as_version=4)


def solved(lab: str = LAB, changes=()):
    """The exercise with every solution cell written as the lab's solution; each (old, new) of
    ``changes`` edits the one solution cell that holds ``old``."""
    nb = exercise(lab)
    sources = {c.id: c.source for c in nbformat.read(ROOT / "labs" / f"{lab}.ipynb", as_version=4).cells}
    changed = dict.fromkeys((old for old, _ in changes), 0)
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("solution"):
            cell.source = sources[cell.id]
            for old, replacement in changes:
                if old in cell.source:
                    cell.source = cell.source.replace(old, replacement, 1)
                    changed[old] += 1
    missing = [old for old, n in changed.items() if n != 1]
    assert not missing, f"{missing!r}: not in exactly one solution cell of {lab}"
    return nb


def points(lab: str = LAB) -> dict:
    """grade_id -> points of every grader cell in the lab's source notebook."""
    nb = nbformat.read(ROOT / "labs" / f"{lab}.ipynb", as_version=4)
    return {c.metadata.nbgrader["grade_id"]: c.metadata.nbgrader["points"] for c in nb.cells
            if c.metadata.get("nbgrader", {}).get("grade")}


def submit(course: Path, student: str, nb, lab: str = LAB) -> None:
    """What `nbgrader collect` leaves: submitted/<student>/<assignment>/<notebook>."""
    folder = course / "submitted" / student / lab
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / f"{lab}.ipynb")


def scores(course: Path, students: list[str], lab: str = LAB) -> dict:
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        return {s: gb.find_submission(lab, s).score for s in students}


def feedback(course: Path, student: str, lab: str = LAB) -> str:
    """Every output text of the autograded notebook (what generate_feedback turns into HTML)."""
    nb = json.loads((course / "autograded" / student / lab / f"{lab}.ipynb").read_text())
    texts = []
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            texts.append("".join(out.get("text", "")) + out.get("evalue", "")
                         + "".join(out.get("traceback", [])))
    return "\n".join(texts)


def errors_outside_graders(course: Path, student: str, lab: str = LAB) -> list[str]:
    """"cell N: ErrorName" for each cell of the autograded notebook that raised and is not a
    grader (nbgrader's grade cells; a learner's slip is expected to fail those)."""
    nb = json.loads((course / "autograded" / student / lab / f"{lab}.ipynb").read_text())
    return [f"cell {i}: {out.get('ename')}: {out.get('evalue', '')[:200]}"
            for i, cell in enumerate(nb["cells"])
            if not cell.get("metadata", {}).get("nbgrader", {}).get("grade")
            for out in cell.get("outputs", []) if out.get("output_type") == "error"]


def checkout_modes() -> dict:
    """The modes a default class changes in the ddplab checkout (it closes the answers to other
    accounts), to put back after a test: the checkout, its entries and labs/'s entries."""
    paths = [ROOT, *ROOT.iterdir(), *(ROOT / "labs").iterdir()]
    return {p: p.lstat().st_mode & 0o7777 for p in paths if not p.is_symlink()}


def restore_modes(modes: dict) -> None:
    for path, mode in modes.items():
        if path.exists():
            path.chmod(mode)


def remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
