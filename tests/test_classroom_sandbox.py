"""A class that cannot be gamed through nbgrader: the default class, its learners real Unix accounts.

No hub is started: the learners and the instructor run nbgrader as their own accounts (runuser),
as their servers' terminals would. Lab 00, two learners:

1. The ddplab checkout, read as a learner: ddplab imports and the exercise notebooks open; the
   solution notebooks, the tests and the git data do not, nor does the checkout's listing.
   The course's exchange folder exists before any learner could make it, the instructor's, so a
   learner cannot block the releases; the instructor releases lab 00, both learners fetch it.
2. sbxann fills in the solutions, sbxbob leaves the exercise; both notebooks carry a cell that
   copies every solution notebook of course/source and the gradebook to /tmp (and peeks into
   the other learner's home), and sbxbob's also starts a `sleep` in its own session and asks
   for 10 GiB. Both submit.
3. sbxbob forges a submission named for sbxann (dated after hers); sbxann one dated in 2099.
   collect refuses both, with ERROR lines naming who wrote them, and collects the real ones.
4. The instructor autogrades (plain `nbgrader autograde`, as the instructor, through sudo):
   nothing was copied, the cells ran as the grading account, the 10 GiB were refused
   (MemoryError: the sandbox's limit), the `sleep` is gone, and the scores are right:
   sbxann full marks, sbxbob 0.

Runs under make test-hub as root, from an environment other accounts can run (.venv-hub).
"""
import datetime
import os
import pwd
import shutil
import sys
import tempfile
import time
from pathlib import Path

import _classroom as room
import nbformat
import psutil
import pytest

from ddplab.course import accounts

pytestmark = [pytest.mark.slow, pytest.mark.hub, pytest.mark.skipif(
    not os.environ.get("DDPLAB_HUB_TEST"), reason="runs under make test-hub (DDPLAB_HUB_TEST=1)")]
LEARNERS = ("sbxann", "sbxbob")
INSTRUCTOR, GRADER = "sbxteach", "sbxteach-grader"
LAB = room.LAB
EXFIL = """import glob, os, shutil
os.makedirs({dest!r}, exist_ok=True)
for path in glob.glob({course!r} + '/source/*/*.ipynb') + [{course!r} + '/gradebook.db', *{paths!r}]:
    try:
        shutil.copy(path, {dest!r})
        print('COPIED', path)
    except OSError as e:
        print('refused', path, e.strerror)
print('uid', os.getuid(), 'in', os.getcwd())"""
AS_LEARNER = """import os, ddplab
print('IMPORTED', ddplab.__file__)
open({exercise!r}).read(1)
print('EXERCISE read')
for path in {closed!r}:
    try:
        os.listdir(path) if os.path.isdir(path) else open(path).read(1)
        print('READ', path)
    except PermissionError:
        print('closed', path)"""
GREEDY = """import subprocess
subprocess.Popen(['sleep', '6011'], start_new_session=True)
try:
    hog = bytearray(10 << 30)
    print('GOT 10 GiB')
except MemoryError:
    print('MemoryError: 10 GiB denied')"""


def require_accounts():
    why = accounts.can_create() or accounts.reachable(Path(sys.prefix)) or accounts.reachable(room.ROOT)
    if why:
        pytest.skip(f"learners as Unix accounts cannot be tested here: {why}")
    taken = [n for n in [*LEARNERS, INSTRUCTOR, GRADER] if accounts.exists(n)]
    if taken:
        pytest.fail(f"Unix accounts {taken} exist already: a leftover of an earlier run?")


def planted(user, folder, dest):
    nb = room.solved() if user == "sbxann" else room.exercise()
    other = [n for n in LEARNERS if n != user][0]
    paths = [str(folder / "course" / "source" / LAB / f"{LAB}.ipynb"),  # by name: course/ cannot be listed
             str(folder / "homes" / other / LAB / f"{LAB}.ipynb"),
             str(folder / "course" / "submitted" / other / LAB / f"{LAB}.ipynb")]
    cells = [EXFIL.format(dest=dest, course=str(folder / "course"), paths=paths)]
    if user == "sbxbob":
        cells.append(GREEDY)
    for k, src in enumerate(cells):
        cell = nbformat.v4.new_code_cell(src)
        cell.id = f"planted-{k}"
        nb.cells.insert(1 + k, cell)
    return nb


def forge(user, folder, claimed, stamp):
    """As ``user``: their own fetched assignment copied into inbound, named for ``claimed`` at ``stamp``."""
    home = folder / "homes" / user
    name = f"{claimed}+{LAB}+{stamp:%Y-%m-%d %H:%M:%S.%f} UTC+forged"
    code = (f"import shutil; shutil.copytree({str(home / LAB)!r}, "
            f"{str(folder / 'exchange' / 'ddplab' / 'inbound' / name)!r})")
    done = room.as_user(user, home, sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(900)
def test_graded_as_nobody_collected_only_from_its_owner_exchange_the_instructors():
    require_accounts()
    base = Path(tempfile.mkdtemp(prefix="ddplab-sandbox-test-"))
    base.chmod(0o755)
    folder, dest = base / "class", Path(tempfile.gettempdir()) / f"ddplab-exfil-{os.urandom(4).hex()}"
    modes = room.checkout_modes()
    try:
        roster = base / "roster.txt"
        roster.write_text("\n".join(LEARNERS) + "\n")
        out = room.classroom(folder, "--roster", str(roster), "--instructor", INSTRUCTOR, "--cpu-only",
                             "--threads", "1", "--proxy", sys.executable)
        assert out.returncode == 0, out.stderr
        course, exchange_course = folder / "course", folder / "exchange" / "ddplab"
        # 1. the checkout as a learner reads it
        closed = [str(room.ROOT), str(room.ROOT / "labs" / f"{LAB}.ipynb"), str(room.ROOT / "labs"),
                  str(room.ROOT / "tests" / "_exercise_solutions.py")]
        if (room.ROOT / ".git").is_dir():  # (a git worktree's data lies elsewhere: classroom warns)
            closed.append(str(room.ROOT / ".git" / "HEAD"))
        seen = room.as_user("sbxann", folder, sys.executable, "-c", AS_LEARNER.format(
            exercise=str(room.ROOT / "labs" / "exercises" / f"{LAB}.ipynb"), closed=closed),
            extra={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        assert seen.returncode == 0, seen.stderr
        assert "IMPORTED" in seen.stdout and "EXERCISE read" in seen.stdout, seen.stdout
        assert seen.stdout.count("closed ") == len(closed) and "READ" not in seen.stdout, seen.stdout
        # 1. the course's exchange folder is the instructor's before any release
        assert exchange_course.stat().st_uid == pwd.getpwnam(INSTRUCTOR).pw_uid
        assert exchange_course.stat().st_mode & 0o777 == 0o755
        blocked = room.as_user("sbxbob", folder, sys.executable, "-c",
                               f"import os; os.mkdir({str(exchange_course / 'inbound')!r})")
        assert "PermissionError" in blocked.stderr, blocked.stderr
        learner_env = {"JUPYTER_CONFIG_PATH": str(folder / "learner-config")}

        def nbgrader(user, *args):
            cwd = course if user == INSTRUCTOR else folder / "homes" / user
            done = room.as_user(user, cwd, sys.executable, "-m", "nbgrader", *args,
                                extra=None if user == INSTRUCTOR else learner_env)
            assert done.returncode == 0, f"{user}: nbgrader {args}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            return done.stdout + done.stderr

        nbgrader(INSTRUCTOR, "db", "student", "import", "roster.csv")
        nbgrader(INSTRUCTOR, "generate_assignment", LAB, "--force")
        nbgrader(INSTRUCTOR, "release_assignment", LAB, "--force")
        # 2. fetch, the planted cells, submit
        for user in LEARNERS:
            nbgrader(user, "fetch_assignment", LAB)
            fetched = folder / "homes" / user / LAB / f"{LAB}.ipynb"
            nbformat.write(planted(user, folder, str(dest)), fetched)
            shutil.chown(fetched, user, user)
            nbgrader(user, "submit", LAB)
        # 3. a submission in another's name, and one from the future
        later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=20)
        forge("sbxbob", folder, "sbxann", later)
        forge("sbxann", folder, "sbxann", datetime.datetime(2099, 1, 1))
        said = nbgrader(INSTRUCTOR, "collect", LAB)
        assert "claims to be sbxann's but was written by sbxbob: not collected" in said, said
        assert "dated 2099-01-01 00:00:00 UTC, later than now: not collected" in said, said
        assert said.count("REFUSED") == 2, said
        stamp = (course / "submitted" / "sbxann" / LAB / "timestamp.txt").read_text()
        assert not stamp.startswith("2099"), stamp
        collected = nbformat.read(course / "submitted" / "sbxann" / LAB / f"{LAB}.ipynb", as_version=4)
        assert "6011" not in str(collected)  # not bob's forgery
        # 4. autograde, as the instructor
        nbgrader(INSTRUCTOR, "autograde", LAB, "--force")
        left = sorted(os.listdir(dest)) if dest.exists() else []
        assert left == [], f"a submission copied these out during autograde: {left}"
        grader_uid = pwd.getpwnam(GRADER).pw_uid
        for user in LEARNERS:
            said = room.feedback(course, user)
            assert "COPIED" not in said, said
            assert f"uid {grader_uid} in {folder / 'homes' / GRADER}/grading-" in said, said
            # the solution by name, the gradebook, the other's home and submission (glob lists nothing)
            assert said.count("refused") == 4, said
        assert "MemoryError: 10 GiB denied" in room.feedback(course, "sbxbob")
        deadline = time.monotonic() + 10
        while accounts.processes_of(grader_uid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not accounts.processes_of(grader_uid), "the grading account still runs processes"
        assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "6011"]]
        scores = room.scores(course, list(LEARNERS))
        assert scores == {"sbxann": float(sum(room.points().values())), "sbxbob": 0.0}, scores
        assert not list((folder / "homes" / GRADER).glob("grading-*")), "the scratch folder was left"
    finally:
        room.classroom(folder, "--delete-accounts")
        room.restore_modes(modes)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
    assert not [n for n in [*LEARNERS, INSTRUCTOR, GRADER] if accounts.exists(n)], "accounts left behind"
    assert not list(Path("/etc/sudoers.d").glob("ddplab-*ddplab-sandbox-test-*")), "a sudo rule left behind"
