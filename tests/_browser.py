"""A real browser on a real JupyterLab: the harness the browser tests share.

What it does, step by step, so that any notebook (a test notebook today,
labs/tour.ipynb later) can be checked the way a learner sees it:
1. ``require_browser()``: Playwright (from PyPI, no browser download) and
   Debian's Chromium; skip when either is missing, FAIL when CI=true.
2. ``jupyterlab(root_dir)``: JupyterLab on a free port with a random token,
   no browser of its own, settings, workspaces and runtime files in a
   temporary directory (so a learner's own settings cannot change the test),
   notebook windowing off (every cell stays in the page, so outputs far down
   can be found). Stopped afterwards: sessions deleted through the REST API
   (which shuts their kernels down, and with them any ranks), then the server.
3. ``chromium()`` / ``open_notebook()`` / ``run_all_cells()``: open the
   notebook, wait for an idle kernel, Run > Run All Cells, wait until every
   code cell has run and the kernel is idle again.
4. ``plot_bars()`` / ``plot_fingerprint()``: what plotly really drew (SVG bar
   paths) against what its data says, and a fingerprint to see a change.
5. ``notebook_errors()`` and ``save_screenshots()`` for diagnosis; screenshots
   go under test-artifacts/ (gitignored).

Chromium flags: headless, no sandbox (root in containers), no GPU, and no
background networking, component updates or sync (they flood a closed
network). References: Playwright for Python (sync API); Jupyter Server REST API.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = os.environ.get("DDPLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]
LAB_SETTINGS = {  # user settings for the test's JupyterLab (JSON5 files, plain JSON is fine)
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"checkForUpdates": False, "fetchNews": "false"},
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require_browser() -> str:
    """The Chromium path; skips (or fails, with CI=true) when Playwright or Chromium is missing."""
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the Python package playwright (pip install -c constraints.txt playwright; "
                       "no browser download is needed)")
    path = shutil.which(CHROMIUM)
    if path is None:
        missing.append(f"Chromium at {CHROMIUM} (apt-get install -y chromium, or set DDPLAB_CHROMIUM)")
    if missing:
        message = "browser test needs " + " and ".join(missing)
        if in_ci():
            pytest.fail(message + " (CI=true: a missing browser is a failure, not a skip)")
        pytest.skip(message)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    def __init__(self, url, token, process, log_path):
        self.url, self.token, self.process, self.log_path = url, token, process, log_path

    def api(self, path, method="GET"):
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def jupyterlab(root_dir, state_dir, timeout=60.0):
    """JupyterLab serving ``root_dir``; ``state_dir`` holds its settings, workspaces and log."""
    state = Path(state_dir)
    for rel, content in LAB_SETTINGS.items():
        f = state / "settings" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(content))
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(state / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(state / "workspaces"),
               JUPYTER_RUNTIME_DIR=str(state / "runtime"), JUPYTER_CONFIG_DIR=str(state / "config"),
               PYTHONUNBUFFERED="1")
    port, token = free_port(), secrets.token_hex(16)
    log_path = state / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root_dir}",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers and CI often run as root
        cmd.append("--allow-root")
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    lab = Lab(f"http://127.0.0.1:{port}", token, process, log_path)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {process.returncode}:\n{lab.log()}")
            try:
                lab.api("/api/status")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not answer in {timeout:.0f} s:\n{lab.log()}") from None
                time.sleep(0.2)
        yield lab
    finally:
        _stop(lab)


def end_sessions(lab: Lab) -> None:
    """Delete every session: shuts their kernels (and with them any ranks) down."""
    with contextlib.suppress(Exception):
        for session in lab.api("/api/sessions") or []:
            lab.api(f"/api/sessions/{session['id']}", method="DELETE")


def _stop(lab: Lab) -> None:
    end_sessions(lab)
    if lab.process.poll() is None:
        lab.process.send_signal(signal.SIGTERM)
        try:
            lab.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(lab.process.pid, signal.SIGKILL)  # the group this harness started
            lab.process.wait(timeout=5)


@contextlib.contextmanager
def chromium(executable, width=1400, height=1000):
    """A Playwright page in Debian's Chromium; console errors collected on ``page.errors``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            with new_page(browser, width, height) as page:
                yield page
        finally:
            browser.close()


@contextlib.contextmanager
def new_page(browser, width=1400, height=1000):
    """A page in a fresh browser context (no storage shared with the test before)."""
    context = browser.new_context(viewport={"width": width, "height": height})
    try:
        page = context.new_page()
        page.errors = []
        page.on("pageerror", lambda e: page.errors.append(str(e)))
        yield page
    finally:
        context.close()


class Browsing:
    """One JupyterLab and one Chromium for a whole test session: each test writes its notebook
    under ``root``, opens it in a page of its own, and its kernel is shut down after it.
    Starting JupyterLab (with nbgrader's server extensions) and Chromium once instead of once
    per test is what keeps the browser tests within their budget."""

    def __init__(self, lab: Lab, browser, root: Path):
        self.lab, self.browser, self.root = lab, browser, root

    @contextlib.contextmanager
    def page(self, width=1400, height=1000):
        try:
            with new_page(self.browser, width, height) as page:
                yield page
        finally:
            end_sessions(self.lab)


@contextlib.contextmanager
def open_browsing(tmp_path_factory):
    """The session's JupyterLab and Chromium (see ``Browsing``); skips without a browser.
    tests/conftest.py serves it as the session fixture ``browsing``."""
    from playwright.sync_api import sync_playwright

    executable = require_browser()
    root = tmp_path_factory.mktemp("browser-root")
    with jupyterlab(root, tmp_path_factory.mktemp("browser-lab")) as lab, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield Browsing(lab, browser, root)
        finally:
            browser.close()


# "idle" is also what the indicator says before any kernel exists: ask for a kernel name too.
KERNEL_JS = """
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  const ind = panel && panel.querySelector('.jp-Notebook-ExecutionIndicator');
  const name = panel && panel.querySelector('.jp-Toolbar-kernelName');
  const idle = ind !== null && ind.getAttribute('data-status') === 'idle' && name !== null
               && name.textContent.trim() !== '' && !/No Kernel/.test(name.textContent);
"""
KERNEL_IDLE_JS = "() => {" + KERNEL_JS + "return idle; }"
ALL_RAN_JS = "() => {" + KERNEL_JS + """
  const prompts = [...panel.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.textContent);
  return idle && prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p));
}"""


NOTEBOOK_CELLS = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell"
# cell ``first`` of the shown notebook was sent to its kernel: its prompt says [*] or [n], never [ ]
SENT_JS = """(first) => {
  const cell = document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell')[first];
  const prompt = cell && cell.querySelector('.jp-InputPrompt');
  return prompt !== null && prompt !== undefined && /\\[(\\*|\\d+)\\]/.test(prompt.textContent);
}"""


def run_cells(page, first: int, count: int, timeout_s: float = 60.0) -> None:
    """Select code cell ``first`` of the shown notebook and press Shift+Enter ``count`` times,
    then wait until the first of them was sent to the kernel.

    On a loaded machine JupyterLab can take a click and drop the keys after it (the notebook
    not yet its active widget: Shift+Enter then runs nothing and the prompts stay ``[ ]``).
    So the keys are pressed again, once, where nothing was sent after ``timeout_s``; a cell
    already sent is never sent twice by this."""
    for attempt in (1, 2):
        cell = page.locator(NOTEBOOK_CELLS).nth(first)
        cell.locator(".jp-InputPrompt").click()
        for _ in range(count):
            page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function(SENT_JS, arg=first, timeout=timeout_s * 1000)
            return
        except Exception:
            if attempt == 2:
                dialogs = page.locator(".jp-Dialog").all_inner_texts()
                raise AssertionError(f"Shift+Enter on cell {first} sent nothing to the kernel, twice "
                                     f"({timeout_s:g} s each): its prompt still says [ ]; dialogs "
                                     f"open: {dialogs or 'none'}") from None


def open_notebook(page, lab: Lab, name: str, timeout_s=60.0) -> None:
    """Open ``name`` (relative to the server's root) and wait for its kernel to be idle."""
    page.goto(f"{lab.url}/lab/tree/{name}?reset&token={lab.token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=timeout_s * 1000)
    page.wait_for_function(KERNEL_IDLE_JS, timeout=timeout_s * 1000)


def run_all_cells(page, timeout_s=120.0) -> None:
    """Run > Run All Cells, then wait until every code cell has a number and the kernel is idle."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    page.wait_for_function(ALL_RAN_JS, timeout=timeout_s * 1000)


def notebook_errors(page) -> list[str]:
    """Texts of outputs that carry a Python traceback."""
    texts = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    return [t for t in texts.all_inner_texts() if "Traceback" in t or "Error" in t]


PLOT_JS = """(sel) => {
  const gd = document.querySelector(sel);
  if (!gd || !gd.data) return null;
  const drawn = [...gd.querySelectorAll('.barlayer .point path')]
      .filter(p => (p.getAttribute('d') || 'M0,0Z') !== 'M0,0Z');
  let inData = 0;
  for (const t of gd.data) if (t.type === 'bar' && t.x) inData += t.x.length;
  const notes = [...gd.querySelectorAll('.gtitle, .annotation-text')].map(a => a.textContent);
  return {drawn: drawn.length, in_data: inData, traces: gd.data.length,
          fingerprint: drawn.map(p => p.getAttribute('d')).join('|') + '#' + notes.join('|'),
          notes: notes};
}"""


def plot_bars(page, selector: str) -> dict | None:
    """{"drawn", "in_data", "traces", "fingerprint", "notes"} for the plotly graph at ``selector``."""
    return page.evaluate(PLOT_JS, selector)


def wait_for_bars(page, selector: str, timeout_s=30.0) -> dict:
    """Wait until plotly has drawn every bar its data holds (and at least one)."""
    js = f"() => {{ const r = ({PLOT_JS})({json.dumps(selector)}); " \
         "return r !== null && r.drawn > 0 && r.drawn === r.in_data; }"
    page.wait_for_function(js, timeout=timeout_s * 1000)
    return plot_bars(page, selector)


def wait_for_change(page, selector: str, fingerprint: str, timeout_s=30.0) -> dict:
    """Wait until the graph at ``selector`` is fully drawn and differs from ``fingerprint``."""
    js = f"(old) => {{ const r = ({PLOT_JS})({json.dumps(selector)}); " \
         "return r !== null && r.drawn > 0 && r.drawn === r.in_data && r.fingerprint !== old; }"
    page.wait_for_function(js, arg=fingerprint, timeout=timeout_s * 1000)
    return plot_bars(page, selector)


def save_screenshots(page, name: str, element: str | None = None) -> list[Path]:
    """The whole window, and ``element`` on its own (scrolled into view), under test-artifacts/."""
    ARTIFACTS.mkdir(exist_ok=True)
    paths = [ARTIFACTS / f"{name}-window.png"]
    page.screenshot(path=str(paths[0]))
    if element is not None and page.locator(element).count():
        paths.append(ARTIFACTS / f"{name}.png")
        page.locator(element).first.screenshot(path=str(paths[1]))
    return paths
