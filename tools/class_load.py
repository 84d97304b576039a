"""A full class, measured: N learners log in at once to a real hub, start their servers, run lab 00.

For each N given (one class after another, never two at once)::

    python tools/class_load.py 10 20 30 --out build/load-test     (make load-test N="10 20 30")

1. ``python -m ddplab classroom`` writes a class of N learner accounts (load01, ...) on loopback
   (``--cpu-only --threads 1``, ``--mem-gib`` and ``--max-learners`` as given, else the class's own
   size from the machine's memory: ddplab/course/capacity.py), and its hub starts.
2. Every learner at once: the hub's log-in form over HTTP through the proxy (GET for the XSRF
   cookie, POST name and password), then ``/hub/spawn/<name>`` as a browser would. A learner past
   the class's size must get the 429 page saying "The class is full"; any other answer is a failure.
3. In each started server, through the Jupyter server's REST and websocket API: a kernel, lab 00's
   first cell with ``ddplab.Cluster(2, backend="gloo", threads=1)`` (the lab asks for 3 ranks),
   then the lab's all_reduce check on those ranks.
4. When every learner is done (or timed out), each learner's memory: their cgroup's peak
   (memory.max_usage_in_bytes: the server, kernel, ranks and the page cache they touched) and the
   RSS of their processes. Then their servers are stopped, the hub is stopped, the accounts deleted.
5. What is left: processes of the learners' uids, their accounts, their cgroups, files of theirs
   in /tmp, /var/tmp and /dev/shm (removed after being counted). The goal is nothing.

Every step has a timeout, the whole class has a deadline (``--deadline``), and the clean-up runs
whatever happened (an exception, SIGTERM, Ctrl-C, a timeout). When the machine's available memory
falls under ``--min-free-gib`` the run stops early and says so. Times are medians and 95th
percentiles over the learners that got that far. Needs root (accounts, PAM, cgroups), the proxy
(``npm ci --prefix proxy``) and an environment every account can run (make's HUB_VENV).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from tornado import httpclient, websocket  # noqa: E402

from ddplab.course import accounts, capacity, limits  # noqa: E402

PROXY = ROOT / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
LAB = ROOT / "labs" / "00-first-process-group.ipynb"
INSTRUCTOR = "loadteacher"
FULL = "The class is full"
# Per step, in seconds; the hub's own: Spawner.start_timeout 180 and http_timeout 120.
TIMEOUTS = {"login": 180, "spawn": 900, "kernel": 240, "first_cell": 600, "check": 180, "stop": 180}


def names(n: int) -> list[str]:
    return [f"load{i:02d}" for i in range(1, n + 1)]


def first_cell() -> tuple[str, str]:
    """Lab 00's first cell on 2 gloo ranks, 1 thread each; and its all_reduce check (cell 6)."""
    cells = [c for c in json.loads(LAB.read_text())["cells"] if c["cell_type"] == "code"]
    first = "".join(cells[0]["source"])
    asked = "ddplab.Cluster(max(3, ddplab.lab_world_size()))"
    if asked not in first:
        raise SystemExit(f"lab 00's first cell no longer says {asked}: update tools/class_load.py")
    check = next("".join(c["source"]) for c in cells if "def sum_of_ranks" in "".join(c["source"]))
    return first.replace(asked, 'ddplab.Cluster(2, backend="gloo", threads=1)'), check


def free_port() -> int:
    """A port p with p+1 and p+2 free too (proxy API, hub), below the OS's ephemeral range."""
    for _ in range(200):
        port = secrets.randbelow(20000) + 12000
        try:
            for p in (port, port + 1, port + 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no three free ports in a row")


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                PATH=str(pathlib.Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
                PYTHONUNBUFFERED="1")


def checkout_modes() -> dict:
    """The hub closes the checkout's answers to other accounts at its start: put back after."""
    paths = [ROOT, *ROOT.iterdir(), *(ROOT / "labs").iterdir()]
    return {p: p.lstat().st_mode & 0o7777 for p in paths if not p.is_symlink()}


def stats(values: list[float]) -> dict:
    return {"median": capacity.percentile(values, 50), "p95": capacity.percentile(values, 95)}


class Learner:
    def __init__(self, name: str, password: str):
        self.name, self.password = name, password
        self.cookies: dict[str, str] = {}
        self.times: dict[str, float] = {}
        self.outcome = "pending"  # served | full | failed
        self.why = ""
        self.kernel = None
        self.ws = None
        self.memory: dict = {}

    def fail(self, step: str, why: str) -> None:
        if self.outcome != "failed":
            self.outcome, self.why = "failed", f"{step}: {why}"[:800]


class Class:
    """One class of N learners on a real hub, from start to clean-up."""

    def __init__(self, n: int, args, out: pathlib.Path):
        self.n, self.args, self.out = n, args, out
        self.base = pathlib.Path(tempfile.mkdtemp(prefix="ddplab-load-"))
        self.base.chmod(0o755)
        self.folder = self.base / "class"
        self.token = "load" + secrets.token_hex(16)
        self.hub = self.url = None
        self.learners: list[Learner] = []
        self.uids: set[int] = set()
        self.notes: list[str] = []
        self.stopped_early = ""
        self.low_gib = capacity.machine().available_gib
        self.load = [os.getloadavg()[0]]
        self.http = httpclient.AsyncHTTPClient(force_instance=True, max_clients=400)

    # -- the class and its hub ------------------------------------------------------------
    def write(self) -> None:
        roster = self.base / "roster.txt"
        roster.write_text("\n".join(names(self.n)) + "\n")
        self.port = free_port()
        cmd = [sys.executable, "-m", "ddplab", "classroom", str(self.folder), "--roster", str(roster),
               "--instructor", INSTRUCTOR, "--cpu-only", "--threads", "1", "--port", str(self.port),
               "--proxy", str(PROXY), "--idle-timeout", "3600", "--mem-gib", str(self.args.mem_gib)]
        if self.args.max_learners:
            cmd += ["--max-learners", str(self.args.max_learners)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=120 + 10 * self.n)
        if done.returncode != 0:
            raise RuntimeError(f"classroom failed: {done.stderr[-2000:]}")
        table, passwords = False, {}
        for line in done.stdout.splitlines():
            table = table or line.startswith("Passwords")
            if table and line.startswith("  ") and len(line.split()) == 2:
                passwords[line.split()[0]] = line.split()[1]
        self.learners = [Learner(n, passwords[n]) for n in names(self.n)]
        self.uids = {pwd.getpwnam(n).pw_uid for n in [*names(self.n), INSTRUCTOR]}
        config = self.folder / "jupyterhub_config.py"
        limit = re.search(r"active_server_limit = (\d+)", config.read_text())
        self.limit = int(limit.group(1)) if limit else None
        with open(config, "a") as f:  # the load test's own token: read users, stop servers, use kernels
            f.write(f"\nc.JupyterHub.services.append({{'name': 'load', 'api_token': {self.token!r}}})\n"
                    "c.JupyterHub.load_roles.append({'name': 'load', 'scopes': ['admin:users', "
                    "'admin:servers', 'list:users', 'read:users', 'access:servers'], 'services': ['load']})\n")

    async def start_hub(self) -> None:
        self.log = open(self.folder / "hub.log", "w")  # noqa: SIM115 (closed in clean_up)
        self.hub = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", "jupyterhub_config.py"],
                                    cwd=self.folder, env=env(), stdout=self.log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        end = time.monotonic() + 120
        while time.monotonic() < end:
            if self.hub.poll() is not None:
                raise RuntimeError(f"the hub exited: {self.hub_log()}")
            with contextlib.suppress(Exception):
                r = await self.fetch("/hub/login", timeout=5)
                if r.code == 200:
                    return
            await asyncio.sleep(1)
        raise RuntimeError(f"the hub did not answer in 120 s: {self.hub_log()}")

    def hub_log_all(self) -> str:
        with contextlib.suppress(OSError):
            return (self.folder / "hub.log").read_text()
        return ""

    def hub_log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.folder / "hub.log").read_text()[-3000:]
        return ""

    async def fetch(self, path, method="GET", body=None, headers=None, timeout=60, token=False, cookies=None):
        headers = dict(headers or {})
        if token:
            headers["Authorization"] = f"token {self.token}"
        if cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
        req = httpclient.HTTPRequest(self.url + path, method=method, body=body, headers=headers,
                                     follow_redirects=False, request_timeout=timeout, connect_timeout=timeout)
        return await self.http.fetch(req, raise_error=False)

    async def api(self, path, method="GET", body=None, timeout=60):
        r = await self.fetch(f"/hub/api{path}", method=method, body=body, token=True, timeout=timeout)
        if r.code >= 400:
            raise RuntimeError(f"{method} {path}: {r.code} {r.body[:300]!r}")
        return json.loads(r.body) if r.body else None

    # -- one learner ------------------------------------------------------------------------
    async def learner(self, who: Learner, cells: tuple[str, str]) -> None:
        step = "login"
        try:
            t = time.monotonic()
            await asyncio.wait_for(self.log_in(who), TIMEOUTS["login"])
            who.times["login"] = time.monotonic() - t
            step = "spawn"
            t = time.monotonic()
            if not await asyncio.wait_for(self.spawn(who), TIMEOUTS["spawn"]):
                return  # the class is full: a clear answer, nothing started
            who.times["spawn"] = time.monotonic() - t
            step = "kernel"
            t = time.monotonic()
            await asyncio.wait_for(self.open_kernel(who), TIMEOUTS["kernel"])
            who.times["kernel"] = time.monotonic() - t
            step = "first_cell"
            t = time.monotonic()
            said = await asyncio.wait_for(self.execute(who, cells[0]), TIMEOUTS["first_cell"])
            who.times["first_cell"] = time.monotonic() - t
            if "Cluster" not in said:
                raise RuntimeError(f"the first cell showed no Cluster: {said[-300:]!r}")
            step = "check"
            said = await asyncio.wait_for(self.execute(who, cells[1]), TIMEOUTS["check"])
            if "[1.0, 1.0]" not in said:
                raise RuntimeError(f"all_reduce over the 2 ranks did not print [1.0, 1.0]: {said[-300:]!r}")
            who.outcome = "served"
        except asyncio.TimeoutError:
            who.fail(step, f"no answer within {TIMEOUTS[step]} s")
        except asyncio.CancelledError:
            who.fail(step, self.stopped_early or "cancelled (the class's deadline)")
            raise
        except Exception as e:  # noqa: BLE001 (every failure is reported, with its step)
            who.fail(step, f"{type(e).__name__}: {e}")

    def take_cookies(self, who: Learner, response) -> None:
        for header in response.headers.get_list("Set-Cookie"):
            name, _, rest = header.partition("=")
            who.cookies[name.strip()] = rest.split(";")[0]

    async def log_in(self, who: Learner) -> None:
        form = await self.fetch("/hub/login")
        self.take_cookies(who, form)
        xsrf = re.search(rb'name="_xsrf" value="([^"]+)"', form.body or b"")
        body = urllib.parse.urlencode({"username": who.name, "password": who.password,
                                       "_xsrf": xsrf.group(1).decode() if xsrf else who.cookies.get("_xsrf", "")})
        r = await self.fetch("/hub/login", method="POST", body=body, cookies=who.cookies,
                             headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=TIMEOUTS["login"])
        self.take_cookies(who, r)
        if r.code != 302 or "jupyterhub-session-id" not in who.cookies:
            raise RuntimeError(f"log-in answered {r.code}, not a redirect with a session: {r.body[-300:]!r}")

    async def spawn(self, who: Learner) -> bool:
        r = await self.fetch(f"/hub/spawn/{who.name}", cookies=who.cookies, timeout=TIMEOUTS["spawn"])
        page = (r.body or b"").decode(errors="replace")
        while r.code == 429 and "Too many users" in page:  # servers are starting: wait as told, again
            who.times["spawn_waits"] = who.times.get("spawn_waits", 0) + 1
            await asyncio.sleep(float(r.headers.get("Retry-After", 10)))
            r = await self.fetch(f"/hub/spawn/{who.name}", cookies=who.cookies, timeout=TIMEOUTS["spawn"])
            page = (r.body or b"").decode(errors="replace")
        if r.code == 429:
            if FULL in page:
                who.outcome = "full"
                who.why = re.sub(r"<[^>]+>", "", page[page.index(FULL):]).split("\n")[0][:400]
                return False
            raise RuntimeError(f"429 without '{FULL}': {re.sub(r'<[^>]+>', ' ', page)[-400:]!r}")
        if r.code not in (302, 200):
            raise RuntimeError(f"/hub/spawn answered {r.code}: {re.sub(r'<[^>]+>', ' ', page)[-400:]!r}")
        while True:  # the spawn-pending page polls the hub; so do we
            user = await self.api(f"/users/{who.name}")
            server = user["servers"].get("")
            if server and server.get("ready"):
                return True
            if not server or not server.get("pending"):
                said = [line for line in self.hub_log_all().splitlines()
                        if who.name in line and ("[W" in line or "[E" in line)]
                raise RuntimeError(f"the server did not start; the hub: {' | '.join(said[-3:])[-600:]}")
            await asyncio.sleep(2)

    async def open_kernel(self, who: Learner) -> None:
        r = await self.fetch(f"/user/{who.name}/api/kernels", method="POST", body='{"name": "python3"}',
                             token=True, headers={"Content-Type": "application/json"}, timeout=TIMEOUTS["kernel"])
        if r.code not in (200, 201):
            raise RuntimeError(f"starting a kernel answered {r.code}: {r.body[:300]!r}")
        who.kernel = json.loads(r.body)["id"]
        ws_url = self.url.replace("http", "ws") + f"/user/{who.name}/api/kernels/{who.kernel}/channels"
        who.ws = await websocket.websocket_connect(httpclient.HTTPRequest(
            ws_url, headers={"Authorization": f"token {self.token}"}, connect_timeout=TIMEOUTS["kernel"],
            request_timeout=TIMEOUTS["kernel"]), max_message_size=64 << 20)

    async def execute(self, who: Learner, code: str) -> str:
        msg_id = secrets.token_hex(8)
        who.ws.write_message(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": who.name,
                       "session": who.name, "version": "5.3", "date": ""},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        said, reply, idle = [], None, False
        while reply is None or not idle:
            raw = await who.ws.read_message()
            if raw is None:
                raise RuntimeError(f"the kernel's websocket closed; shown so far: {''.join(said)[-300:]!r}")
            if isinstance(raw, bytes):
                continue
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                said.append(content["text"])
            elif kind in ("execute_result", "display_data"):
                said.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                said.append(f"{content['ename']}: {content['evalue']}")
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
            elif kind == "execute_reply":
                reply = content
        if reply["status"] != "ok":
            raise RuntimeError(f"the cell raised {reply.get('ename')}: {reply.get('evalue')}: {''.join(said)[-300:]!r}")
        return "".join(said)

    # -- measuring, stopping, what is left ----------------------------------------------------
    def measure(self) -> None:
        cls = limits.class_name(str(self.folder))
        for who in self.learners:
            if who.outcome != "served":
                continue
            group = limits.BASE / "memory" / "ddplab" / cls / who.name
            with contextlib.suppress(OSError, ValueError):
                who.memory["cgroup_peak_mib"] = int((group / "memory.max_usage_in_bytes").read_text()) / 2**20
                who.memory["cgroup_now_mib"] = int((group / "memory.usage_in_bytes").read_text()) / 2**20
                stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
                who.memory["cgroup_rss_mib"] = int(stat["total_rss"]) / 2**20
            rss, count = 0, 0
            for pid in limits.members(cls, who.name) or accounts.processes_of(pwd.getpwnam(who.name).pw_uid):
                with contextlib.suppress(psutil.Error):
                    rss += psutil.Process(pid).memory_info().rss
                    count += 1
            who.memory["processes_rss_mib"], who.memory["processes"] = rss / 2**20, count

    async def stop_servers(self) -> None:
        async def stop(who):
            t = time.monotonic()
            with contextlib.suppress(Exception):
                if who.ws is not None:
                    who.ws.close()
                await self.api(f"/users/{who.name}/server", method="DELETE", timeout=TIMEOUTS["stop"])
                while (await self.api(f"/users/{who.name}"))["servers"]:
                    await asyncio.sleep(1)
                who.times["stop"] = time.monotonic() - t
        started = [w for w in self.learners if w.times.get("spawn") is not None]
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(stop(w) for w in started)), TIMEOUTS["stop"])

    async def watch_memory(self) -> None:
        while True:
            live = capacity.machine()
            self.low_gib = min(self.low_gib, live.available_gib)
            self.load.append(os.getloadavg()[0])
            swapped = psutil.swap_memory().used / 2**30
            if live.available_gib < self.args.min_free_gib or swapped > self.swap0 + 0.25:
                self.stopped_early = (f"stopped early: {live.available_gib:.1f} GiB available, "
                                      f"{swapped:.1f} GiB swapped")
                return
            await asyncio.sleep(1)

    async def run(self) -> None:
        cells = first_cell()
        self.swap0 = psutil.swap_memory().used / 2**30
        self.write()
        await self.start_hub()
        self.t0 = time.monotonic()
        guard = asyncio.ensure_future(self.watch_memory())
        work = asyncio.ensure_future(asyncio.gather(*(self.learner(w, cells) for w in self.learners)))
        done, _ = await asyncio.wait([guard, work], timeout=self.args.deadline,
                                     return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            self.stopped_early = self.stopped_early or f"stopped at the deadline ({self.args.deadline} s)"
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
        guard.cancel()
        self.measure()
        await self.stop_servers()

    def clean_up(self) -> dict:
        """Whatever happened: the hub, every process, the accounts, the cgroups, the files; and
        what of it was left (the goal: nothing)."""
        left = {}
        if self.hub is not None:
            if self.hub.poll() is None:
                self.hub.send_signal(signal.SIGTERM)  # it stops every server it started
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.hub.wait(timeout=90)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.hub.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.hub.wait(timeout=10)
            self.log.close()
        time.sleep(2)
        left["processes_after_hub"] = self.processes()
        left["tmp_files"] = self.tmp_files()
        if self.folder.exists():
            done = subprocess.run([sys.executable, "-m", "ddplab", "classroom", str(self.folder),
                                   "--delete-accounts", "--yes"], capture_output=True, text=True, env=env(),
                                  timeout=300 + 10 * self.n)
            if done.returncode != 0:
                self.notes.append(f"--delete-accounts: {done.stderr[-500:]}")
        for path in left["tmp_files"]:  # counted above; the learners' leftovers go with them
            with contextlib.suppress(OSError):
                shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
        left["processes"] = self.processes()
        left["accounts"] = [n for n in [*names(self.n), INSTRUCTOR, f"{INSTRUCTOR}-grader"] if accounts.exists(n)]
        cls = limits.class_name(str(self.folder))
        left["cgroups"] = [str(p) for p in limits.BASE.glob(f"*/ddplab/{cls}")]
        if hasattr(self, "log") and self.folder.exists():
            shutil.copyfile(self.folder / "hub.log", self.out / f"hub-{self.n}.log")
        shutil.rmtree(self.base, ignore_errors=True)
        for path, mode in self.modes.items():
            if path.exists():
                path.chmod(mode)
        return left

    def processes(self) -> list[str]:
        found = []
        for p in psutil.process_iter(["uids", "cmdline"]):
            if p.info["uids"] and p.info["uids"].real in self.uids:
                found.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:100]}")
        return found

    def tmp_files(self) -> list[str]:
        found = []
        for top in ("/tmp", "/var/tmp", "/dev/shm"):
            with contextlib.suppress(OSError):
                for entry in os.scandir(top):
                    with contextlib.suppress(OSError):
                        if entry.stat(follow_symlinks=False).st_uid in self.uids:
                            found.append(entry.path)
        return found

    def report(self, left: dict, error: str) -> dict:
        by = {k: [w.times[k] for w in self.learners if k in w.times]
              for k in ("login", "spawn", "kernel", "first_cell", "stop")}
        served = [w for w in self.learners if w.outcome == "served"]
        peaks = [w.memory["cgroup_peak_mib"] for w in served if "cgroup_peak_mib" in w.memory]
        rss = [w.memory["processes_rss_mib"] for w in served if "processes_rss_mib" in w.memory]
        out = {
            "n": self.n, "limit": getattr(self, "limit", None), "mem_gib": self.args.mem_gib,
            "started": sum(1 for w in self.learners if "spawn" in w.times),
            "served": len(served), "refused": sum(1 for w in self.learners if w.outcome == "full"),
            "spawn_waits": sum(w.times.get("spawn_waits", 0) for w in self.learners),
            "failures": sum(1 for w in self.learners if w.outcome in ("failed", "pending")),
            "times": {k: stats(v) for k, v in by.items()},
            "peak_mib": stats(peaks), "peak_mib_max": max(peaks, default=None),
            "rss_mib": stats(rss), "peak_mib_all": sum(peaks), "rss_mib_all": sum(rss),
            "available_gib_lowest": self.low_gib, "load_start": self.load[0], "load_max": max(self.load),
            "stopped_early": self.stopped_early, "error": error, "notes": self.notes, "left": left,
            "machine": {"total_gib": capacity.machine().total_gib, "cpus": os.cpu_count()},
            "learners": [{"name": w.name, "outcome": w.outcome, "why": w.why, "times": w.times,
                          "memory": w.memory} for w in self.learners],
        }
        out["nothing_left"] = not any(left.get(k) for k in ("processes", "accounts", "cgroups", "tmp_files",
                                                            "processes_after_hub"))
        return out


def one_class(n: int, args, out: pathlib.Path) -> dict:
    room = Class(n, args, out)
    room.modes = checkout_modes()
    error = ""
    try:
        asyncio.run(asyncio.wait_for(room.run(), args.deadline + 600))
    except BaseException as e:  # noqa: BLE001 (Ctrl-C and SIGTERM too: clean up, then say so)
        error = f"{type(e).__name__}: {e}"[:2000]
        if not isinstance(e, Exception):
            print(f"interrupted ({error}): cleaning up", file=sys.stderr)
    left = room.clean_up()
    return room.report(left, error)


def row(r: dict) -> dict:
    """One run as a row of ddplab/course/capacity.py's MEASURED (what --plan shows)."""
    out = {"n": r["n"], "started": r["started"], "refused": r["refused"], "failures": r["failures"],
           "peak_mib_median": r["peak_mib"]["median"], "peak_mib_max": r["peak_mib_max"],
           "load": round(r["load_start"], 1)}
    for key in ("login", "spawn", "first_cell"):
        for stat in ("median", "p95"):
            value = r["times"][key][stat]
            out[f"{key}_{stat}"] = None if value is None else round(value, 1)
    return out


def table(results: list[dict]) -> str:
    def pair(d):
        return "-" if d["median"] is None else f"{d['median']:.0f}/{d['p95']:.0f}"
    rows = ["    N  limit  served  full  failed  log-in s  start s  first cell s  peak MiB/learner  "
            "all MiB  free GiB  load  left"]
    for r in results:
        t = r["times"]
        peak = "-" if r["peak_mib"]["median"] is None else f"{r['peak_mib']['median']:.0f}/{r['peak_mib_max']:.0f}"
        rows.append(f"  {r['n']:3d}  {r['limit'] or 0:5d}  {r['served']:6d}  {r['refused']:4d}  {r['failures']:6d}  "
                    f"{pair(t['login']):>8}  {pair(t['spawn']):>7}  {pair(t['first_cell']):>12}  {peak:>16}  "
                    f"{r['peak_mib_all']:7.0f}  {r['available_gib_lowest']:8.1f}  {r['load_start']:4.1f}  "
                    f"{'nothing' if r['nothing_left'] else 'SOMETHING'}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("n", type=int, nargs="+", help="learners in each class, one class after another")
    p.add_argument("--out", default="build/load-test", help="where the JSON and the hubs' logs go")
    p.add_argument("--mem-gib", type=float, default=3.0, help="each learner's memory limit (classroom's) [3]")
    p.add_argument("--max-learners", type=int, default=None,
                   help="the class's size (classroom's; default: what the machine holds at --mem-gib)")
    p.add_argument("--deadline", type=int, default=2400, help="seconds for one class, clean-up aside [2400]")
    p.add_argument("--min-free-gib", type=float, default=1.0,
                   help="stop early when the machine's available memory falls below this [1]")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        p.error("a class's accounts and PAM log-in need root")
    if not PROXY.exists():
        p.error(f"{PROXY} is missing: npm ci --prefix proxy")
    bad = [n for n in args.n if not 1 <= n <= 99]
    if bad:
        p.error(f"between 1 and 99 learners per class, not {bad}")
    taken = [n for n in [*names(max(args.n)), INSTRUCTOR] if accounts.exists(n)]
    if taken:
        p.error(f"accounts {taken[:5]} exist already (a load test's leftovers?): userdel --remove them first")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stop = {"asked": False}

    def on_term(signum, frame):  # SIGTERM as Ctrl-C: the class in progress is cleaned up
        stop["asked"] = True
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    results = []
    for n in args.n:
        print(f"class of {n}: starting (load {os.getloadavg()[0]:.1f})", flush=True)
        result = one_class(n, args, out)
        results.append(result)
        (out / f"class-load-{n}.json").write_text(json.dumps(result, indent=1) + "\n")
        failed = [f"{w['name']}: {w['why']}" for w in result["learners"] if w["outcome"] in ("failed", "pending")]
        print(table([result]) + ("\n  " + "\n  ".join(failed[:10]) if failed else ""), flush=True)
        if result["error"] or result["stopped_early"] or stop["asked"]:
            print(f"class of {n}: {result['error'] or result['stopped_early'] or 'interrupted'}: no larger class "
                  "started", file=sys.stderr)
            break
    (out / "class-load.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "measured.json").write_text(json.dumps([row(r) for r in results], indent=1) + "\n")
    print(f"\n{table(results)}\n(times: median/95th percentile; peak: median/largest learner's cgroup peak; "
          f"JSON in {out})")
    ok = all(r["failures"] == 0 and r["nothing_left"] and not r["error"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
