"""Seats (GPUs and CPUs per learner) on fake GPU lists, and the folder `python -m ddplab classroom` writes.

The GPU lists come from a fake ``nvidia-smi`` on PATH that prints what the real one prints for
the two queries ddplab makes, so the parsing, the placement rules and CUDA_VISIBLE_DEVICES
renumbering all run as they would on a GPU server.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddplab.course import hubconfig
from ddplab.course.seats import NOTE_VAR, Seats
from ddplab.placement import gpus

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

ROOT = Path(__file__).resolve().parents[2]


def fake_smi(folder: Path, n: int, busy: dict | None = None, used_mib=3) -> Path:
    """A fake nvidia-smi with ``n`` GPUs; ``busy`` maps GPU index -> pid of another process."""
    rows = "".join(f"{i}, GPU-{i:04d}aaaa, Fake H100, 81559, {used_mib}\\n" for i in range(n))
    apps = "".join(f"GPU-{i:04d}aaaa, {pid}\\n" for i, pid in (busy or {}).items())
    script = folder / "nvidia-smi"
    script.write_text("#!/bin/sh\ncase \"$1\" in\n"
                      f"  --query-gpu=*) printf '{rows}' ;;\n"
                      f"  --query-compute-apps=*) printf '{apps}' ;;\n"
                      "  *) exit 1 ;;\nesac\n")
    script.chmod(0o755)
    return folder


@pytest.fixture
def smi(tmp_path, monkeypatch):
    def install(n, busy=None, used_mib=3):
        fake_smi(tmp_path, n, busy, used_mib)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        monkeypatch.delenv(NOTE_VAR, raising=False)
    return install


def test_learners_get_disjoint_gpu_sets_and_the_overflow_runs_on_cpu_and_is_told(smi):
    smi(4)
    seats = Seats(gpus_per_learner=2, threads=2, cpus=range(8))
    a, b, c = seats.take("ann"), seats.take("bob"), seats.take("cy")
    assert a.gpus == ("GPU-0000aaaa", "GPU-0001aaaa") and b.gpus == ("GPU-0002aaaa", "GPU-0003aaaa")
    assert a.note == b.note == ""
    assert c.gpus == () and "none are free" in c.note and "CPU" in c.note
    assert c.environment()["CUDA_VISIBLE_DEVICES"] == "" and c.environment()[NOTE_VAR] == c.note
    assert len({*a.cpus, *b.cpus, *c.cpus}) == 6  # disjoint CPUs while there are enough
    assert seats.take("ann") == a  # a learner keeps the seat they hold


def test_a_gpu_another_process_holds_is_not_handed_out(smi):
    smi(3, busy={1: 4242})
    seats = Seats(gpus_per_learner=1, threads=1, cpus=range(4))
    assert [seats.take(u).gpus for u in ("ann", "bob")] == [("GPU-0000aaaa",), ("GPU-0002aaaa",)]
    third = seats.take("cy")
    assert third.gpus == () and "4242" in third.note


def test_memory_in_use_counts_as_busy_where_pids_are_hidden(smi, tmp_path):
    smi(2, used_mib=20000)
    (tmp_path / "nvidia-smi").write_text((tmp_path / "nvidia-smi").read_text().replace(
        "--query-compute-apps=*) printf ''", "--query-compute-apps=*) exit 1"))
    seat = Seats(gpus_per_learner=1, threads=1, cpus=[0]).take("ann")
    assert seat.gpus == () and "judged by memory" in seat.note


def test_a_released_seat_goes_to_the_next_learner(smi):
    smi(2)
    seats = Seats(gpus_per_learner=2, threads=1, cpus=range(2))
    first = seats.take("ann")
    assert seats.take("bob").gpus == ()
    seats.release("ann")
    seats.release("bob")
    assert seats.take("bob").gpus == first.gpus


def test_cpus_are_shared_evenly_once_there_are_more_learners_than_cpus():
    seats = Seats(gpus_per_learner=0, threads=2, cpus=range(4))
    got = [seats.take(u).cpus for u in ("a", "b", "c")]
    assert got[0] == (0, 1) and got[1] == (2, 3) and len(got[2]) == 2
    assert all(seat.note == "" and seat.gpus == () for seat in seats.taken.values())


def test_inside_a_learners_server_cluster_placement_takes_that_learners_gpus(smi, monkeypatch):
    smi(4)
    seats = Seats(gpus_per_learner=2, threads=1, cpus=range(4))
    seats.take("ann")
    bob = seats.take("bob")
    for key, value in bob.environment().items():
        monkeypatch.setenv(key, value)
    placed = gpus.place(2, "auto")  # what Cluster(2) calls, no arguments
    assert placed.backend == "nccl" and placed.gpus == (0, 1) and placed.notes == ()
    assert [g.uuid for g in gpus.discover()] == list(bob.gpus)  # CUDA's 0, 1 are bob's GPUs


def test_an_overflow_learners_cluster_runs_on_cpu_and_prints_why(smi, monkeypatch):
    smi(1)
    seats = Seats(gpus_per_learner=1, threads=1, cpus=range(2))
    seats.take("ann")
    for key, value in seats.take("bob").environment().items():
        monkeypatch.setenv(key, value)
    placed = gpus.place(2, "auto")
    assert placed.backend == "gloo" and placed.notes == (os.environ[NOTE_VAR],)


def test_bad_seat_options_say_what_to_do():
    with pytest.raises(ValueError, match="gpus_per_learner"):
        Seats(gpus_per_learner=-1)
    with pytest.raises(ValueError, match="threads"):
        Seats(threads=0)


def classroom(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "ddplab", "classroom", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def test_classroom_writes_a_hub_config_a_course_and_a_readme(tmp_path):
    roster = tmp_path / "roster.txt"
    roster.write_text("ann\nbob\n")
    out = classroom(str(tmp_path / "c"), "--roster", str(roster), "--cpu-only", "--threads", "1",
                    "--proxy", sys.executable, "--port", "18123", "--trusted-class")
    assert out.returncode == 0, out.stderr
    assert "UNSAFE" in out.stdout and "DDPLAB_HUB_PASSWORD=" in out.stdout
    room = tmp_path / "c"
    config = (room / "jupyterhub_config.py").read_text()
    compile(config, "jupyterhub_config.py", "exec")
    for expected in ["LEARNERS = ['ann', 'bob']", "INSTRUCTOR = 'instructor'",
                     "c.Authenticator.allowed_users = set(LEARNERS) | {INSTRUCTOR}",
                     "Seats(gpus_per_learner=0, threads=1)",
                     "GUARD = [PYTHON, '-m', 'ddplab.course.proxy_guard', '--parent', str(os.getpid())]",
                     f"c.ConfigurableHTTPProxy.command = GUARD + [{str(Path(sys.executable).resolve())!r}]",
                     "c.Spawner.cmd = GUARD + [PYTHON, '-m', 'jupyterhub.singleuser']",
                     "'command': GUARD + [", "jupyterhub_idle_culler",
                     "c.JupyterHub.ip = '127.0.0.1'", "SimpleLocalProcessSpawner", "SharedPasswordAuthenticator"]:
        assert expected in config, expected
    assert "allow_all =" not in config and "DummyAuthenticator" not in config
    course = (room / "course" / "nbgrader_config.py").read_text()
    assert "c.Execute.timeout = 120" in course and "configure(c)" in course
    assert (room / "course" / "source" / "00-first-process-group" / "00-first-process-group.ipynb").exists()
    assert (room / "course" / "roster.csv").read_text().split() == ["id", "ann", "bob"]
    assert "JUPYTERHUB_USER" in (room / "learner-config" / "nbgrader_config.py").read_text()
    hidden = json.loads((room / "learner-config" / "labconfig" / "page_config.json").read_text())
    assert {"@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment"} <= set(
        k for k, v in hidden["disabledExtensions"].items() if v)
    readme = (room / "README.md").read_text()
    assert "NOT enforced" in readme and "UNSAFE" in readme and "Nbgrader > Assignment List" in readme


def render(**changes):
    options = dict(folder="/srv/class", learners=["ann"], admin="t", gpus_per_learner=1, threads=2,
                   mem_gib=3.0, spawner="local", trusted=False, ip="127.0.0.1", port=8000,
                   proxy_cmd="/opt/chp", idle_timeout=600)
    return hubconfig.render(**{**options, **changes})


def test_by_default_learners_are_accounts_checked_by_pam_and_only_the_roster_logs_in():
    text = render()
    compile(text, "jupyterhub_config.py", "exec")
    assert "class ClassAuthenticator(RateLimitedLogins, PAMAuthenticator)" in text and "check_logins(" in text
    assert "LocalProcessSpawner" in text and "SimpleLocalProcessSpawner" not in text
    assert "allow_root" not in text and "allow_all =" not in text and "DummyAuthenticator" not in text


def test_the_one_account_hub_refuses_to_start_without_its_two_passwords(tmp_path, monkeypatch):
    from traitlets.config import Config

    text = render(trusted=True, folder=str(tmp_path))
    for var in hubconfig.PASSWORD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(hubconfig.PASSWORD_VARS[0], "long-enough")
    with pytest.raises(SystemExit, match="DDPLAB_HUB_ADMIN_PASSWORD"):
        exec(compile(text, "jupyterhub_config.py", "exec"), {"get_config": Config})


def test_an_account_without_a_password_stops_the_hub_before_it_starts(tmp_path):
    from ddplab.course.accounts import AccountError, check_logins

    shadow = tmp_path / "shadow"
    shadow.write_text("root:$y$j9T$abc:19000:0:99999:7:::\nnobody::19000:0:99999:7:::\n")
    check_logins(["root"], shadow=str(shadow))
    with pytest.raises(AccountError, match="nobody has no password"):
        check_logins(["root", "nobody"], shadow=str(shadow))
    with pytest.raises(AccountError, match="no Unix account"):
        check_logins(["no-such-learner-xyz"], shadow=str(shadow))
    shadow.write_text("root:!$y$j9T$abc:19000:0:99999:7:::\nnobody:*:19000:0:99999:7:::\n")
    for locked in ("root", "nobody"):  # locked, and never set: PAM lets neither in with a password
        with pytest.raises(AccountError, match=f"{locked} cannot log in with a password.*`passwd {locked}`"):
            check_logins([locked], shadow=str(shadow))
    # what pam_unix refuses too: no hash at all, an expired account, a password to change first
    today = 20000
    for line, why in [("root:x:19000:0:99999:7:::", "has a password field that is not a hash"),  # usermod -p x
                      ("root:$y$j9T$abc:19000:0:99999:7::0:", "is expired"),  # chage -E 0
                      ("root:$y$j9T$abc:19000:0:99999:7::20000:", "is expired"),  # expires today
                      ("root:$y$j9T$abc:0:0:99999:7:::", "must change its password"),   # chage -d 0
                      ("root:$y$j9T$abc:19000:0:90:7:::", "has a password past its maximum age")]:
        shadow.write_text(line + "\n")
        fix = "chage -E -1 root" if why == "is expired" else "passwd root"
        with pytest.raises(AccountError, match=f"root {why}.*`{fix}`"):
            check_logins(["root"], shadow=str(shadow), today=today)
    shadow.write_text("root:$y$j9T$abc:19990:0:90:7::20001:\nnobody:abcdefghijklm:19000::::::\n")
    check_logins(["root", "nobody"], shadow=str(shadow), today=today)  # in date; an old DES hash


def test_help_names_the_one_account_mode_unsafe():
    out = classroom("--help")
    assert out.returncode == 0 and "--trusted-class" in out.stdout
    assert "UNSAFE" in out.stdout.split("--trusted-class", 2)[2][:200]


@pytest.mark.parametrize("args, message", [
    (["--learners", "0"], "at least 1"),
    (["--learners", "2", "--proxy", "/no/such/proxy"], "configurable-http-proxy not found"),
    # a proxy that exists (this Python stands in), so these fail on their own option wherever
    # `npm ci --prefix proxy` has not run yet (make test-unit runs before make test-hub's npm ci)
    (["--learners", "2", "--proxy", sys.executable, "--ip", "0.0.0.0"], "--ssl-cert and --ssl-key"),
    (["--learners", "2", "--proxy", sys.executable, "--ip", "192.168.1.5", "--ssl-cert", "/no/cert.pem",
      "--ssl-key", "/no/key.pem"], "no such file"),
])
def test_classroom_refuses_bad_options_with_a_message(tmp_path, args, message):
    out = classroom(str(tmp_path / "c"), "--trusted-class", *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not (tmp_path / "c").exists()


def test_a_lan_address_takes_tls_or_an_explicit_insecure_lan(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("x")
    key.write_text("x")
    out = classroom(str(tmp_path / "tls"), "--learners", "1", "--trusted-class", "--proxy", sys.executable,
                    "--ip", "0.0.0.0", "--ssl-cert", str(cert), "--ssl-key", str(key))
    assert out.returncode == 0, out.stderr
    config = (tmp_path / "tls" / "jupyterhub_config.py").read_text()
    assert f"c.JupyterHub.ssl_cert = {str(cert)!r}" in config and f"c.JupyterHub.ssl_key = {str(key)!r}" in config
    assert "https://0.0.0.0" in (tmp_path / "tls" / "README.md").read_text()
    out = classroom(str(tmp_path / "plain"), "--learners", "1", "--trusted-class", "--proxy", sys.executable,
                    "--ip", "0.0.0.0", "--insecure-lan")
    assert out.returncode == 0 and "ssl_cert" not in (tmp_path / "plain" / "jupyterhub_config.py").read_text()


def test_classroom_refuses_bad_names_and_a_folder_in_use(tmp_path):
    roster = tmp_path / "roster.txt"
    roster.write_text("Ann Smith\n")
    out = classroom(str(tmp_path / "c"), "--roster", str(roster), "--proxy", sys.executable)
    assert out.returncode == 2 and "lower-case" in out.stderr
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    out = classroom(str(tmp_path / "used"), "--learners", "1", "--proxy", sys.executable)
    assert out.returncode == 2 and "not empty" in out.stderr


def test_the_systemd_recipe_enforces_memory_and_pins_cpus():
    text = render(spawner="systemd")
    compile(text, "jupyterhub_config.py", "exec")
    assert "c.Spawner.mem_limit = '3.0G'" in text and "AllowedCPUs" in text
    assert "PAMAuthenticator" in text and "SystemdSpawner" in text


def test_the_class_readme_says_memory_is_enforced_only_where_it_is(monkeypatch, tmp_path):
    from argparse import Namespace

    from ddplab.course import limits
    from ddplab.course.classroom_readme import readme

    args = Namespace(spawner="local", ssl_cert=None, trusted_class=False, instructor="teach", threads=2,
                     mem_gib=3.0, ip="127.0.0.1", port=8000, idle_timeout=600)
    monkeypatch.setattr(limits, "writable", lambda base=limits.BASE: ["memory", "pids"])
    assert "memory 3.0 GiB enforced for all of a learner's processes together" in readme(tmp_path, ["ann"], 0, args)
    monkeypatch.setattr(limits, "writable", lambda base=limits.BASE: [])
    assert "memory 3.0 GiB NOT per learner" in readme(tmp_path, ["ann"], 0, args)
    assert "enforced by Slurm" in readme(tmp_path, ["ann"], 0, Namespace(**{**vars(args), "spawner": "slurm"}))
