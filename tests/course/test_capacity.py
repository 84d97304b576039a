"""A class's size on one machine (ddplab/course/capacity.py): the arithmetic, the hub's limit, --plan.

The learners' memory limits must add up to no more than the machine's memory less the headroom;
the class's jupyterhub_config.py sets JupyterHub's active_server_limit to that number (or to
--max-learners), its templates/error.html says "The class is full" on the 429 page that limit
gives; `classroom --plan` says the same number and the figures measured here. No hub, no accounts:
the real hub's refusal is tests/course/test_class_load.py (make test-hub).
"""
import argparse
import math
import re
import subprocess
import sys

import pytest

from ddplab.course import capacity, classroom, hubconfig

ROOT = capacity.__file__.rsplit("/ddplab/", 1)[0]


def live(total=24.0, available=20.0, cpus=2):
    return capacity.Machine(total, available, cpus)


def test_the_class_holds_what_its_learners_memory_limits_fit_in_less_the_headroom():
    assert capacity.server_limit(3.0, 24.0, headroom_gib=3.0) == 7       # 21 / 3
    assert capacity.server_limit(1.0, 23.5, headroom_gib=3.0) == 20      # 20.5 / 1
    assert capacity.server_limit(1.5, 23.5, headroom_gib=3.0) == 13      # 20.5 / 1.5 = 13.67
    assert capacity.server_limit(0.5, 3.5, headroom_gib=3.0) == 1
    for mem, total in [(3.0, 24.0), (1.25, 23.5), (0.75, 64.0), (2.0, 256.0)]:
        n = capacity.server_limit(mem, total)
        assert n * mem <= total - capacity.HEADROOM_GIB < (n + 1) * mem  # the most that fit, never more
    with pytest.raises(ValueError, match="hold no learner at --mem-gib 3"):
        capacity.server_limit(3.0, 5.0)
    with pytest.raises(ValueError, match="more than 0"):
        capacity.server_limit(0, 24.0)


def test_percentiles_and_the_suggested_limit_above_a_measured_peak():
    assert capacity.percentile([], 50) is None
    assert capacity.percentile([5.0], 95) == 5.0
    assert capacity.percentile([4, 1, 3, 2], 50) == 2.5
    assert capacity.percentile(list(range(1, 21)), 95) == pytest.approx(19.05)
    assert capacity.mem_gib_for(600) == 1.0          # 900 MiB, up to a quarter GiB
    assert capacity.mem_gib_for(700) == 1.25         # 1050 MiB
    assert capacity.mem_gib_for(1024, margin=1.0) == 1.0


def test_the_live_machine_is_read_from_proc(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683656 kB\nMemFree:  100 kB\nMemAvailable:   20971520 kB\n")
    m = capacity.machine(str(meminfo))
    assert m.total_gib == pytest.approx(24683656 / 2**20) and m.available_gib == 20.0 and m.cpus >= 1


MEASURED = {"machine": "a test box", "date": "today", "mem_gib": 1.0, "threads": 1, "runs": [
    {"n": 10, "started": 10, "refused": 0, "failures": 0, "login_median": 1, "login_p95": 2,
     "spawn_median": 30, "spawn_p95": 40, "first_cell_median": 50, "first_cell_p95": 70,
     "peak_mib_median": 590, "peak_mib_max": 620, "load": 9.0},
    {"n": 30, "started": 20, "refused": 10, "failures": 0, "login_median": 2, "login_p95": 5,
     "spawn_median": 90, "spawn_p95": 140, "first_cell_median": 150, "first_cell_p95": 210,
     "peak_mib_median": 600, "peak_mib_max": 640, "load": 12.0},
]}


def test_the_plan_names_the_size_the_shortfall_and_the_measured_times_near_it():
    p = capacity.plan(1.0, 1, live(23.5, 20.0), MEASURED)
    assert p["limit"] == 20 and p["cpus_per_learner"] == 0.1
    assert p["short_now_gib"] == pytest.approx(20 - (20.0 - 3.0))  # other jobs hold 3.5 GiB now
    assert p["nearest"]["n"] == 30  # 20 served there, none failed: the run nearest the class's size
    said = "\n".join(capacity.describe(p))
    assert "the class holds 20 servers at once" in said and "WARNING: other jobs use memory now" in said
    assert "at 20 learners there, lab 00's first cell took 150 s (median; 95th percentile 210 s)\n" in said + "\n"
    wider = "\n".join(capacity.describe(capacity.plan(0.5, 1, live(23.5, 23.0), MEASURED)))
    assert "took 150 s (median; 95th percentile 210 s); 41 at once were not measured" in wider
    assert re.search(r"\n\s+30\s+1\s+20\s+10\s+0\s+2/5\s+90/140\s+150/210\s+600 / 640", said), said
    roomy = capacity.describe(capacity.plan(3.0, 2, live(64.0, 63.5, 32), MEASURED))
    text = "\n".join(roomy)
    assert "holds 20 servers" in text and "WARNING" not in text
    # lab 00's first cell peaked at 640 MiB, but a whole lab did not fit in 1.5 GiB: no smaller limit
    assert "first cell peaked at 640 MiB" in text and "killed for memory at --mem-gib 1.5" in text
    assert "Keep --mem-gib at 3 or more" in text and "holds 61" not in text
    assert "no measured figures stored" in "\n".join(capacity.describe(capacity.plan(3.0, 2, live(), {"runs": []})))


def args_for(**changes):
    p = argparse.ArgumentParser()
    classroom.add_arguments(p)
    args = p.parse_args(["/nowhere", "--learners", "2"])
    for k, v in changes.items():
        setattr(args, k, v)
    return args


def test_the_hub_is_told_the_class_size_and_its_error_page_says_the_class_is_full(monkeypatch):
    monkeypatch.setattr(capacity, "machine", lambda: live(23.5, 20.0))
    assert classroom.max_servers(args_for(mem_gib=1.0)) == 20
    assert classroom.max_servers(args_for(mem_gib=3.0)) == 6          # the default --mem-gib
    assert classroom.max_servers(args_for(mem_gib=1.0, max_learners=4)) == 4
    assert classroom.max_servers(args_for(spawner="slurm")) is None   # Slurm queues the servers itself
    with pytest.raises(ValueError, match="at least 1"):
        classroom.max_servers(args_for(max_learners=0))
    with pytest.raises(ValueError, match="Slurm's partition limits"):
        classroom.max_servers(args_for(spawner="slurm", max_learners=3))
    text = hubconfig.render(folder="/srv/class", learners=["ann"], admin="t", gpus_per_learner=0, threads=1,
                            mem_gib=1.0, spawner="local", trusted=False, ip="127.0.0.1", port=8000,
                            proxy_cmd="/opt/chp", idle_timeout=600, max_servers=20, spawns=4)
    compile(text, "jupyterhub_config.py", "exec")
    assert "c.JupyterHub.active_server_limit = 20\n" in text
    assert "c.JupyterHub.template_paths = [str(HERE / 'templates')]" in text
    assert "c.JupyterHub.concurrent_spawn_limit = 4\n" in text  # one start per CPU at a time
    assert capacity.spawn_limit(1) == 2 and capacity.spawn_limit(2) == 2 and capacity.spawn_limit(64) == 64
    unlimited = hubconfig.render(folder="/srv/class", learners=["ann"], admin="t", gpus_per_learner=0,
                                 threads=1, mem_gib=1.0, spawner="local", trusted=False, ip="127.0.0.1",
                                 port=8000, proxy_cmd="/opt/chp", idle_timeout=600)
    assert "active_server_limit" not in unlimited and "template_paths" not in unlimited


def test_the_full_page_extends_jupyterhubs_own_and_speaks_only_for_the_active_server_limit(tmp_path):
    jinja2 = pytest.importorskip("jinja2")
    page = capacity.full_page(20, 1.0, spawns=2)
    assert page.startswith('{% extends "templates/error.html" %}')
    (tmp_path / "error.html").write_text(page)
    # JupyterHub's loader: its own templates under the prefix templates/, the class's first by name
    base = tmp_path / "base"
    base.mkdir()
    (base / "error.html").write_text("{% block error_detail %}<p>{{ message }}</p>{% endblock error_detail %}")
    env = jinja2.Environment(loader=jinja2.ChoiceLoader([
        jinja2.PrefixLoader({"templates": jinja2.FileSystemLoader([str(base)])}, "/"),
        jinja2.FileSystemLoader([str(tmp_path), str(base)])]))
    full = env.get_template("error.html").render(
        status_code=429, message="Active user limit exceeded. Try again in a few minutes.")
    assert "Active user limit exceeded" in full and "<strong>The class is full</strong>: 20 servers" in full
    assert "1 GiB of memory for each learner" in full and "--max-learners" in full and "--plan" in full
    # a size the instructor chose is said to be theirs, never what the machine holds
    theirs = capacity.full_page(3, 1.5, spawns=2, set_by_instructor=True)
    assert "as many as the instructor set (<code>--max-learners 3</code>)" in theirs
    assert "machine holds with" not in theirs
    busy = "Too many users trying to log in right now. Try again in 40 seconds."
    starting = env.get_template("error.html").render(status_code=429, message=busy)
    assert busy in starting and "starts 2 learners' servers at a time" in starting
    assert "The class is full" not in starting
    for status, message in [(404, "Not Found"), (500, None)]:
        other = env.get_template("error.html").render(status_code=status, message=message)
        assert "The class is full" not in other and "at a time" not in other


@pytest.mark.more  # two `python -m ddplab` processes: 2-3 s quiet, 20 s on a busy machine
def test_plan_on_the_command_line_needs_no_folder_and_writes_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ddplab", "classroom", "--plan", "--mem-gib", "1.5",
                           "--threads", "1"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    total = capacity.machine().total_gib
    expected = math.floor((total - capacity.HEADROOM_GIB) / 1.5 + 1e-9)
    assert f"the class holds {expected} servers at once" in done.stdout, done.stdout
    assert list(tmp_path.iterdir()) == []
    missing = subprocess.run([sys.executable, "-m", "ddplab", "classroom", "--learners", "2"],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120,
                             env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert missing.returncode == 2 and "FOLDER is needed" in missing.stderr, missing.stderr


def test_the_class_weighs_as_many_processes_as_it_has_servers_never_less(tmp_path):
    class_level = tmp_path / "cpu" / "ddplab" / "class-x"
    class_level.mkdir(parents=True)
    for level in (class_level.parent, class_level):
        (level / "cpu.shares").write_text("1024\n")  # the kernel's default: the class as one process
    written = capacity.weigh_class("class-x", 13, base=tmp_path)
    assert len(written) == 2
    assert [int((lvl / "cpu.shares").read_text()) for lvl in (class_level.parent, class_level)] == [13312, 13312]
    capacity.weigh_class("class-x", 2, base=tmp_path)  # another, smaller class: ddplab/ keeps the larger
    assert int((class_level.parent / "cpu.shares").read_text()) == 13312
    assert capacity.weigh_class("class-x", 10**6, base=tmp_path) and \
        int((class_level / "cpu.shares").read_text()) == capacity.SHARES_MAX
    assert capacity.weigh_class("no-such-class", 5, base=tmp_path / "none") == []  # no cgroup v1 cpu here
    text = hubconfig.render(folder="/srv/class", learners=["ann", "bob"], admin="t", gpus_per_learner=0,
                            threads=1, mem_gib=1.0, spawner="local", trusted=False, ip="127.0.0.1", port=8000,
                            proxy_cmd="/opt/chp", idle_timeout=600, max_servers=7)
    assert "        capacity.weigh_class(CLASS, 7)\n" in text


def test_a_whole_class_behind_one_address_may_log_in_at_once():
    # every log-in counts as failed until PAM answers: the address limit must hold the whole class
    assert classroom.login_limits(args_for(), 31)["per_address"] == 41
    assert classroom.login_limits(args_for(login_address_failures=3), 31)["per_address"] == 3
    assert classroom.login_limits(args_for(login_address_failures=0), 31)["per_address"] == 0  # no limit, as asked


def test_the_instructors_readme_says_the_class_size_and_when_the_roster_is_larger():
    from ddplab.course.classroom_readme import full_line

    assert "At most 6 servers at once" in full_line(["a"] * 5, argparse.Namespace(max_servers=6))
    assert "The class is full" not in full_line(["a"] * 5, argparse.Namespace(max_servers=6))  # 6 accounts fit
    six = argparse.Namespace(max_servers=6)
    assert "7 accounts (the roster and you) are more than that" in full_line(["a"] * 6, six)
    assert "Slurm" in full_line(["a"], argparse.Namespace(max_servers=None))
