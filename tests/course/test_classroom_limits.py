"""A learner's limits hold, and nothing of theirs outlives their server (ddplab/course/limits.py).

As the hub's spawner does it, without a hub: a real Unix account's "server" (a bash script)
joins the learner's cgroups as root, then switches to the account. In it:

- a `nohup` CPU burner and a `setsid sleep` start in the background;
- the learner cannot leave their groups (writing themselves into the root group fails) nor
  raise their limits (pids.max and memory.limit_in_bytes are root's);
- widening the affinity mask to every CPU leaves it at the seat's CPU;
- touching twice the memory limit gets that process, and only it, killed (SIGKILL: 137).

Then the server "stops" (limits.end): the burner, the sleep and the server are gone, and so are
the groups. Needs root and a writable cgroup v1 (it skips elsewhere, saying why); runs under
make test-hub.
"""
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from ddplab.course import accounts, limits

pytestmark = [pytest.mark.hub, pytest.mark.skipif(
    not os.environ.get("DDPLAB_HUB_TEST"), reason="runs under make test-hub (DDPLAB_HUB_TEST=1)")]
NAME = "lmtlearner"
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable  # any account may run it
SERVER = r"""
nohup sh -c 'while :; do :; done' > /dev/null 2>&1 &
echo "burner $!"
setsid sleep 6021 < /dev/null > /dev/null 2>&1 &
if echo $$ > {root_procs} 2>/dev/null; then echo left-the-group; else echo stayed; fi
if echo 99999 > {pids_max} 2>/dev/null; then echo raised-pids; else echo pids-kept; fi
if echo 99999999999 > {mem_limit} 2>/dev/null; then echo raised-memory; else echo memory-kept; fi
{python} -c "import os; os.sched_setaffinity(0, range(os.cpu_count())); print('cpus', sorted(os.sched_getaffinity(0)))"
{python} -c "x = bytearray({hog}); x[::4096] = b'1' * (len(x) // 4096); print('TOUCHED')"
echo "hog exit $?"
echo ready
sleep 600
"""


def preexec(cls, user):
    entry = pwd.getpwnam(user)

    def run():
        limits.join(cls, user)  # as root, then the switch to the learner, as the spawner does
        os.setgroups([])
        os.setgid(entry.pw_gid)
        os.setuid(entry.pw_uid)
    return run


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(120)
def test_limits_hold_and_a_nohup_burner_dies_with_the_server():
    if accounts.can_create():
        pytest.skip(accounts.can_create())
    have = limits.writable()
    if set(have) != set(limits.CONTROLLERS):
        pytest.skip(f"cgroup v1 controllers writable here: {have or 'none'} (need {limits.CONTROLLERS})")
    if accounts.exists(NAME):
        pytest.fail(f"a Unix account {NAME} exists already: a leftover of an earlier run?")
    base = Path(tempfile.mkdtemp(prefix="ddplab-limits-test-"))
    base.chmod(0o755)
    cls, server = limits.class_name(base), None
    try:
        accounts.create(NAME, base / NAME)
        memory = 256 << 20
        groups = limits.prepare(cls, NAME, memory, threads=1, cpus=[0])
        assert len(groups) == len(limits.CONTROLLERS)  # devices too: a CPU-only seat, no GPU node denied
        group = {g.relative_to(limits.BASE).parts[0]: g for g in groups}
        script = SERVER.format(root_procs=limits.BASE / "memory" / "cgroup.procs",
                               pids_max=group["pids"] / "pids.max",
                               mem_limit=group["memory"] / "memory.limit_in_bytes",
                               python=PYTHON, hog=2 * memory)
        out = base / "server.out"
        with open(out, "w") as f:
            server = subprocess.Popen(["bash", "-c", script], preexec_fn=preexec(cls, NAME), cwd=base,
                                      stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while "ready" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        said = out.read_text()
        assert "ready" in said, said
        for words in ("stayed", "pids-kept", "memory-kept", "cpus [0]", "hog exit 137"):
            assert words in said, f"{words!r} not in:\n{said}"
        assert "TOUCHED" not in said.splitlines(), said  # (the "Killed" line quotes the command)
        burner = int(said.split("burner ")[1].split()[0])
        members = limits.members(cls, NAME)
        assert server.pid in members and burner in members, (server.pid, burner, members)
        assert (group["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "100000"
        assert (group["pids"] / "pids.max").read_text().strip() == str(limits.PIDS_PER_LEARNER)
        left = limits.end(cls, NAME)  # the server stops
        assert left == set()
        server.wait(timeout=10)
        uid = pwd.getpwnam(NAME).pw_uid
        living = [p for p in accounts.processes_of(uid) if _alive(p)]  # (a container's PID 1 may not reap)
        assert living == [], "a process of the learner outlived the server"
        assert not [g for g in groups if g.exists()], "the learner's groups were left"
    finally:
        if server is not None and server.poll() is None:
            server.kill()
        limits.end(cls, NAME)
        for controller in limits.CONTROLLERS:  # empty groups are removed with rmdir
            for folder in (limits.BASE / controller / "ddplab" / cls, limits.BASE / controller / "ddplab"):
                try:
                    folder.rmdir()
                except OSError:
                    pass
        if accounts.exists(NAME):
            subprocess.run(["userdel", "--remove", NAME], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
