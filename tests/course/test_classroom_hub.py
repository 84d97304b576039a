"""A real JupyterHub from `python -m ddplab classroom`, safe by default: two learners, one of them an attacker.

The class is what the command writes without options about safety: each learner a Unix account of
their own (created here, deleted at the end), PAM log-in with the generated passwords, the course
folder the instructor's alone, grading as an account of its own. The hub runs on loopback with
configurable-http-proxy from `npm ci --prefix proxy`, jupyterhub-idle-culler, and a fake
nvidia-smi on the hub's PATH showing three idle GPUs, one per server (the learners' servers see
no nvidia-smi, so their ranks run gloo on CPU while CUDA_VISIBLE_DEVICES still says which GPU the
hub gave them). One class, start to end:

1. The ddplab checkout, read as a learner: ddplab imports and the exercise notebooks open; the
   solution notebooks, the tests and the git data do not, nor does the checkout's listing. The
   course's exchange folder is the instructor's before any release (a learner cannot block it).
2. The instructor releases lab 00; each learner fetches it (nbgrader, as that learner's account).
   Each notebook carries a planted cell that copies every solution notebook of course/source, the
   gradebook and the other learner's work to /tmp; learner02's also starts a `sleep` in a session
   of its own and asks for 10 GiB.
3. Log-in: a name not on the roster, a wrong password and an empty one are refused.
4. learner01 and learner02 log in through Chromium; their Nbgrader menu offers the Assignment List,
   not Formgrader or the Course List; the instructor's server serves Formgrader on the course.
5. Both run the Cluster cell, a %%ddp cell and lab 00's grader at the same time; each %%ddp output
   shows that learner's GPU, never the other's. learner01's notebook then tries to read learner02's
   home, the course's solutions and the gradebook: three PermissionErrors.
6. Where cgroup v1 is writable: learner02's server runs in learner02's groups with the class's
   memory limit and answers 404 for Formgrader; a CPU burner of learner02's in those groups, in a
   session of its own, dies when the hub stops the server, with the server's ranks and groups.
7. The hub is SIGKILLed: within 30 s no process of the class is left (proxy, culler, servers,
   kernels, ranks).
8. The learners submit; learner02 forges a submission named for learner01 (dated after hers),
   learner01 one dated in 2099: collect refuses both with ERROR lines naming who wrote them,
   collects the real ones, and never warns "cheating attempt".
9. The instructor autogrades (plain `nbgrader autograde`, as the instructor): nothing was copied,
   the cells ran as the grading account in its scratch folder, the 10 GiB were refused
   (MemoryError: the sandbox's limit), the `sleep` and what the cells made in /tmp are gone, and
   the scores are right: learner01 full marks, learner02 0.
10. --delete-accounts refuses without --yes (no terminal to ask); with it, learner02's home is
    saved under course/saved-homes/ and no file in the class folder or /tmp (a folder learner02
    left there) keeps a deleted account's uid or gid; the class's cgroups are gone.

Runs as root (CI does): where accounts cannot be created it fails under CI and skips elsewhere.
The environment must be runnable by other accounts (make test-hub builds .venv-hub from the
system's Python for that: a pyenv Python under /root is not).
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
from _browser import KERNEL_IDLE_JS, LAB_SETTINGS, chromium, free_port, in_ci, require_browser, run_cells

from ddplab.course import accounts, limits

pytestmark = [pytest.mark.slow, pytest.mark.hub, pytest.mark.skipif(
    not os.environ.get("DDPLAB_HUB_TEST"), reason="runs under make test-hub (DDPLAB_HUB_TEST=1)")]
PROXY = room.ROOT / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
LEARNERS = ("learner01", "learner02")
INSTRUCTOR = "instructor"
GRADER = f"{INSTRUCTOR}-grader"
DDP_CELLS = ["%load_ext ddplab\n%ddp_start 2 --backend gloo",
             "%%ddp\nimport os\n(rank, os.getpid(), os.environ['CUDA_VISIBLE_DEVICES'])"]
PEEK = """import os
for what, path in [('home', {home!r}), ('source', {source!r}), ('gradebook', {gradebook!r})]:
    try:
        os.listdir(path) if what == 'home' else open(path, 'rb').read(1)
        print('READ', what)
    except PermissionError as e:
        print('PermissionError', what, e.strerror)"""
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
DONE_JS = """([first, count]) => {
  const cells = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell')];
  const want = cells.slice(first, first + count).filter(c => c.classList.contains('jp-CodeCell'));
  return want.length > 0 && want.every(c => /\\[\\d+\\]/.test(c.querySelector('.jp-InputPrompt').textContent));
}"""
CELLS = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell"


def need(message):
    pytest.fail(message) if in_ci() else pytest.skip(message)


def require_accounts():
    why = accounts.can_create()
    if why is None:
        blocked = accounts.reachable(Path(sys.prefix)) or accounts.reachable(room.ROOT)
        if blocked:
            why = (f"the learners' accounts cannot enter {blocked}, on the way to {sys.prefix}: run "
                   "this test from an environment they can run (make test-hub builds .venv-hub)")
    if why:
        need(f"learners as Unix accounts cannot be tested here: {why}")
    taken = [n for n in [*LEARNERS, INSTRUCTOR, GRADER] if accounts.exists(n)]
    if taken:
        pytest.fail(f"Unix accounts {taken} exist already: a leftover of an earlier run? "
                    "(userdel --remove NAME as root, if they are)")


def notebook_for(user, folder, dest):
    """The learner's notebook: the planted cells first (autograde runs them; the browser does not),
    then after the Cluster cell the %%ddp cells the browser runs (and learner01's peek)."""
    nb = room.solved() if user == "learner01" else room.exercise()
    other = [n for n in LEARNERS if n != user][0]
    paths = [str(folder / "course" / "source" / room.LAB / f"{room.LAB}.ipynb"),  # by name: not listable
             str(folder / "homes" / other / room.LAB / f"{room.LAB}.ipynb"),
             str(folder / "course" / "submitted" / other / room.LAB / f"{room.LAB}.ipynb")]
    planted = [EXFIL.format(dest=str(dest), course=str(folder / "course"), paths=paths)]
    if user == "learner02":
        planted.append(GREEDY)
    for k, src in enumerate(planted):
        cell = nbformat.v4.new_code_cell(src)
        cell.id = f"planted-{k}"
        nb.cells.insert(1 + k, cell)
    first = next(i for i, c in enumerate(nb.cells) if "ddplab.Cluster(" in c.source)
    extra = [nbformat.v4.new_code_cell(src) for src in DDP_CELLS]
    if user == "learner01":
        course = folder / "course"
        extra.append(nbformat.v4.new_code_cell(PEEK.format(
            home=str(folder / "homes" / "learner02"), gradebook=str(course / "gradebook.db"),
            source=str(course / "source" / room.LAB / f"{room.LAB}.ipynb"))))
    for k, cell in enumerate(extra):
        cell.id = f"hub-test-{k}"
    nb.cells[first + 1:first + 1] = extra
    return nb, first


def forge(user, folder, claimed, stamp):
    """As ``user``: their own fetched assignment copied into inbound, named for ``claimed`` at ``stamp``."""
    home = folder / "homes" / user
    name = f"{claimed}+{room.LAB}+{stamp:%Y-%m-%d %H:%M:%S.%f} UTC+forged"
    code = (f"import shutil; shutil.copytree({str(home / room.LAB)!r}, "
            f"{str(folder / 'exchange' / 'ddplab' / 'inbound' / name)!r})")
    done = room.as_user(user, home, sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr


def api(url, token, path, method="GET", server=False):
    full = f"{url}{path}" if server else f"{url}/hub/api{path}"
    req = urllib.request.Request(full, method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read()
        return body.decode() if server else (json.loads(body) if body else None)


def log_in(browser, url, user, password):
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    page.goto(f"{url}/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", password)
    page.click("#login_submit")
    return page


def refused(browser, url, user, password):
    page = log_in(browser, url, user, password)
    page.wait_for_selector("text=Invalid username or password", timeout=30_000)
    assert "/hub/login" in page.url and "/user/" not in page.url, page.url
    page.context.close()


def wait_done(page, user, first, count, timeout_s=240):
    """Wait until the code cells first..first+count-1 ran; if they do not, say what each shows."""
    try:
        page.wait_for_function(DONE_JS, arg=[first, count], timeout=timeout_s * 1000)
    except Exception:
        cells = page.locator(CELLS)
        shown = [f"cell {i}: {cells.nth(i).inner_text()[-600:]!r}" for i in range(first, first + count)]
        pytest.fail(f"{user}'s cells {first}..{first + count - 1} did not all run in {timeout_s} s:\n"
                    + "\n".join(shown))


def nbgrader_menu(page):
    page.locator(".lm-MenuBar-itemLabel", has_text="Nbgrader").click()
    items = page.locator(".lm-Menu-itemLabel").all_inner_texts()
    page.keyboard.press("Escape")
    return [i.strip() for i in items if i.strip()]


def class_processes(hub_pid, uids):
    """Every process the hub started (its descendants) and every process of a learner's uid."""
    found = set()
    try:
        found |= {(p.pid, p.create_time()) for p in psutil.Process(hub_pid).children(recursive=True)}
    except psutil.Error:
        pass
    for p in psutil.process_iter(["uids", "create_time"]):
        if p.info["uids"] and p.info["uids"].real in uids:
            found.add((p.pid, p.info["create_time"]))
    return found


def alive(procs):
    left = []
    for pid, created in procs:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            pass
    return left


@pytest.mark.timeout(900)
def test_a_safe_class_start_to_end_on_a_real_hub_with_an_attacker():
    chromium_path = require_browser()
    if not PROXY.exists():
        need("configurable-http-proxy is missing: npm ci --prefix proxy (make test-hub does it)")
    require_accounts()
    start = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="ddplab-hub-test-"))
    base.chmod(0o755)  # the learners' accounts walk through it to their homes
    folder, hub, log = base / "class", None, None
    dest = Path(tempfile.gettempdir()) / f"ddplab-exfil-{os.urandom(4).hex()}"  # where the planted cells copy to
    modes = room.checkout_modes()  # the class closes the checkout's answers to other accounts
    try:
        roster = base / "roster.txt"
        roster.write_text("\n".join(LEARNERS) + "\n")
        out = room.classroom(folder, "--roster", str(roster), "--instructor", INSTRUCTOR,
                             "--gpus-per-learner", "1", "--threads", "1", "--port", str(free_port()),
                             "--idle-timeout", "600", "--proxy", str(PROXY))
        assert out.returncode == 0, out.stderr
        passwords = room.passwords(out.stdout)
        assert set(passwords) == {*LEARNERS, INSTRUCTOR}, out.stdout
        assert "learner01" in (folder / "accounts.txt").read_text()
        for user in LEARNERS:
            assert (folder / "homes" / user).stat().st_mode & 0o777 == 0o700
        course, exchange_course = folder / "course", folder / "exchange" / "ddplab"
        assert course.stat().st_mode & 0o777 == 0o700
        # 1. the checkout as a learner reads it; the exchange is the instructor's before any release
        closed = [str(room.ROOT), str(room.ROOT / "labs" / f"{room.LAB}.ipynb"), str(room.ROOT / "labs"),
                  str(room.ROOT / "tests" / "_exercise_solutions.py")]
        if (room.ROOT / ".git").is_dir():  # (a git worktree's data lies elsewhere: classroom warns)
            closed.append(str(room.ROOT / ".git" / "HEAD"))
        seen = room.as_user("learner01", folder, sys.executable, "-c", AS_LEARNER.format(
            exercise=str(room.ROOT / "labs" / "exercises" / f"{room.LAB}.ipynb"), closed=closed),
            extra={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        assert seen.returncode == 0, seen.stderr
        assert "IMPORTED" in seen.stdout and "EXERCISE read" in seen.stdout, seen.stdout
        assert seen.stdout.count("closed ") == len(closed) and "READ" not in seen.stdout, seen.stdout
        assert exchange_course.stat().st_uid == pwd.getpwnam(INSTRUCTOR).pw_uid
        assert exchange_course.stat().st_mode & 0o777 == 0o755
        blocked = room.as_user("learner02", folder, sys.executable, "-c",
                               f"import os; os.mkdir({str(exchange_course / 'inbound')!r})")
        assert "PermissionError" in blocked.stderr, blocked.stderr
        token = "hubtest" + os.urandom(8).hex()
        with open(folder / "jupyterhub_config.py", "a") as f:  # the test's own admin token
            f.write(f"\nc.JupyterHub.services.append({{'name': 'test', 'api_token': {token!r}}})\n"
                    "c.JupyterHub.load_roles.append({'name': 'test', 'scopes': ['admin:users', "
                    "'admin:servers', 'list:users', 'read:users', 'access:servers'], "
                    "'services': ['test']})\n")
        learner_env = {"JUPYTER_CONFIG_PATH": str(folder / "learner-config")}

        def nbgrader(user, *args):
            cwd = course if user == INSTRUCTOR else folder / "homes" / user
            done = room.as_user(user, cwd, sys.executable, "-m", "nbgrader", *args,
                                extra=None if user == INSTRUCTOR else learner_env)
            assert done.returncode == 0, f"{user}: nbgrader {args}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            return done.stdout + done.stderr

        # 2. release, fetch, the planted notebooks
        nbgrader(INSTRUCTOR, "db", "student", "import", "roster.csv")
        nbgrader(INSTRUCTOR, "generate_assignment", room.LAB, "--force")
        nbgrader(INSTRUCTOR, "release_assignment", room.LAB, "--force")
        firsts, notebooks = {}, {}
        for user in LEARNERS:
            nbgrader(user, "fetch_assignment", room.LAB)
            home = folder / "homes" / user
            fetched = home / room.LAB / f"{room.LAB}.ipynb"
            assert "raise NotImplementedError" in fetched.read_text()  # the exercise, not the solution
            notebooks[user], firsts[user] = notebook_for(user, folder, dest)
            nbformat.write(notebooks[user], fetched)
            # every cell stays in the page (JupyterLab's windowing would leave far cells unrendered)
            settings = home / ".jupyter" / "lab" / "user-settings"
            for rel, content in LAB_SETTINGS.items():
                (settings / rel).parent.mkdir(parents=True, exist_ok=True)
                (settings / rel).write_text(json.dumps(content))
            subprocess.run(["chown", "-R", f"{user}:{user}", str(home)], check=True)
        fakebin = base / "fakebin"
        fakebin.mkdir()
        from test_classroom import fake_smi
        fake_smi(fakebin, 3)  # one GPU for each server, the instructor's too
        env = dict(room.env(), DDPLAB_HUB_ACTIVITY_INTERVAL="5")
        hub_env = dict(env, PATH=f"{fakebin}{os.pathsep}{env['PATH']}")
        # the ports are chosen now, not before the slow steps above (other jobs take free ports)
        port = free_port()
        config = folder / "jupyterhub_config.py"
        config.write_text(re.sub(r"c.JupyterHub.port = \d+", f"c.JupyterHub.port = {port}", config.read_text()))
        log = open(folder / "hub.log", "w")  # noqa: SIM115 (closed in finally)
        hub = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", "jupyterhub_config.py"],
                               cwd=folder, env=hub_env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: _up(url), 120, "the hub did not answer", folder)
        api(url, token, f"/users/{INSTRUCTOR}/server", method="POST")  # comes up while learners log in
        rank_pids = {}
        with chromium(chromium_path) as page0:
            browser = page0.context.browser
            # 3. log-ins refused
            refused(browser, url, "stranger", passwords["learner01"])       # not on the roster
            refused(browser, url, "learner01", passwords["learner02"])      # someone else's password
            refused(browser, url, "learner01", "")                          # no password
            # 4. both learners in JupyterLab, the Nbgrader menu a learner's
            pages = {}
            for user in LEARNERS:
                page = log_in(browser, url, user, passwords[user])
                page.wait_for_url(re.compile(rf".*/user/{user}/lab.*"), timeout=120_000)
                page.goto(f"{url}/user/{user}/lab/tree/{room.LAB}/{room.LAB}.ipynb")
                page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
                page.wait_for_function(KERNEL_IDLE_JS, timeout=120_000)
                menu = nbgrader_menu(page)
                assert "Assignment List" in menu and not {"Formgrader", "Course List"} & set(menu), menu
                pages[user] = page
            # 5. Cluster cell, %ddp_start, %%ddp cell: both at once
            for user, page in pages.items():
                run_cells(page, firsts[user], 3 + (user == "learner01"))
            for user, page in pages.items():
                wait_done(page, user, firsts[user], 3 + (user == "learner01"))
            sols = {}
            for user, page in pages.items():  # the solution and its grader, both learners at once
                sols[user] = next(i for i, c in enumerate(notebooks[user].cells)
                                  if c.metadata.get("nbgrader", {}).get("solution"))
                run_cells(page, sols[user], 2)
            for user, page in pages.items():
                wait_done(page, user, sols[user], 2)
            gpu_of = {}
            for user, page in pages.items():
                text = page.locator(CELLS).nth(firsts[user] + 2).inner_text()
                seen = set(re.findall(r"'(GPU-\d{4}aaaa)'", text))
                assert len(seen) == 1, (user, text)  # both ranks of a learner see the learner's GPU
                gpu_of[user] = seen.pop()
                rank_pids[user] = [int(p) for p in re.findall(r"\(\d, (\d+), ", text)]
                assert len(rank_pids[user]) == 2, text
                grader = page.locator(CELLS).nth(sols[user] + 1).inner_text()
                assert ("not implemented yet" in grader) == (user == "learner02"), grader
            assert gpu_of["learner01"] != gpu_of["learner02"], gpu_of  # never the other's
            peek = pages["learner01"].locator(CELLS).nth(firsts["learner01"] + 3).inner_text()
            for what in ("home", "source", "gradebook"):
                assert f"PermissionError {what}" in peek, peek
            assert not re.search(r"^READ ", peek, re.M), peek  # (the cell's own text says READ too)
            # the instructor's JupyterLab serves Formgrader on the course (the released lab in it)
            _wait(lambda: api(url, token, f"/users/{INSTRUCTOR}")["servers"].get("", {}).get("ready"),
                  120, "the instructor's server did not start", folder)
            assert room.LAB in api(url, token, f"/user/{INSTRUCTOR}/formgrader/api/assignments",
                                   server=True)
        # 6. learner02's server in its cgroups; a burner of theirs dies with the server
        if set(limits.writable()) == set(limits.CONTROLLERS):
            burner_dies_with_the_server(folder, url, token, "learner02", rank_pids.pop("learner02"))
        # 7. SIGKILL: the hub cannot clean up; everything it started must stop by itself
        uids = {pwd.getpwnam(u).pw_uid for u in [*LEARNERS, INSTRUCTOR]}
        procs = class_processes(hub.pid, uids)
        pids = {pid for pid, _ in procs}
        assert all(p in pids for ps in rank_pids.values() for p in ps), (rank_pids, pids)
        culler = [p for p in psutil.Process(hub.pid).children(recursive=True)
                  if "jupyterhub_idle_culler" in " ".join(p.cmdline())]
        assert culler, "no idle culler running"
        killed = time.monotonic()
        hub.send_signal(signal.SIGKILL)
        hub.wait(timeout=10)
        while alive(procs) and time.monotonic() - killed < 30:
            time.sleep(0.5)
        left = alive(procs) + alive(class_processes(os.getpid(), uids) - procs)
        assert not left, f"30 s after the hub's SIGKILL these are left: {left}"
        gone_s = time.monotonic() - killed
        # 8. submit; a submission in another's name and one from the future are refused
        for user in LEARNERS:
            nbgrader(user, "submit", room.LAB)
        later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=20)
        forge("learner02", folder, "learner01", later)
        forge("learner01", folder, "learner01", datetime.datetime(2099, 1, 1))
        collected = nbgrader(INSTRUCTOR, "collect", room.LAB)
        assert "claims to be learner01's but was written by learner02: not collected" in collected, collected
        assert "dated 2099-01-01 00:00:00 UTC, later than now: not collected" in collected, collected
        assert collected.count("REFUSED") == 2 and "cheating" not in collected, collected
        for user in LEARNERS:
            assert (course / "submitted" / user / room.LAB / f"{room.LAB}.ipynb").is_file()
        stamp = (course / "submitted" / "learner01" / room.LAB / "timestamp.txt").read_text()
        assert not stamp.startswith("2099"), stamp
        mine = nbformat.read(course / "submitted" / "learner01" / room.LAB / f"{room.LAB}.ipynb", as_version=4)
        assert "6011" not in str(mine)  # not learner02's forgery
        # 9. autograde, as the instructor: the planted cells find nothing, the scores are right
        nbgrader(INSTRUCTOR, "autograde", room.LAB, "--force")
        copied = sorted(os.listdir(dest)) if dest.exists() else []
        assert copied == [], f"a submission copied these out during autograde: {copied}"
        grader_uid = pwd.getpwnam(GRADER).pw_uid
        for user in LEARNERS:
            said = room.feedback(course, user)
            assert "COPIED" not in said, said
            assert f"uid {grader_uid} in {folder / 'homes' / GRADER}/grading-" in said, said
            # the solution by name, the gradebook, the other's home and submission (glob lists nothing)
            assert said.count("refused") == 4, said
        assert "MemoryError: 10 GiB denied" in room.feedback(course, "learner02")
        deadline = time.monotonic() + 10
        while accounts.processes_of(grader_uid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not accounts.processes_of(grader_uid), "the grading account still runs processes"
        assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "6011"]]
        scores = room.scores(course, list(LEARNERS))
        assert scores == {"learner01": float(sum(room.points().values())), "learner02": 0.0}
        assert not list((folder / "homes" / GRADER).glob("grading-*")), "the scratch folder was left"
        assert not dest.exists(), "the grading account's folder in /tmp outlived the grading"
        # 10. the end of the class: asked first, homes saved, no file left to a freed uid
        ids = [pwd.getpwnam(n) for n in [*LEARNERS, INSTRUCTOR, GRADER]]
        uids, gids = {e.pw_uid for e in ids}, {e.pw_gid for e in ids}
        left_by = room.as_user("learner02", folder / "homes" / "learner02", sys.executable, "-c",
                               f"import os; os.makedirs({str(dest)!r})")  # a learner's folder in /tmp
        assert left_by.returncode == 0, left_by.stderr
        asked = room.classroom(folder, "--delete-accounts")
        assert asked.returncode != 0 and "add --yes to confirm" in asked.stderr, asked.stderr
        assert accounts.exists("learner01")
        done = room.classroom(folder, "--delete-accounts", "--yes")
        assert done.returncode == 0, done.stderr
        saved = course / "saved-homes" / "learner02" / room.LAB / f"{room.LAB}.ipynb"
        assert "6011" in saved.read_text(), "learner02's own notebook was not saved"
        owned = [str(p) for p in [folder, dest, *folder.rglob("*"), *dest.rglob("*")]
                 if p.lstat().st_uid in uids or p.lstat().st_gid in gids]
        assert not owned, f"files left to deleted accounts' ids: {owned[:5]}"
        assert dest.stat().st_uid == 0  # the learner's folder in /tmp: root's now
        assert not list(limits.BASE.glob(f"*/ddplab/{limits.class_name(folder)}")), "the class's cgroups were left"
        print(f"hub test: {time.monotonic() - start:.0f} s; everything gone {gone_s:.1f} s after "
              f"the hub's SIGKILL; scores {scores}")
    finally:
        if hub is not None:
            _stop(hub)
        if log is not None:
            log.close()
            if sys.exc_info()[0] is not None:  # the hub's and the servers' log, before it is deleted
                print((folder / "hub.log").read_text()[-6000:])
        room.classroom(folder, "--delete-accounts", "--yes")  # the accounts, their homes, their processes
        room.restore_modes(modes)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
    left = [n for n in [*LEARNERS, INSTRUCTOR, GRADER] if accounts.exists(n)]
    assert not left, "accounts left behind"
    assert not list(Path("/etc/sudoers.d").glob("ddplab-*ddplab-hub-test-*")), "a sudo rule left behind"


def burner_dies_with_the_server(folder, url, token, user, ranks):
    """``user``'s running server is in the learner's groups with the class's memory limit and
    serves no Formgrader; a CPU burner joins the groups in a session of its own, as a nohup'ed
    cell would; the hub stops the server: the burner, the server's ranks and the groups go."""
    cls, uid = limits.class_name(folder), pwd.getpwnam(user).pw_uid
    members = limits.members(cls, user)
    assert members and set(accounts.processes_of(uid)) <= members, (members, accounts.processes_of(uid))
    lab = urllib.request.Request(f"{url}/user/{user}/formgrader", headers={"Authorization": f"token {token}"})
    with pytest.raises(urllib.error.HTTPError) as no:
        urllib.request.urlopen(lab, timeout=30)
    assert no.value.code == 404  # the learner's server answers the token, but serves no Formgrader
    memory = limits.BASE / "memory" / "ddplab" / cls / user / "memory.limit_in_bytes"
    assert int(memory.read_text()) == 3 << 30  # --mem-gib's default

    def learners_own():
        limits.join(cls, user)
        os.setsid()
        os.setgid(uid)
        os.setuid(uid)

    burner = subprocess.Popen(["sh", "-c", "while :; do :; done"], preexec_fn=learners_own)
    try:
        _wait(lambda: burner.pid in limits.members(cls, user), 10, "the burner is not in the groups", folder)
        api(url, token, f"/users/{user}/server", method="DELETE")
        _wait(lambda: burner.poll() is not None, 60, "the burner outlived the server", folder)
        assert not alive({(p, psutil.Process(p).create_time()) for p in ranks if psutil.pid_exists(p)}), \
            "the server's ranks outlived it"
        assert not [g for g in limits.groups(cls, user) if g.exists()], "the learner's groups were left"
    finally:
        if burner.poll() is None:
            burner.kill()
            burner.wait(timeout=10)


def _up(url):
    try:
        with urllib.request.urlopen(f"{url}/hub/login", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _wait(predicate, timeout_s, message, folder):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"{message}:\n{(folder / 'hub.log').read_text()[-3000:]}")


def _stop(hub):
    if hub.poll() is None:
        hub.send_signal(signal.SIGTERM)  # the hub stops every server it started (cleanup_servers)
        try:
            hub.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(hub.pid, signal.SIGKILL)  # the proxy and culler are in the hub's session
    except ProcessLookupError:
        pass
    hub.wait(timeout=10)
