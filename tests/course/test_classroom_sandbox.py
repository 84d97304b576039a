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
   (MemoryError: the sandbox's limit), the `sleep` is gone, the folder the cells made in /tmp
   is gone, and the scores are right: sbxann full marks, sbxbob 0.
5. Where cgroup v1 is writable: the hub starts sbxann's server (its API, no browser), which
   serves no Formgrader (404); the server runs in sbxann's groups with the class's limits; a
   CPU burner of sbxann's in those groups, in a session of its own, dies when the hub stops the
   server, and the groups go with it.
6. --delete-accounts refuses without --yes (no terminal to ask); with it, sbxbob's home is
   saved under course/saved-homes/ and no file in the class folder or /tmp (a folder sbxbob
   left there) keeps a deleted account's uid or gid.

Runs under make test-hub as root, from an environment other accounts can run (.venv-hub).
"""
import datetime
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import _classroom as room
import nbformat
import psutil
import pytest
from _browser import free_port

from ddplab.course import accounts, limits

pytestmark = [pytest.mark.slow, pytest.mark.hub, pytest.mark.skipif(
    not os.environ.get("DDPLAB_HUB_TEST"), reason="runs under make test-hub (DDPLAB_HUB_TEST=1)")]
LEARNERS = ("sbxann", "sbxbob")
INSTRUCTOR, GRADER = "sbxteach", "sbxteach-grader"
LAB = room.LAB
PROXY = room.ROOT / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
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
                             "--threads", "1", "--port", str(free_port()),
                             "--proxy", str(PROXY) if PROXY.exists() else sys.executable)
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
        assert not dest.exists(), "the grading account's folder in /tmp outlived the grading"
        # 5. a learner's server in their cgroups, and nothing of theirs left when it stops
        if set(limits.writable()) == set(limits.CONTROLLERS) and PROXY.exists():
            burner_dies_with_the_server(folder, "sbxann")
        # 6. the end of the class: asked first, homes saved, no file left to a freed uid
        uids = {pwd.getpwnam(n).pw_uid for n in [*LEARNERS, INSTRUCTOR, GRADER]}
        gids = {pwd.getpwnam(n).pw_gid for n in [*LEARNERS, INSTRUCTOR, GRADER]}
        # a learner's file left in /tmp: the end of the class gives it to root
        left_by = room.as_user("sbxbob", folder / "homes" / "sbxbob", sys.executable, "-c",
                               f"import os; os.makedirs({str(dest)!r})")
        assert left_by.returncode == 0, left_by.stderr
        asked = room.classroom(folder, "--delete-accounts")
        assert asked.returncode != 0 and "add --yes to confirm" in asked.stderr, asked.stderr
        assert accounts.exists("sbxann")
        done = room.classroom(folder, "--delete-accounts", "--yes")
        assert done.returncode == 0, done.stderr
        saved = course / "saved-homes" / "sbxbob" / LAB / f"{LAB}.ipynb"
        assert "6011" in saved.read_text(), "sbxbob's own notebook was not saved"
        owned = [str(p) for p in [folder, dest, *folder.rglob("*"), *dest.rglob("*")]
                 if p.lstat().st_uid in uids or p.lstat().st_gid in gids]
        assert not owned, f"files left to deleted accounts' ids: {owned[:5]}"
        assert dest.stat().st_uid == 0  # the learner's folder in /tmp: root's now
        assert not list(limits.BASE.glob(f"*/ddplab/{limits.class_name(folder)}")), "the class's cgroups were left"
    finally:
        room.classroom(folder, "--delete-accounts", "--yes")
        room.restore_modes(modes)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
    assert not [n for n in [*LEARNERS, INSTRUCTOR, GRADER] if accounts.exists(n)], "accounts left behind"
    assert not list(Path("/etc/sudoers.d").glob("ddplab-*ddplab-sandbox-test-*")), "a sudo rule left behind"


def burner_dies_with_the_server(folder, user):
    """The hub (started here, no browser) starts ``user``'s server; a burner joins it; the hub stops it."""
    token = "sbx" + os.urandom(8).hex()
    config = folder / "jupyterhub_config.py"
    port = free_port()
    text = re.sub(r"c.JupyterHub.port = \d+", f"c.JupyterHub.port = {port}", config.read_text())
    config.write_text(text + f"\nc.JupyterHub.services.append({{'name': 'test', 'api_token': {token!r}}})\n"
                      "c.JupyterHub.load_roles.append({'name': 'test', 'scopes': ['admin:servers', "
                      "'read:users', 'list:users', 'access:servers'], 'services': ['test']})\n")

    def api(path, method="GET"):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/hub/api{path}", method=method,
                                     headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
            return json.loads(body) if body else None

    def until(predicate, timeout_s, what):
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                if predicate():
                    return
            except OSError:
                pass
            time.sleep(0.5)
        pytest.fail(f"{what}:\n{(folder / 'hub.log').read_text()[-3000:]}")

    cls, uid = limits.class_name(folder), pwd.getpwnam(user).pw_uid
    with open(folder / "hub.log", "w") as log:
        hub = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", "jupyterhub_config.py"], cwd=folder,
                               env=room.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    burner = None
    try:
        until(lambda: api("/users") is not None, 120, "the hub did not answer")
        api(f"/users/{user}/server", "POST")
        until(lambda: api(f"/users/{user}")["servers"].get("", {}).get("ready"), 180, "the server did not start")
        members = limits.members(cls, user)
        assert members and set(accounts.processes_of(uid)) <= members, (members, accounts.processes_of(uid))
        lab = urllib.request.Request(f"http://127.0.0.1:{port}/user/{user}/api/status",
                                     headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(lab, timeout=30) as r:
            assert r.status == 200  # the learner's server answers the token ...
        lab.full_url = f"http://127.0.0.1:{port}/user/{user}/formgrader"
        with pytest.raises(urllib.error.HTTPError) as no:
            urllib.request.urlopen(lab, timeout=30)
        assert no.value.code == 404  # ... but serves no Formgrader to a learner
        memory = limits.BASE / "memory" / "ddplab" / cls / user / "memory.limit_in_bytes"
        assert int(memory.read_text()) == 3 << 30  # --mem-gib's default

        def learners_own():  # as a nohup'ed cell would be: in their groups, a session of its own
            limits.join(cls, user)
            os.setsid()
            os.setgid(uid)
            os.setuid(uid)

        burner = subprocess.Popen(["sh", "-c", "while :; do :; done"], preexec_fn=learners_own)
        until(lambda: burner.pid in limits.members(cls, user), 10, "the burner is not in the groups")
        api(f"/users/{user}/server", "DELETE")
        until(lambda: burner.poll() is not None, 60, "the burner outlived the server")
        assert not [g for g in limits.groups(cls, user) if g.exists()], "the learner's groups were left"
    finally:
        if burner is not None and burner.poll() is None:
            burner.kill()
        hub.send_signal(signal.SIGTERM)
        try:
            hub.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(hub.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        hub.wait(timeout=10)
