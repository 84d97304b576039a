"""A SIGKILLed hub leaves no proxy: the guard in front of the proxy command (as the classroom's
hub config has it) ends the proxy when the process that started it dies; without the guard the
proxy, in a session of its own as JupyterHub starts it, outlives its hub. A hub that dies while
the guard is still starting leaves nothing either (the guard is told the hub's pid), and a
guarded command stops on SIGINT even when the hub was started with SIGINT ignored."""
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

HUB = """
import os, subprocess, sys, time
cmd = [a.replace('HUB_PID', str(os.getpid())) for a in sys.argv[1:]]
proxy = subprocess.Popen(cmd, start_new_session=True)  # as JupyterHub starts its proxy
print(proxy.pid, flush=True)
time.sleep(300)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def kill_the_hub(proxy_cmd):
    hub = subprocess.Popen([sys.executable, "-c", HUB, *proxy_cmd], stdout=subprocess.PIPE, text=True,
                           env=dict(os.environ, PYTHONPATH=os.getcwd()))
    proxy = int(hub.stdout.readline())
    time.sleep(0.5)  # the guard has exec'd the proxy by now
    assert alive(proxy)
    hub.kill()
    hub.wait()
    return proxy


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")
def test_a_sigkilled_hub_takes_its_guarded_proxy_with_it():
    proxy = kill_the_hub([sys.executable, "-m", "ddplab.course.proxy_guard", "--parent", "HUB_PID", "sleep", "300"])
    deadline = time.monotonic() + 5
    while alive(proxy) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(proxy)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux-only")
def test_without_the_guard_the_proxy_outlives_a_sigkilled_hub():
    proxy = kill_the_hub(["sleep", "300"])
    try:
        time.sleep(1.0)
        assert alive(proxy)  # the leak the guard exists for
    finally:
        os.kill(proxy, signal.SIGKILL)


# A hub that starts a command the way JupyterHub's spawner does (its own session) and is
# SIGKILLed at once, long before the guard's Python has started.
DIES_AT_ONCE = """
import os, signal, subprocess, sys
cmd = [a.replace('HUB_PID', str(os.getpid())) for a in sys.argv[1:]]
child = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
print(child.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
GUARD = [sys.executable, "-m", "ddplab.course.proxy_guard"]


def start_and_die(cmd) -> int:
    hub = subprocess.run([sys.executable, "-c", DIES_AT_ONCE, *cmd], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert hub.returncode == -signal.SIGKILL
    return int(hub.stdout)


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")
def test_a_hub_killed_while_its_guard_starts_leaves_nothing_running():
    # about 1 s: the guard's start-up (it finds the hub gone and starts nothing)
    child = start_and_die([*GUARD, "--parent", "HUB_PID", "sleep", "300"])
    assert gone_within(child, 5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")
def test_without_the_hubs_pid_that_race_leaves_the_command_running():
    # the race the test above closes: the guard ties itself to its new parent (init), too late
    child = start_and_die([*GUARD, "sleep", "300"])
    try:
        time.sleep(1.5)  # past the guard's start-up: sleep 300 has been exec'd
        assert alive(child)
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_guarded_command_stops_on_sigint_even_when_started_with_it_ignored():
    # A hub started in the background by a shell passes SIGINT ignored to what it starts; the
    # idle culler then ignored the stopping hub's SIGINT, and the hub waited 30 s. About 1 s.
    program = "import time; print('up', flush=True); time.sleep(60)"
    cmd = [*GUARD, sys.executable, "-c", program]
    guarded = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env=dict(os.environ, PYTHONPATH=os.getcwd()),
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert guarded.stdout.readline() == "up\n"
        guarded.send_signal(signal.SIGINT)
        assert guarded.wait(timeout=5) != 0
    finally:
        guarded.kill()
        guarded.wait()


def test_the_classroom_hub_config_puts_the_guard_in_front_of_the_proxy(tmp_path):
    import _classroom as room

    # the one-account mode: this checks the config only (a learners' class needs a folder
    # every account can enter, which pytest's tmp_path under /tmp/pytest-of-root is not)
    folder = room.make_room(tmp_path / "class", "--learners", "2", "--cpu-only", "--trusted-class",
                            "--proxy", sys.executable)
    config = (folder / "jupyterhub_config.py").read_text()
    assert "GUARD = [PYTHON, '-m', 'ddplab.course.proxy_guard', '--parent', str(os.getpid())]" in config
    assert "c.ConfigurableHTTPProxy.command = GUARD + [" in config  # the proxy, and the culler too
    assert "'command': GUARD + [" in config


def test_the_guard_says_how_to_use_it():
    out = subprocess.run([sys.executable, "-m", "ddplab.course.proxy_guard"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.returncode == 2 and "usage" in out.stderr
    bad = subprocess.run([*GUARD, "--parent", "hub", "sleep", "1"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert bad.returncode == 2 and "--parent takes the pid" in bad.stderr
