"""A real JupyterHub from `python -m ddplab classroom`, two learners in a real browser, then nbgrader.

The hub runs on loopback with the config the command writes (DummyAuthenticator with
allow_all, SimpleLocalProcessSpawner with seats, configurable-http-proxy from `npm ci
--prefix proxy`, jupyterhub-idle-culler) and a fake nvidia-smi on its PATH showing two idle
GPUs, one per learner. The learners' own servers see no nvidia-smi, so their ranks run gloo on
CPU (this torch has no CUDA) while CUDA_VISIBLE_DEVICES still says which GPU the hub gave them.

1. ann and bob log in through Chromium and open lab 00's exercise (ann's has the solution
   written in; bob's is untouched); both run its Cluster cell, a %%ddp cell and the grader at
   the same time.
2. Each %%ddp output shows that learner's GPU, never the other's.
3. The instructor autogrades both notebooks: ann full marks, bob 0, in the gradebook.
4. The idle culler stops both servers: no rank of theirs is left.
5. The hub stops; no process it started is left.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import _classroom as room
import nbformat
import psutil
import pytest
from _browser import KERNEL_IDLE_JS, LAB_SETTINGS, chromium, free_port, require_browser

pytestmark = [pytest.mark.slow, pytest.mark.hub, pytest.mark.skipif(
    not os.environ.get("DDPLAB_HUB_TEST"), reason="runs under make test-hub (DDPLAB_HUB_TEST=1)")]
PROXY = room.ROOT / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
GPU_OF = {"ann": "GPU-0000aaaa", "bob": "GPU-0001aaaa"}
DDP_CELLS = ["%load_ext ddplab\n%ddp_start 2 --backend gloo",
             "%%ddp\nimport os\n(rank, os.getpid(), os.environ['CUDA_VISIBLE_DEVICES'])"]
DONE_JS = """([first, count]) => {
  const cells = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell')];
  const want = cells.slice(first, first + count).filter(c => c.classList.contains('jp-CodeCell'));
  return want.length > 0 && want.every(c => /\\[\\d+\\]/.test(c.querySelector('.jp-InputPrompt').textContent));
}"""


def notebook_for(user):
    nb = room.solved() if user == "ann" else room.exercise()
    first = next(i for i, c in enumerate(nb.cells) if "ddplab.Cluster(" in c.source)
    extra = [nbformat.v4.new_code_cell(src) for src in DDP_CELLS]
    for k, cell in enumerate(extra):
        cell.id = f"hub-test-{k}"
    nb.cells[first + 1:first + 1] = extra
    return nb, first


def user_procs(user):
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("JUPYTERHUB_USER") == user:
                found.append(p)
        except (psutil.Error, OSError):
            pass
    return found


def api(url, token, path, method="GET"):
    req = urllib.request.Request(f"{url}/hub/api{path}", method=method,
                                 headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        import json
        body = r.read()
        return json.loads(body) if body else None


def run_cells(page, first, count):
    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell")
    cells.nth(first).locator(".jp-InputPrompt").click()
    for _ in range(count):
        page.keyboard.press("Shift+Enter")


@pytest.mark.timeout(600)
def test_two_learners_on_a_real_hub_then_autograde_then_cull(tmp_path):
    chromium_path = require_browser()
    if not PROXY.exists():
        message = "configurable-http-proxy is missing: npm ci --prefix proxy (make test-hub does it)"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    start = time.monotonic()
    port, token = free_port(), "hubtest" + os.urandom(8).hex()
    folder = room.make_room(tmp_path / "class", "--roster", str(_roster(tmp_path)),
                            "--gpus-per-learner", "1", "--threads", "1", "--port", str(port),
                            "--idle-timeout", "30", "--proxy", str(PROXY))
    with open(folder / "jupyterhub_config.py", "a") as f:  # the test's own admin token
        f.write(f"\nc.JupyterHub.services.append({{'name': 'test', 'api_token': {token!r}}})\n"
                "c.JupyterHub.load_roles.append({'name': 'test', 'scopes': ['admin:users', "
                "'admin:servers', 'list:users', 'read:users'], 'services': ['test']})\n")
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir()
    from test_classroom import fake_smi
    fake_smi(fakebin, 2)
    notebooks = {}
    for user in GPU_OF:
        # every cell stays in the page (JupyterLab's windowing would leave far cells unrendered)
        settings = folder / "homes" / user / ".jupyter" / "lab" / "user-settings" / "@jupyterlab"
        for rel, content in LAB_SETTINGS.items():
            (settings.parent / rel).parent.mkdir(parents=True, exist_ok=True)
            (settings.parent / rel).write_text(json.dumps(content))
        nb, first = notebook_for(user)
        nbformat.write(nb, folder / "homes" / user / f"{room.LAB}.ipynb")
        notebooks[user] = first
    env = dict(room.env(), DDPLAB_HUB_ACTIVITY_INTERVAL="5")
    hub_env = dict(env, PATH=f"{fakebin}{os.pathsep}{env['PATH']}")
    # the learners' servers get the hub's PATH: keep the fake nvidia-smi out of theirs
    (folder / "jupyterhub_config.py").write_text((folder / "jupyterhub_config.py").read_text().replace(
        "'PATH': os.environ.get('PATH', '')", f"'PATH': {env['PATH']!r}"))
    # the ports are chosen now, not before the slow steps above (other jobs take free ports)
    port = free_port()
    config = folder / "jupyterhub_config.py"
    config.write_text(re.sub(r"c.JupyterHub.port = \d+", f"c.JupyterHub.port = {port}", config.read_text()))
    log = open(folder / "hub.log", "w")
    hub = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", "jupyterhub_config.py"],
                           cwd=folder, env=hub_env, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    rank_pids = {}
    try:
        _wait(lambda: _up(url), 120, "the hub did not answer", folder)
        with chromium(chromium_path) as page0:
            browser = page0.context.browser
            pages = {}
            for user in GPU_OF:
                page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
                page.goto(f"{url}/hub/login")
                page.fill("#username_input", user)
                page.click("#login_submit")
                page.wait_for_url(re.compile(rf".*/user/{user}/lab.*"), timeout=120_000)
                page.goto(f"{url}/user/{user}/lab/tree/{room.LAB}.ipynb")
                page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
                page.wait_for_function(KERNEL_IDLE_JS, timeout=120_000)
                pages[user] = page
            # Cluster cell, %ddp_start, %%ddp cell: both learners at once
            for user, page in pages.items():
                run_cells(page, notebooks[user], 3)
            for user, page in pages.items():
                page.wait_for_function(DONE_JS, arg=[notebooks[user], 3], timeout=240_000)
            # the solution and its grader, both learners at once
            for user, page in pages.items():
                sol = next(i for i, c in enumerate(notebook_for(user)[0].cells)
                           if c.metadata.get("nbgrader", {}).get("solution"))
                run_cells(page, sol, 2)
                pages[user].sol = sol
            for page in pages.values():
                page.wait_for_function(DONE_JS, arg=[page.sol, 2], timeout=240_000)
            for user, page in pages.items():
                text = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").nth(
                    notebooks[user] + 2).inner_text()
                other = next(g for u, g in GPU_OF.items() if u != user)
                assert GPU_OF[user] in text and other not in text, (user, text)
                rank_pids[user] = [int(p) for p in re.findall(r"\(\d, (\d+), ", text)]
                assert len(rank_pids[user]) == 2, text
                grader = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").nth(
                    page.sol + 1).inner_text()
                assert ("not implemented yet" in grader) == (user == "bob"), grader
        everyone = {u: [p.pid for p in user_procs(u)] for u in GPU_OF}
        assert all(everyone.values()), everyone
        # the instructor collects (submitted/<student>/<lab>/) and autogrades
        course = folder / "course"
        for user in GPU_OF:
            room.submit(course, user, nbformat.read(folder / "homes" / user / f"{room.LAB}.ipynb", 4))
        scores = room.instructor_grade(course, list(GPU_OF))
        assert scores == {"ann": float(sum(room.points().values())), "bob": 0.0}
        # the culler stops both idle servers; their kernels' ranks go with them
        _wait(lambda: not any(api(url, token, f"/users/{u}")["servers"] for u in GPU_OF), 180,
              "the idle culler did not stop the servers", folder)
        _wait(lambda: not any(psutil.pid_exists(p) for ps in everyone.values() for p in ps), 30,
              "processes of a culled server are left", folder)
        assert "Culling server" in (folder / "hub.log").read_text()
        print(f"hub test: {time.monotonic() - start:.0f} s, scores {scores}")
    finally:
        _stop(hub)
        log.close()
    left = [p for u in GPU_OF for p in user_procs(u)]
    assert not left, f"left behind: {left}"


def _roster(tmp_path):
    path = tmp_path / "roster.txt"
    path.write_text("ann\nbob\n")
    return path


def _up(url):
    try:
        with urllib.request.urlopen(f"{url}/hub/login", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _wait(predicate, timeout_s, message, folder):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return
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
