"""A real Slurm for tests: munged, slurmctld and two emulated nodes n1, n2 on 127.0.0.1.

Debian's ``slurm-wlm`` (Slurm 22.05) and ``munge`` are installed with apt when
missing (CI runs as root). Everything this starts lives under one temporary
folder: its own munge key and socket (the machine's munged, if any, is left
alone), the controller's state, each node's spool, pid and log files, and ports
the OS said were free. Both nodes are this machine: ``NodeHostname=localhost``,
``NodeAddr=127.0.0.1`` and a ``Port=`` each, started as ``slurmd -N n1`` and
``slurmd -N n2``. The names n1 and n2 do not resolve, as on a cluster whose node
names only Slurm knows: a job must take its master address from NodeAddr.

The daemons run in the foreground as children of the test process (``-D``,
``-F``) and are stopped by their pids; jobs still queued are cancelled first,
and any process still holding the temporary folder in its environment (a stray
slurmstepd or task) is ended by pid too, so nothing is left running.

Where Slurm cannot be started, ``SlurmUnavailable`` says why; the fixture turns
it into a skip on a developer's machine and a failure in CI (``CI`` set).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge", "sudo")
NODES = ("n1", "n2")


class SlurmUnavailable(RuntimeError):
    """Slurm could not be installed or started here; the message says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install() -> None:
    """apt-get install the packages whose programs are missing (as root only)."""
    if all(shutil.which(p) for p in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurm-wlm and munge are not installed, and installing them needs root "
                               f"(apt-get install {' '.join(PACKAGES)})")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "-o", "DPkg::Lock::Timeout=300", "install", "-y", "--no-install-recommends", *PACKAGES]
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:  # a fresh machine may not have the package lists yet
        subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=300", "update"], check=False, env=env,
                       capture_output=True, text=True, timeout=600)
        done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed:\n{done.stderr[-2000:]}")


CONF = """\
ClusterName=ddplabtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1_port} CPUs=2 RealMemory=2048 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2_port} CPUs=2 RealMemory=2048 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class Slurm:
    """One private Slurm: ``start()``, ``run(cmd)`` with its SLURM_CONF, ``stop()``."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="ddplab-slurm-"))
        # other accounts (a class's learners submitting jobs) read slurm.conf and reach munge's
        # socket; the munge key stays 0600
        self.root.chmod(0o755)
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # -- start ---------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> Slurm:
        install()
        for sub in ("munge", "state", "log", "spool/n1", "spool/n2"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self.conf.write_text(CONF.format(host=socket.gethostname().split(".")[0], root=self.root,
                                         ctld_port=free_port(), n1_port=free_port(), n2_port=free_port()))
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in NODES:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait_idle(timeout)
        return self

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._spawn("munged", [
            "munged", "-F", "--force", f"--socket={self.root}/munge/munge.socket",
            f"--key-file={key}", f"--pid-file={self.root}/munge/munged.pid",
            f"--log-file={self.root}/log/munged.log", f"--seed-file={self.root}/munge/munged.seed"])
        deadline = time.monotonic() + 20
        while not (self.root / "munge" / "munge.socket").exists():
            self._check_alive("munged")
            if time.monotonic() > deadline:
                raise SlurmUnavailable("munged did not open its socket within 20 s:\n" + self.logs())
            time.sleep(0.1)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "wb") as log:
            # Its own session: a Ctrl-C at the terminal does not reach the daemons before stop() does.
            self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise SlurmUnavailable(f"{name} exited with {proc.returncode}:\n" + self.logs())

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            for name in self.procs:
                self._check_alive(name)
            done = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = done.stdout.strip()
            if done.returncode == 0 and sorted(states.split("\n")) == ["n1 idle", "n2 idle"]:
                return
            time.sleep(0.5)
        raise SlurmUnavailable(f"the nodes were not idle within {timeout:.0f} s (sinfo: {states!r}):\n"
                               + self.logs())

    # -- use -----------------------------------------------------------------------------------
    def run(self, cmd: list[str], check: bool = True, timeout: float = 60.0, **kw) -> subprocess.CompletedProcess:
        env = dict(self.env, **kw.pop("env", {}))
        done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=timeout, **kw)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
        return done

    def logs(self, tail: int = 1500) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace")
            if text.strip():
                parts.append(f"--- {path.name} ---\n{text[-tail:]}")
        return "\n".join(parts)

    # -- stop ----------------------------------------------------------------------------------
    def stop(self) -> list[int]:
        """Cancel jobs, stop the daemons and whatever still holds our folder; remove it.
        Returns the pids that had to be ended beyond the daemons (none, normally)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--user", "root"], check=False, timeout=20)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                q = self.run(["squeue", "-h"], check=False, timeout=20)
                if q.returncode != 0 or not q.stdout.strip():
                    break
                time.sleep(0.5)
        # the nodes first (they end their job steps), then the controller, munge last
        order = [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        strays = self.strays()
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
        return strays

    def strays(self) -> list[int]:
        """Processes (not ours to keep) whose environment names this Slurm's configuration."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.append(int(name))
            except OSError:
                continue
        return found
