"""A real JupyterHub from `python -m ddplab classroom`, safe by default, two learners in a real browser.

The class is what the command writes without options about safety: each learner a Unix account of
their own (created here, deleted at the end), PAM log-in with the generated passwords, the course
folder the instructor's alone. The hub runs on loopback with configurable-http-proxy from `npm ci
--prefix proxy`, jupyterhub-idle-culler, and a fake nvidia-smi on the hub's PATH showing three idle
GPUs, one per server (the learners' servers see no nvidia-smi, so their ranks run gloo on CPU while
CUDA_VISIBLE_DEVICES still says which GPU the hub gave them).

1. The instructor releases lab 00; each learner fetches it (nbgrader, as that learner's account).
2. Log-in: a name not on the roster, a wrong password and an empty one are refused.
3. learner01 and learner02 log in through Chromium; their Nbgrader menu offers the Assignment List,
   not Formgrader or the Course List; the instructor's server serves Formgrader on the course.
4. Both run the Cluster cell, a %%ddp cell and lab 00's grader at the same time; each %%ddp output
   shows that learner's GPU, never the other's. learner01's notebook then tries to read learner02's
   home, the course's solutions and the gradebook: three PermissionErrors.
5. The hub is SIGKILLed: within 30 s no process of the class is left (proxy, culler, servers,
   kernels, ranks).
6. The learners submit, the instructor collects (no "cheating attempt" warning: each submission
   is owned by its learner) and autogrades: learner01 full marks, learner02 0.

Runs as root (CI does): where accounts cannot be created it fails under CI and skips elsewhere.
The environment must be runnable by other accounts (make test-hub builds .venv-hub from the
system's Python for that: a pyenv Python under /root is not).
"""
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
import urllib.request
from pathlib import Path

import _classroom as room
import nbformat
import psutil
import pytest
from _browser import KERNEL_IDLE_JS, LAB_SETTINGS, chromium, free_port, in_ci, require_browser

from ddplab.course import accounts

pytestmark = [pytest.mark.slow, pytest.mark.hub, pytest.mark.skipif(
    not os.environ.get("DDPLAB_HUB_TEST"), reason="runs under make test-hub (DDPLAB_HUB_TEST=1)")]
PROXY = room.ROOT / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
LEARNERS = ("learner01", "learner02")
INSTRUCTOR = "instructor"
DDP_CELLS = ["%load_ext ddplab\n%ddp_start 2 --backend gloo",
             "%%ddp\nimport os\n(rank, os.getpid(), os.environ['CUDA_VISIBLE_DEVICES'])"]
PEEK = """import os
for what, path in [('home', {home!r}), ('source', {source!r}), ('gradebook', {gradebook!r})]:
    try:
        os.listdir(path) if what == 'home' else open(path, 'rb').read(1)
        print('READ', what)
    except PermissionError as e:
        print('PermissionError', what, e.strerror)"""
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
    taken = [n for n in [*LEARNERS, INSTRUCTOR, f"{INSTRUCTOR}-grader"] if accounts.exists(n)]
    if taken:
        pytest.fail(f"Unix accounts {taken} exist already: a leftover of an earlier run? "
                    "(userdel --remove NAME as root, if they are)")


def notebook_for(user, folder):
    nb = room.solved() if user == "learner01" else room.exercise()
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


def api(url, token, path, method="GET", server=False):
    full = f"{url}{path}" if server else f"{url}/hub/api{path}"
    req = urllib.request.Request(full, method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read()
        return body.decode() if server else (json.loads(body) if body else None)


def run_cells(page, first, count):
    page.locator(CELLS).nth(first).locator(".jp-InputPrompt").click()
    for _ in range(count):
        page.keyboard.press("Shift+Enter")


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


@pytest.mark.timeout(600)
def test_a_safe_class_two_learners_on_a_real_hub_sigkill_then_autograde():
    chromium_path = require_browser()
    if not PROXY.exists():
        need("configurable-http-proxy is missing: npm ci --prefix proxy (make test-hub does it)")
    require_accounts()
    start = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="ddplab-hub-test-"))
    base.chmod(0o755)  # the learners' accounts walk through it to their homes
    folder, hub, log = base / "class", None, None
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
        assert (folder / "course").stat().st_mode & 0o777 == 0o700
        token = "hubtest" + os.urandom(8).hex()
        with open(folder / "jupyterhub_config.py", "a") as f:  # the test's own admin token
            f.write(f"\nc.JupyterHub.services.append({{'name': 'test', 'api_token': {token!r}}})\n"
                    "c.JupyterHub.load_roles.append({'name': 'test', 'scopes': ['admin:users', "
                    "'admin:servers', 'list:users', 'read:users', 'access:servers'], "
                    "'services': ['test']})\n")
        course, learner_env = folder / "course", {"JUPYTER_CONFIG_PATH": str(folder / "learner-config")}

        def nbgrader(user, *args):
            cwd = course if user == INSTRUCTOR else folder / "homes" / user
            done = room.as_user(user, cwd, sys.executable, "-m", "nbgrader", *args,
                                extra=None if user == INSTRUCTOR else learner_env)
            assert done.returncode == 0, f"{user}: nbgrader {args}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            return done.stdout + done.stderr

        nbgrader(INSTRUCTOR, "db", "student", "import", "roster.csv")
        nbgrader(INSTRUCTOR, "generate_assignment", room.LAB, "--force")
        nbgrader(INSTRUCTOR, "release_assignment", room.LAB, "--force")
        firsts = {}
        for user in LEARNERS:
            nbgrader(user, "fetch_assignment", room.LAB)
            home = folder / "homes" / user
            fetched = home / room.LAB / f"{room.LAB}.ipynb"
            assert "raise NotImplementedError" in fetched.read_text()  # the exercise, not the solution
            nb, firsts[user] = notebook_for(user, folder)
            nbformat.write(nb, fetched)
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
            refused(browser, url, "stranger", passwords["learner01"])       # not on the roster
            refused(browser, url, "learner01", passwords["learner02"])      # someone else's password
            refused(browser, url, "learner01", "")                          # no password
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
            for user, page in pages.items():  # Cluster cell, %ddp_start, %%ddp cell: both at once
                run_cells(page, firsts[user], 3 + (user == "learner01"))
            for user, page in pages.items():
                page.wait_for_function(DONE_JS, arg=[firsts[user], 3 + (user == "learner01")],
                                       timeout=240_000)
            sols = {}
            for user, page in pages.items():  # the solution and its grader, both learners at once
                sols[user] = next(i for i, c in enumerate(notebook_for(user, folder)[0].cells)
                                  if c.metadata.get("nbgrader", {}).get("solution"))
                run_cells(page, sols[user], 2)
            for user, page in pages.items():
                page.wait_for_function(DONE_JS, arg=[sols[user], 2], timeout=240_000)
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
        # SIGKILL: the hub cannot clean up; everything it started must stop by itself
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
        # the learners submit, the instructor collects and autogrades
        for user in LEARNERS:
            nbgrader(user, "submit", room.LAB)
        collected = nbgrader(INSTRUCTOR, "collect", room.LAB)
        assert "cheating" not in collected, collected
        for user in LEARNERS:
            assert (course / "submitted" / user / room.LAB / f"{room.LAB}.ipynb").is_file()
        nbgrader(INSTRUCTOR, "autograde", room.LAB, "--force")
        scores = room.scores(course, list(LEARNERS))
        assert scores == {"learner01": float(sum(room.points().values())), "learner02": 0.0}
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
    left = [n for n in [*LEARNERS, INSTRUCTOR, f"{INSTRUCTOR}-grader"] if accounts.exists(n)]
    assert not left, "accounts left behind"


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
