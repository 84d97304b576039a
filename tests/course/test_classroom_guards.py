"""The class's guards, each on its own, without accounts or a hub (the real class runs in
tests/course/test_classroom_hub.py under make test-hub).

- collect's refusal: a submission written by another account than the learner it names, or
  dated in the future, is refused with words that name both; nbgrader's due-date rule is kept.
- the grading sandbox takes back only outputs: a sandbox that rewrites a grader cell's source
  or metadata changes nothing of them in the instructor's notebook.
- the course config a default class writes makes nbgrader's autograde use the sandbox and the
  guarded collect; the one-account class's does not (it has no grading account).
- the class says which limits this machine enforces, cgroups or rlimits, each named.
- the passwords file: 0600, a new file only.
- the end of a class copies homes with links as links and without opening a FIFO a learner left.
- the checkout closed to others but for what learners need: the package and labs/exercises
  stay, the solution notebooks, the tests and the git data are closed.
"""
import datetime
import os
import pathlib
import pwd
import shutil
import subprocess

import _classroom as room
import nbformat
import pytest

pytest.importorskip("nbgrader", reason="the classroom's tests need nbgrader (the [test] extra)")

from ddplab.course import classroom, exchange_guard, gradebox, safety

NOW = datetime.datetime(2026, 11, 27, 12, 0, tzinfo=datetime.timezone.utc)


def record(name, when):
    return {"username": name, "filename": f"{name}+00+x+y", "timestamp": when}


def test_collect_refuses_another_owner_and_a_future_date(tmp_path):
    me = pwd.getpwuid(os.getuid()).pw_name
    path = tmp_path / "sub"
    path.mkdir()
    said = exchange_guard.refusal(str(path), record("someoneelse", NOW.replace(tzinfo=None)), NOW)
    assert f"claims to be someoneelse's but was written by {me}: not collected" in said
    future = exchange_guard.refusal(str(path), record(me, datetime.datetime(2099, 1, 1)), NOW)
    assert "dated 2099-01-01 00:00:00 UTC, later than now: not collected" in future
    written = datetime.datetime.now(datetime.timezone.utc)  # its name's date agrees with when it was written
    assert exchange_guard.refusal(str(path), record(me, written.replace(tzinfo=None)), written) is None


def test_collect_keeps_nbgraders_due_date_rule():
    due = datetime.datetime(2026, 11, 27, 10)
    early, late = record("a", due - datetime.timedelta(hours=1)), record("a", due + datetime.timedelta(hours=1))
    assert exchange_guard.newest([early, late], None) is late
    assert exchange_guard.newest([early, late], due) is early
    assert exchange_guard.newest([late], due) is late  # nothing before it: the newest


def test_the_sandbox_sends_back_outputs_only(monkeypatch, tmp_path):
    nb = room.exercise()
    grader = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade"))
    source, meta = grader.source, dict(grader.metadata)

    def forged(user, request, wall_s, max_bytes, join=None):
        import json

        back = nbformat.reads(json.loads(request)["notebook"], as_version=4)
        for cell in back.cells:
            if cell.cell_type == "code":
                cell.source = "print('all passed')"
                cell.metadata["nbgrader"] = {"grade": False}
                cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran\n")]
        return nbformat.writes(back)

    monkeypatch.setattr(gradebox, "run_as", forged)
    monkeypatch.setattr(gradebox, "end_all", lambda user: None)  # no real account's processes ended here
    monkeypatch.chdir(tmp_path)  # nbgrader's default course root: the lock file goes there
    step = gradebox.SandboxedExecute(user="nobody")
    out, _ = step.preprocess(nb, {"metadata": {"path": str(tmp_path)}})
    mine = next(c for c in out.cells if c.id == grader.id)
    assert mine.source == source and dict(mine.metadata) == meta
    assert mine.outputs[0]["text"] == "ran\n"


def test_a_sandbox_that_changes_the_cells_grades_nothing(monkeypatch, tmp_path):
    nb = room.exercise()
    monkeypatch.setattr(gradebox, "run_as", lambda *a, **k: nbformat.writes(nbformat.v4.new_notebook()))
    monkeypatch.setattr(gradebox, "end_all", lambda user: None)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="other cells: graded nothing"):
        gradebox.SandboxedExecute(user="nobody").preprocess(nb, {"metadata": {"path": str(tmp_path)}})


def load(config_text, tmp_path):
    from traitlets.config.loader import PyFileConfigLoader

    (tmp_path / "nbgrader_config.py").write_text(config_text)
    return PyFileConfigLoader("nbgrader_config.py", path=str(tmp_path)).load_config()


def test_the_default_class_grades_in_the_sandbox_and_collects_guarded(tmp_path):
    from nbgrader.converters import Autograde
    from nbgrader.exchange import ExchangeFactory

    config = load(classroom.course_config(tmp_path, tmp_path / "x", grader="t-grader", mem_gib=3.0), tmp_path)
    steps = Autograde(config=config).autograde_preprocessors
    assert gradebox.SandboxedExecute in steps and len(steps) == len(Autograde().autograde_preprocessors)
    step = gradebox.SandboxedExecute(config=config)
    assert (step.user, step.memory_gib, step.timeout) == ("t-grader", classroom.GRADING_MIN_GIB,
                                                          classroom.CELL_TIMEOUT_S)
    assert ExchangeFactory(config=config).collect is exchange_guard.OwnedCollect
    trusted = load(classroom.course_config(tmp_path, tmp_path / "x"), tmp_path)
    assert gradebox.SandboxedExecute not in Autograde(config=trusted).autograde_preprocessors
    from nbconvert import HTMLExporter

    for each in (config, trusted):  # a submission's scripts never run in the instructor's browser
        assert HTMLExporter(config=each).sanitize_html is True


@pytest.mark.skipif(not shutil.which("visudo"), reason="visudo (sudo) is not installed")
def test_the_grading_sudo_rule_is_valid_and_names_the_sandbox_only(tmp_path):
    rule = gradebox.sudo_rule("teach", "teach-grader")
    (tmp_path / "rule").write_text(rule)
    check = subprocess.run(["visudo", "-c", "-f", str(tmp_path / "rule")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "teach ALL=(teach-grader) NOPASSWD:" in rule and rule.count("-m ddplab.course.gradebox") == 2


def test_the_checkout_closes_but_for_what_learners_need(tmp_path):
    root = tmp_path / "src"
    for rel in ["pyproject.toml", "ddplab/__init__.py", "labs/00-x.ipynb", "labs/exercises/00-x.ipynb",
                "labs/tour.ipynb",
                "tests/_exercise_solutions.py", ".git/HEAD", ".venv/bin/python", "ddplab.egg-info/PKG"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    closed = safety.close_checkout(root, keep_inside=root / ".venv")

    def others(rel):
        return (root / rel).stat().st_mode & 0o007

    assert others(".") == 0o001  # passable, not listable
    for rel in ["labs/00-x.ipynb", "tests", ".git", "pyproject.toml"]:
        assert others(rel) == 0, rel
    for rel in ["ddplab", "labs/exercises", ".venv", "ddplab.egg-info"]:
        assert others(rel) == 0o005, rel
    assert others("labs/tour.ipynb") == 0o004  # not a solution notebook
    assert others("labs") == 0o001
    assert str(root / "labs" / "00-x.ipynb") in closed
    assert safety.close_checkout(root, keep_inside=root / ".venv") == []  # closed stays closed
    site = tmp_path / "site-packages"
    (site / "ddplab").mkdir(parents=True)
    assert safety.close_checkout(site) == []  # an installed package: no checkout to close
    assert pathlib.Path(site).stat().st_mode & 0o005 == 0o005


def test_the_class_says_which_limits_this_machine_enforces(tmp_path):
    from ddplab.course import limits

    bare = limits.describe(3.0, 2, base=tmp_path)
    assert any("NOT per learner: 8 GiB of address space per process (RLIMIT_AS" in line for line in bare)
    assert any("may outlive their server" in line for line in bare)
    for controller in limits.CONTROLLERS:
        (tmp_path / controller).mkdir()
        (tmp_path / controller / "cgroup.procs").write_text("")
    full = limits.describe(3.0, 2, base=tmp_path)
    assert "memory: 3 GiB for all of a learner's processes together (cgroup v1 memory)" in full
    assert "CPU time: 2 CPU(s) per second per learner (cgroup v1 cpu quota)" in full
    assert "every process of a learner ends when their server stops (their cgroups)" in full
    assert not any("RLIMIT" in line for line in full)


def test_the_end_of_a_class_copies_homes_without_following_links_or_opening_fifos(tmp_path):
    from ddplab.course import teardown

    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / "lab.ipynb").write_text("{}")
    os.mkfifo(home / "trap")  # copying it would block forever
    (home / "shadow").symlink_to("/etc/shadow")  # copied as a link, never read
    skipped = teardown.skip(str(home), sorted(os.listdir(home)))
    assert skipped == {".cache", "trap"}
    shutil.copytree(home, tmp_path / "saved", symlinks=True, ignore=teardown.skip)
    assert (tmp_path / "saved" / "shadow").is_symlink() and (tmp_path / "saved" / "lab.ipynb").is_file()
    me = os.getuid()
    assert teardown.disown({me}, set(), me, [tmp_path / "saved"]) == 3  # the folder, the notebook, the link
    assert teardown.setting("INSTRUCTOR = 'teach'\nX = 1\n", "INSTRUCTOR") == "teach"


@pytest.mark.more  # a classroom command (about 10 s here)
def test_the_passwords_file_is_its_owners_only_and_never_overwritten(tmp_path):
    out = room.classroom(tmp_path / "class", "--learners", "2", "--trusted-class", "--cpu-only", "--proxy",
                         shutil.which("true") or "/bin/true", "--passwords-file", str(tmp_path / "pw"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "pw").stat().st_mode & 0o777 == 0o600
    lines = (tmp_path / "pw").read_text().splitlines()
    assert len(lines) == 2 and all(v in out.stdout for line in lines for v in line.split()[1:])
    with pytest.raises(FileExistsError):
        classroom.write_private(tmp_path / "pw", "x")
    assert len((tmp_path / "pw").read_text().splitlines()) == 2
