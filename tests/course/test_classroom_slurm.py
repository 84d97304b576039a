"""`python -m ddplab classroom --spawner slurm` on a real Slurm: two learners' servers as Slurm jobs.

The Slurm is tests/_slurm.py's (munged, slurmctld, two emulated nodes n1 and n2 on 127.0.0.1, names
that do not resolve). The class is what the command writes: learners as Unix accounts of their own
(created here, deleted at the end), PAM log-in, batchspawner's SlurmSpawner submitting each server
as its learner (`sudo -E -u NAME sbatch`), jupyterhub-idle-culler, configurable-http-proxy, and
nbgrader's exchange on a path of its own (--exchange).

1. The sudo rule the command writes passes `visudo -c` and names only sbatch, squeue and scancel.
2. Two learners log in through Chromium; each server is a RUNNING Slurm job of that learner's
   account, with the class's CPUs, memory and time limit; the server listens on the node's
   NodeAddr (127.0.0.1), not 0.0.0.0.
3. Each runs lab 00's first cell on 2 ranks (gloo), and a cell whose ranks report their Slurm job
   id and uid: the learner's own job, the learner's own account.
4. learner 1 closes the browser: the idle culler stops the server and its job leaves squeue.
   learner 2 keeps working; the hub's stop (SIGTERM) cancels that job. Then squeue is empty.

Runs as root under make test-slurm-hub (DDPLAB_SLURM_TEST=1) from an environment the learners'
accounts can run (.venv-hub, built from /usr/bin/python3: /root is 0700). Where Slurm, accounts,
the proxy or the browser are missing it fails under CI and skips elsewhere, saying why.
"""
from __future__ import annotations

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
from pathlib import Path

import _classroom as room
import nbformat
import pytest
from _browser import KERNEL_IDLE_JS, LAB_SETTINGS, chromium, free_port, in_ci, require_browser, run_cells
from _slurm import Slurm, SlurmUnavailable

from ddplab.course import accounts

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.environ.get("DDPLAB_SLURM_TEST"), reason="runs under make test-slurm-hub (DDPLAB_SLURM_TEST=1)")]
PROXY = room.ROOT / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
LEARNERS = ("slurmer01", "slurmer02")  # not the hub test's names: both may run on one machine
INSTRUCTOR = "slurmteach"
CELLS = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell"
DONE_JS = """([first, count]) => {
  const cells = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell')];
  const want = cells.slice(first, first + count).filter(c => c.classList.contains('jp-CodeCell'));
  return want.length > 0 && want.every(c => /\\[\\d+\\]/.test(c.querySelector('.jp-InputPrompt').textContent));
}"""
WHERE = """import os
def where():
    return (f"rank {dist.get_rank()}/{dist.get_world_size()} {ddplab.backend_name()} "
            f"job={os.environ.get('SLURM_JOB_ID')} uid={os.getuid()}")
for line in cluster.run(where):
    print(line)"""
# learner 2 stays busy (output every 2 s keeps its server active) until the hub is stopped
BUSY = "import time\nfor i in range(300):\n    print('busy', i, flush=True)\n    time.sleep(2)"


def need(message):
    pytest.fail(message) if in_ci() else pytest.skip(message)


def notebook():
    """Lab 00's first code cell at world size 2, then the cell that says where each rank runs."""
    lab = nbformat.read(room.ROOT / "labs" / f"{room.LAB}.ipynb", as_version=4)
    first = next(c for c in lab.cells if "ddplab.Cluster(" in c.source)
    assert "ddplab.Cluster(max(3, ddplab.lab_world_size()))" in first.source, first.source
    cells = [first.source.replace("ddplab.Cluster(max(3, ddplab.lab_world_size()))", "ddplab.Cluster(2)"),
             WHERE, BUSY]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def squeue(slurm, *args):
    out = slurm.run(["squeue", "-h", *args], timeout=20).stdout
    return [line.split() for line in out.splitlines() if line.strip()]


def wait(predicate, timeout_s, message):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    pytest.fail(message())


@pytest.mark.timeout(480)
def test_two_learners_servers_are_slurm_jobs_culled_and_cancelled():
    chromium_path = require_browser()
    if not PROXY.exists():
        need("configurable-http-proxy is missing: npm ci --prefix proxy (make test-slurm-hub does it)")
    why = accounts.can_create() or (accounts.reachable(Path(sys.prefix)) and
                                    f"the learners' accounts cannot enter {accounts.reachable(Path(sys.prefix))}"
                                    f" on the way to {sys.prefix}: run from .venv-hub (make test-slurm-hub)")
    if why:
        need(f"learners as Unix accounts cannot be set up here: {why}")
    taken = [n for n in [*LEARNERS, INSTRUCTOR, f"{INSTRUCTOR}-grader"] if accounts.exists(n)]
    if taken:
        pytest.fail(f"Unix accounts {taken} exist already (a leftover? userdel --remove NAME)")
    start = time.monotonic()
    slurm = Slurm()
    base = Path(tempfile.mkdtemp(prefix="ddplab-slurm-hub-"))
    base.chmod(0o755)  # the learners walk through it to their homes
    folder, hub, log, timings = base / "class", None, None, {}
    modes = room.checkout_modes()  # the class closes the checkout's answers to other accounts
    try:
        try:
            slurm.start()
        except SlurmUnavailable as e:
            need(f"Slurm could not be started: {e}")
        timings["slurm up"] = time.monotonic() - start
        env = dict(room.env(), SLURM_CONF=str(slurm.conf), DDPLAB_HUB_ACTIVITY_INTERVAL="5")
        roster = base / "roster.txt"
        roster.write_text("\n".join(LEARNERS) + "\n")
        exchange = base / "shared" / "exchange"
        out = subprocess.run([sys.executable, "-m", "ddplab", "classroom", str(folder), "--spawner", "slurm",
                              "--roster", str(roster), "--instructor", INSTRUCTOR, "--cpu-only",
                              "--threads", "1", "--mem-gib", "1", "--time-limit", "00:15:00",
                              "--idle-timeout", "20", "--exchange", str(exchange),
                              "--port", str(free_port()), "--proxy", str(PROXY)],
                             capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        passwords = room.passwords(out.stdout)
        assert set(passwords) == {*LEARNERS, INSTRUCTOR}, out.stdout
        # 1. the sudo rule: valid, for the three programs only, as the roster's accounts only
        rule = (folder / "sudoers").read_text()
        check = subprocess.run(["visudo", "-c", "-f", str(folder / "sudoers")], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        granted = re.search(r"Cmnd_Alias \S+ = (.*)", rule).group(1).split(", ")
        assert sorted(Path(p).name for p in granted) == ["sbatch", "scancel", "squeue"], rule
        assert re.search(r"Runas_Alias \S+ = (.*)", rule).group(1).split(", ") == sorted(LEARNERS), rule
        assert (exchange.stat().st_mode & 0o7777) == 0o1777
        assert str(exchange) in (folder / "learner-config" / "nbgrader_config.py").read_text()
        for user in LEARNERS:
            home = folder / "homes" / user
            nbformat.write(notebook(), home / "slurm.ipynb")
            settings = home / ".jupyter" / "lab" / "user-settings"
            for rel, content in LAB_SETTINGS.items():
                (settings / rel).parent.mkdir(parents=True, exist_ok=True)
                (settings / rel).write_text(json.dumps(content))
            subprocess.run(["chown", "-R", f"{user}:{user}", str(home)], check=True)
        port = free_port()
        config = folder / "jupyterhub_config.py"
        config.write_text(re.sub(r"c.JupyterHub.port = \d+", f"c.JupyterHub.port = {port}", config.read_text()))
        log = open(folder / "hub.log", "w")  # noqa: SIM115 (closed in finally)
        hub = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", "jupyterhub_config.py"], cwd=folder,
                               env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"

        def hub_log():
            jobs = "".join(p.read_text(errors="replace")[-2000:]
                           for p in (folder / "homes").glob("*/jupyterhub_slurmspawner_*.log"))
            lines = [x for x in (folder / "hub.log").read_text().splitlines() if "idle-culler@" not in x]
            return "hub.log:\n" + "\n".join(lines)[-6000:] + f"\njob logs:\n{jobs}\n" + slurm.logs(500)

        wait(lambda: _up(url), 120, lambda: "the hub did not answer\n" + hub_log())
        timings["hub up"] = time.monotonic() - start
        uids = {u: pwd.getpwnam(u).pw_uid for u in LEARNERS}
        with chromium(chromium_path) as page0:
            browser = page0.context.browser
            pages = {}
            for user in LEARNERS:  # 2. each server is a job of its own learner
                page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
                page.goto(f"{url}/hub/login")
                page.fill("#username_input", user)
                page.fill("#password_input", passwords[user])
                page.click("#login_submit")
                pages[user] = page
            jobs = {}
            for user, page in pages.items():
                try:
                    page.wait_for_url(re.compile(rf".*/user/{user}/lab.*"), timeout=90_000)
                except Exception:
                    pytest.fail(f"{user}'s server did not come up\n" + hub_log())
                rows = squeue(slurm, "-u", user, "-o", "%i %T %u %C %m %l %B")
                assert len(rows) == 1 and rows[0][1] == "RUNNING", rows
                job, _, owner, cpus, mem, limit, node = rows[0]
                assert (owner, cpus, mem, limit) == (user, "1", "1G", "15:00"), rows
                assert node in ("n1", "n2"), rows
                jobs[user] = job
            timings["both servers up"] = time.monotonic() - start
            listening = server_listeners(set(uids.values()))
            assert len(listening) >= 2 and {ip for ip, _ in listening} == {"127.0.0.1"}, listening
            for user, page in pages.items():  # 3. lab 00's first cell on 2 ranks, inside the job
                page.goto(f"{url}/user/{user}/lab/tree/slurm.ipynb")
                page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
                page.wait_for_function(KERNEL_IDLE_JS, timeout=120_000)
                run_cells(page, 0, 2)
            for user, page in pages.items():
                try:
                    page.wait_for_function(DONE_JS, arg=[0, 2], timeout=240_000)
                except Exception:
                    pytest.fail(f"{user}'s first two cells did not finish in 240 s\n"
                                + stuck(user, page) + hub_log())
                text = page.locator(CELLS).nth(1).inner_text()
                lines = re.findall(r"rank (\d)/(\d) (\S+) job=(\S+) uid=(\d+)", text)
                assert sorted(lines) == [(str(r), "2", "gloo", jobs[user], str(uids[user])) for r in range(2)], text
            timings["cells run"] = time.monotonic() - start
            run_cells(pages["slurmer02"], 2, 1)  # the busy cell: learner 2 stays active
            pages["slurmer02"].wait_for_selector("text=busy 3", timeout=60_000)
            # 4. learner 1 leaves: the idle culler stops the server, scancel ends the job
            pages["slurmer01"].context.close()
            wait(lambda: not squeue(slurm, "-u", "slurmer01"), 150,
                 lambda: "the culler did not end slurmer01's job\n" + hub_log())
            timings["culled"] = time.monotonic() - start
            rows = squeue(slurm, "-u", "slurmer02", "-o", "%i %T")
            assert rows == [[jobs["slurmer02"], "RUNNING"]], rows
            hub.send_signal(signal.SIGTERM)  # the hub's stop cancels every server's job
            hub.wait(timeout=90)
        wait(lambda: not squeue(slurm), 60, lambda: f"jobs left after the hub's stop: {squeue(slurm)}\n" + hub_log())
        culled = [line for line in (folder / "hub.log").read_text().splitlines()
                  if "DELETE /hub/api/users/slurmer01/server" in line and "idle-culler@" in line]
        assert culled, "the hub's log shows no idle culler's stop of slurmer01's server"
        assert not [line for line in (folder / "hub.log").read_text().splitlines()
                    if "DELETE /hub/api/users/slurmer02/server" in line], "slurmer02 was culled while busy"
        timings["hub stopped, squeue empty"] = time.monotonic() - start
        print("slurm hub test:", ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    finally:
        if hub is not None and hub.poll() is None:
            hub.send_signal(signal.SIGTERM)
            try:
                hub.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        if hub is not None:
            try:
                os.killpg(hub.pid, signal.SIGKILL)  # the proxy and the culler share its session
            except ProcessLookupError:
                pass
            hub.wait(timeout=10)
        if log is not None:
            log.close()
        if slurm.procs:
            for user in LEARNERS:  # jobs of a failed run
                slurm.run(["scancel", "--user", user], check=False, timeout=20)
        subprocess.run([sys.executable, "-m", "ddplab", "classroom", str(folder), "--delete-accounts", "--yes"],
                       capture_output=True, text=True, env=room.env(), timeout=120)
        strays = slurm.stop()
        room.restore_modes(modes)
        shutil.rmtree(base, ignore_errors=True)
    left = [n for n in [*LEARNERS, INSTRUCTOR, f"{INSTRUCTOR}-grader"] if accounts.exists(n)]
    assert not left, "accounts left behind"
    assert not strays, f"processes left after Slurm's stop: {strays}"


def stuck(user, page) -> str:
    """What a learner's page shows and what runs as that learner, for a cell that never finished."""
    try:
        cells = "\n---\n".join(page.locator(CELLS).all_inner_texts())[-4000:]
    except Exception as e:  # the page itself may be gone
        cells = f"(the page could not be read: {e})"
    ps = subprocess.run(["ps", "-u", user, "-o", "pid,ppid,stat,etime,time,rss,args", "--forest"],
                        capture_output=True, text=True).stdout
    return f"cells:\n{cells}\nprocesses of {user}:\n{ps}\nload: {os.getloadavg()}\n"


def server_listeners(uids):
    """(ip, port) of every socket a learner's jupyterhub-singleuser server listens on."""
    import psutil

    found = []
    for p in psutil.process_iter(["uids", "cmdline"]):
        cmd = p.info["cmdline"] or []
        # the server's Python, not the srun that started it (srun's own I/O ports are its business)
        if p.info["uids"] and p.info["uids"].real in uids and cmd and \
                os.path.basename(cmd[0]).startswith("python") and any("jupyterhub-singleuser" in a for a in cmd):
            found += [(c.laddr.ip, c.laddr.port) for c in p.net_connections("tcp")
                      if c.status == psutil.CONN_LISTEN]
    return found


def _up(url):
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/hub/login", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False
