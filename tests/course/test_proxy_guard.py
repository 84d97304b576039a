"""A SIGKILLed hub leaves no proxy: the guard in front of the proxy command (as the classroom's
hub config has it) ends the proxy when the process that started it dies; without the guard the
proxy, in a session of its own as JupyterHub starts it, outlives its hub."""
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

HUB = """
import subprocess, sys, time
cmd = sys.argv[1:]
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
    proxy = kill_the_hub([sys.executable, "-m", "ddplab.course.proxy_guard", "sleep", "300"])
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


def test_the_classroom_hub_config_puts_the_guard_in_front_of_the_proxy(tmp_path):
    import _classroom as room

    # the one-account mode: this checks the config only (a learners' class needs a folder
    # every account can enter, which pytest's tmp_path under /tmp/pytest-of-root is not)
    folder = room.make_room(tmp_path / "class", "--learners", "2", "--cpu-only", "--trusted-class",
                            "--proxy", sys.executable)
    config = (folder / "jupyterhub_config.py").read_text()
    assert "GUARD = [PYTHON, '-m', 'ddplab.course.proxy_guard']" in config
    assert "c.ConfigurableHTTPProxy.command = GUARD + [" in config  # the proxy, and the culler too
    assert "'command': GUARD + [" in config


def test_the_guard_says_how_to_use_it():
    out = subprocess.run([sys.executable, "-m", "ddplab.course.proxy_guard"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.returncode == 2 and "usage" in out.stderr
