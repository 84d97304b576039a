"""Limits a learner cannot lift, without a hub: GPU nodes, a private /tmp, grading in a cgroup, what doctor says.

Each as the hub does it (ddplab/course/gpu_nodes.py, private_tmp.py, limits.py, gradebox.py),
on real kernel objects, as root (each test skips elsewhere, saying why):

- GPU seats: with no GPU here, character devices of the NVIDIA major (195) are made in a temp
  folder. A process in the learner's ``devices`` group, as an unprivileged account, opening its
  seat's node gets ENXIO (no driver behind it: the kernel let it through) and another seat's
  node EPERM (the group refused it); nvidiactl's number stays open; the learner cannot lift
  the rule.
- private /tmp: two "servers" in namespaces of their own; one's files in /tmp and /dev/shm are
  not in the other's nor in the machine's; a child of the server sees them; the tmpfs is full at
  its size; unmounting it is refused; when the server's processes end, no process holds its
  namespace and the machine's mount table is as before. A real Cluster's gloo ranks meet there
  (marked ``more``).
- grading: a submission's fork bomb stops at its group's pids.max, its memory hog is killed by
  its group's memory limit, and the group is gone afterwards with every process in it.
- what doctor and ``classroom`` say from a given cgroup tree, and the mount namespace probe.
"""
import errno
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from ddplab.course import gpu_nodes, limits, private_tmp

PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable  # any account may run it
NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="makes cgroups, device nodes and mounts: root only")


def as_nobody(then=None):
    def run():
        if then:
            then()
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    return run


def need(controllers):
    missing = [c for c in controllers if c not in limits.writable()]
    if missing:
        pytest.skip(f"cgroup v1 {missing} not writable here")


# --- GPU nodes -------------------------------------------------------------------------------

OPEN_EACH = r"""
import errno, os, sys
for path in sys.argv[2:]:
    try:
        os.close(os.open(path, os.O_RDWR))
        print(os.path.basename(path), "opened")
    except OSError as e:
        print(os.path.basename(path), errno.errorcode[e.errno])
try:
    open(sys.argv[1], "w").write("a")
    print("lifted")
except OSError as e:
    print("kept", errno.errorcode[e.errno])
"""


def driver_info(folder, bus, uuid, minor):
    (folder / bus).mkdir(parents=True)
    (folder / bus / "information").write_text(
        f"Model: \t\t NVIDIA Test\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\n"
        f"Bus Location: \t {bus}\nDevice Minor: \t {minor}\n")


def test_gpu_minors_come_from_the_driver_by_uuid_and_pci_order_not_the_index(tmp_path):
    driver = tmp_path / "gpus"
    driver_info(driver, "0000:3b:00.0", "GPU-bbb", 0)  # the second in PCI order holds minor 0
    driver_info(driver, "0000:1a:00.0", "GPU-aaa", 2)
    known = gpu_nodes.minors(driver, dev=tmp_path / "no-dev")
    assert known == {"0": 2, "GPU-aaa": 2, "1": 0, "GPU-bbb": 0}
    assert gpu_nodes.denied(["GPU-aaa"], known) == [0]
    assert gpu_nodes.denied(["1"], known) == [2]
    assert gpu_nodes.denied([], known) == [0, 2]  # a CPU-only seat: no GPU
    with pytest.raises(ValueError, match="GPU-zzz.*not among this machine's GPU devices"):
        gpu_nodes.denied(["GPU-zzz"], known)
    # no GPU node and no driver (a seat from a stand-in nvidia-smi): nothing to open, nothing denied
    assert gpu_nodes.denied(["GPU-0001aaaa"], {}) == []
    assert gpu_nodes.rules([0, 2]) == ["c 195:0 rwm", "c 195:2 rwm"]


@root_only
def test_a_learner_cannot_open_another_seats_gpu_node(tmp_path, request):
    need(["devices"])
    dev = pathlib.Path(tempfile.mkdtemp(prefix="ddplab-gpu-nodes-"))  # (pytest's tmp_path is root's alone)
    dev.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(dev))
    for minor in (0, 1, 2, 255):
        name = "nvidiactl" if minor == 255 else f"nvidia{minor}"
        os.mknod(dev / name, 0o666 | 0o020000, os.makedev(gpu_nodes.MAJOR, minor))  # S_IFCHR
        (dev / name).chmod(0o666)  # (past the umask) as the driver's nodes are: anyone may open them
    assert gpu_nodes.dev_minors(dev) == {0, 1, 2}  # nvidiactl is no GPU
    known = {"GPU-a": 0, "GPU-b": 1, **{f"minor-{m}": m for m in gpu_nodes.dev_minors(dev) - {0, 1}}}
    cls, user = limits.class_name(tmp_path), "gpuseat"
    try:
        groups = limits.prepare(cls, user, 1 << 30, threads=1, cpus=[],
                                denied_gpus=gpu_nodes.denied(["GPU-b"], known))
        devices = next(g for g in groups if g.parts[-4] == "devices")
        paths = [str(dev / n) for n in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl")] + ["/dev/null"]
        env = {"CUDA_VISIBLE_DEVICES": "0,1,2"}  # asks for every GPU: the kernel decides
        paths = [str(devices / "devices.allow"), *paths]
        said = subprocess.run([PYTHON, "-c", OPEN_EACH, *paths], capture_output=True, text=True, env=env,
                              preexec_fn=as_nobody(lambda: limits.join(cls, user)), timeout=60)
        lines = said.stdout.split("\n")
        assert "nvidia1 ENXIO" in lines, said  # the seat's GPU: through the group, no driver here
        assert "nvidia0 EPERM" in lines and "nvidia2 EPERM" in lines, said  # another seat's, an unknown one
        assert "nvidiactl ENXIO" in lines and "null opened" in lines, said  # what CUDA needs stays open
        assert "kept EACCES" in lines, said  # the rule is root's
        # from outside the group the same nodes are open to the device (no rule: ENXIO for all)
        outside = subprocess.run([PYTHON, "-c", OPEN_EACH, *paths], capture_output=True, text=True,
                                 preexec_fn=as_nobody(), timeout=60).stdout
        assert "nvidia0 ENXIO" in outside, outside
        # a group left from an earlier seat keeps none of its rules
        limits.prepare(cls, user, 1 << 30, threads=1, cpus=[], denied_gpus=gpu_nodes.denied(["GPU-a"], known))
        again = subprocess.run([PYTHON, "-c", OPEN_EACH, *paths], capture_output=True, text=True,
                               preexec_fn=as_nobody(lambda: limits.join(cls, user)), timeout=60).stdout
        assert "nvidia0 ENXIO" in again and "nvidia1 EPERM" in again, again
        assert limits.end(cls, user) == set()
        assert not devices.exists()
    finally:
        limits.end(cls, user)
        limits.remove_class(cls)
    assert not (limits.BASE / "devices" / "ddplab" / cls).exists()


# --- private /tmp ---------------------------------------------------------------------------

SERVER_A = r"""
import os, subprocess, sys, time
tag = sys.argv[1]
open(f"/tmp/{tag}", "w").write("mine")
open(f"/dev/shm/{tag}", "w").write("mine")
child = subprocess.run([sys.executable, "-c", f"print(open('/tmp/{tag}').read())"], capture_output=True, text=True)
print("child", child.stdout.strip())
try:
    with open("/tmp/fill", "wb") as f:
        for _ in range(64):
            f.write(b"x" * (1 << 20))
            f.flush()
    print("filled")
except OSError as e:
    print("full", e.errno)
os.unlink("/tmp/fill")
print("ready", flush=True)
time.sleep(600)
"""
SERVER_B = r"""
import os, subprocess, sys
print("tmp", sorted(os.listdir("/tmp")), "shm", sorted(os.listdir("/dev/shm")))
print("umount", subprocess.run(["umount", "/tmp"], capture_output=True).returncode)
print("sees", os.path.exists("/tmp/" + sys.argv[1]))
"""


def mount_table_line(place):
    return subprocess.run(["findmnt", "-n", "-o", "TARGET,SOURCE,FSTYPE", place], capture_output=True,
                          text=True).stdout


def holders_of(namespace_inode):
    held = []
    for proc in psutil.process_iter():
        try:
            if os.stat(f"/proc/{proc.pid}/ns/mnt").st_ino == namespace_inode:
                held.append(proc.pid)
        except OSError:
            pass
    return held


@root_only
@pytest.mark.timeout(120)
def test_a_learners_tmp_is_private_and_goes_with_their_server(tmp_path):
    why = private_tmp.works()
    if why:
        pytest.skip(f"no mount namespace here: {why}")
    before = mount_table_line("/tmp"), mount_table_line("/dev/shm")
    tag = f"ddplab-private-{os.getpid()}"
    size = 16 << 20
    out = tmp_path / "a.out"
    server = None
    try:
        with open(out, "w") as f:
            server = subprocess.Popen([PYTHON, "-c", SERVER_A, tag], stdout=f, stderr=subprocess.STDOUT,
                                      preexec_fn=as_nobody(lambda: private_tmp.enter(size)),
                                      start_new_session=True, cwd="/")
        deadline = time.monotonic() + 60
        while "ready" not in out.read_text() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        said = out.read_text()
        assert "ready" in said, said
        assert "child mine" in said, said  # what the server's children share: ranks meet in /tmp
        assert f"full {errno.ENOSPC}" in said, said  # 64 MiB do not fit in a 16 MiB /tmp
        assert (pathlib.Path(f"/proc/{server.pid}/root/tmp") / tag).read_text() == "mine"  # it is there...
        assert not os.path.exists(f"/tmp/{tag}") and not os.path.exists(f"/dev/shm/{tag}")  # ...not here
        other = subprocess.run([PYTHON, "-c", SERVER_B, tag], capture_output=True, text=True, timeout=60, cwd="/",
                               preexec_fn=as_nobody(lambda: private_tmp.enter(size)))
        assert "sees False" in other.stdout and tag not in other.stdout, other  # nor in another learner's
        assert "umount 0" not in other.stdout and "umount" in other.stdout, other  # a learner cannot undo it
        # nothing mounted in there propagates out: its / is a slave (or private), never shared
        root_line = next(line.split() for line in pathlib.Path(f"/proc/{server.pid}/mountinfo").read_text().splitlines()
                         if line.split()[4] == "/")
        assert not any(tag.startswith("shared:") for tag in root_line[6:root_line.index("-")]), root_line
        namespace = os.stat(f"/proc/{server.pid}/ns/mnt").st_ino
        assert namespace != os.stat("/proc/self/ns/mnt").st_ino
        os.killpg(server.pid, 9)  # the server stops (limits.end kills every process of the learner)
        server.wait(timeout=30)
        deadline = time.monotonic() + 10
        while holders_of(namespace) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert holders_of(namespace) == []  # the namespace, its tmpfs and the files in it are gone
        assert (mount_table_line("/tmp"), mount_table_line("/dev/shm")) == before  # nothing leaked out
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, 9)
            server.wait()


KEPT = r"""
import os, stat, sys
kept, hidden = sys.argv[1], sys.argv[2]
print("reads", open(os.path.join(kept, "in-the-class")).read())
open(os.path.join(kept, "written-inside"), "w").write("x")
print("parent", oct(stat.S_IMODE(os.stat(os.path.dirname(kept)).st_mode)), os.stat(os.path.dirname(kept)).st_uid)
print("hidden", os.path.exists(hidden), "tmp", os.listdir("/tmp"))
"""


@root_only
@pytest.mark.timeout(120)
def test_a_class_written_under_tmp_stays_visible_through_the_private_tmp(request):
    # a class folder under /tmp (pytest's tmp_path, or `classroom /tmp/class`): the tmpfs would hide
    # it, and every learner's server failed to enter its home
    why = private_tmp.works()
    if why:
        pytest.skip(f"no mount namespace here: {why}")
    above = pathlib.Path(tempfile.mkdtemp(prefix="ddplab-kept-", dir="/tmp"))  # right under /tmp, as a class
    request.addfinalizer(lambda: shutil.rmtree(above, ignore_errors=True))
    kept = above / "class"
    kept.mkdir()
    above.chmod(0o711)
    kept.chmod(0o777)
    (kept / "in-the-class").write_text("lab 00")
    hidden = above / "not-kept"  # beside the class, in the same folder: only the class is bound back
    hidden.write_text("")
    said = subprocess.run([PYTHON, "-c", KEPT, str(kept), str(hidden)], capture_output=True, text=True,
                          timeout=60, cwd="/",
                          preexec_fn=as_nobody(lambda: private_tmp.enter(16 << 20, keep=[str(kept)])))
    assert "reads lab 00" in said.stdout, said  # the class's own files, through the private /tmp
    assert (kept / "written-inside").exists()  # the same folder, not a copy: written there, seen here
    assert "parent 0o711 0" in said.stdout, said  # the folders above made again as they were
    assert "hidden False" in said.stdout, said  # the rest of the machine's /tmp stays out of sight
    assert private_tmp.kept_paths(kept, str(kept) + "/") == [str(kept.resolve())]


CLUSTER = r"""
import os, tempfile
import torch
import torch.distributed as dist
import ddplab

def total():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()

with ddplab.Cluster(2, backend="gloo") as cluster:
    print("sums", cluster.run(total), "tmp", tempfile.gettempdir(), sorted(os.listdir("/tmp")))
print("after", sorted(os.listdir("/tmp")))
"""


@root_only
@pytest.mark.more  # two ranks importing torch: 10-30 s on a loaded 2-core machine
@pytest.mark.timeout(240)
def test_a_clusters_gloo_ranks_meet_in_a_private_tmp():
    why = private_tmp.works()
    if why:
        pytest.skip(f"no mount namespace here: {why}")
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])}
    env.pop("TMPDIR", None)
    said = subprocess.run([sys.executable, "-c", CLUSTER], capture_output=True, text=True, timeout=200, env=env,
                          preexec_fn=lambda: private_tmp.enter(256 << 20))
    assert said.returncode == 0, said.stderr[-3000:]
    assert "sums [3.0, 3.0]" in said.stdout, said.stdout
    # the ranks' rendezvous folder lay in the private /tmp and went at shutdown
    during = re.search(r"tmp /tmp (\[.*\])", said.stdout).group(1)
    assert "'ddplab-" in during, said.stdout
    assert "'ddplab-" not in said.stdout.split("after")[1], said.stdout


@root_only
def test_the_probe_says_why_a_namespace_cannot_be_made(monkeypatch):
    if private_tmp.works():
        pytest.skip(f"no mount namespace here: {private_tmp.works()}")

    def refused(flags):
        private_tmp.ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(private_tmp, "_unshare", refused)
    assert private_tmp.works() == "[Errno 1] unshare(CLONE_NEWNS): Operation not permitted"
    assert "no: [Errno 1] unshare" in limits.enforced()["private /tmp and /dev/shm"]
    assert not list(pathlib.Path(tempfile.gettempdir()).glob("ddplab-ns-probe-*"))  # the probe's folder went


# --- grading in a cgroup -------------------------------------------------------------------

BOMB = r"""
import os, sys, time
# MARK
n = 0
try:
    while n < 200:  # (a cap: without its group this test must not become a real fork bomb)
        if os.fork() == 0:
            os.closerange(0, 3)
            time.sleep(300)
            os._exit(0)
        n += 1
    sys.stderr.write(f"forked {n}\n")
except OSError as e:
    sys.stderr.write(f"fork stopped after {n}: {e.strerror}\n")
sys.stderr.flush()
x = bytearray(HOG)
x[::4096] = b"1" * (len(x) // 4096)
sys.stderr.write("TOUCHED\n")
"""


@root_only
@pytest.mark.timeout(120)
def test_a_submissions_fork_bomb_and_memory_hog_are_stopped_by_its_group(monkeypatch, tmp_path):
    # as SandboxedExecute.preprocess does it (test_classroom_attacks.py checks that it does):
    # the run's groups made, joined by the child that switches to the grading account, ended
    need(limits.GRADING_CONTROLLERS)
    from ddplab.course import gradebox

    mark = f"ddplab-bomb-{os.getpid()}-{time.monotonic_ns()}"
    memory = 128 << 20
    monkeypatch.setattr(gradebox, "ENTRY", ["-c", BOMB.replace("MARK", mark).replace("HOG", str(4 * memory))])
    monkeypatch.setattr(gradebox, "python", lambda: PYTHON)
    cls = limits.class_name(tmp_path)
    try:
        run = limits.GradingRun.make(cls, memory, tasks=40, cpus=1.0)
        with pytest.raises(RuntimeError) as failed:
            try:
                gradebox.run_as("nobody", "{}", wall_s=60, max_bytes=1 << 20, join=run.join)
            finally:
                assert run.end() == set()  # the group alone ends them (no kill -1 of the account here)
        said = str(failed.value)
        stopped = re.search(r"fork stopped after (\d+): Resource temporarily unavailable", said)
        assert stopped and int(stopped.group(1)) < 40, said  # pids.max held the bomb
        assert re.search(r"the sandbox failed \((-9|137)\)", said), said  # the OOM killer ended the hog
        assert "TOUCHED" not in said, said
        left = [p for p in psutil.process_iter(["cmdline"]) if mark in " ".join(p.info["cmdline"] or [])]
        assert left == [], "a process of the submission outlived its grading"
        assert not any(g.exists() for g in run.groups), "the run's groups were left"
    finally:
        for p in psutil.process_iter(["cmdline"]):
            if mark in " ".join(p.info["cmdline"] or []):
                p.kill()
        limits.remove_class(cls)
    assert not any((limits.BASE / c / "ddplab" / cls).exists() for c in limits.GRADING_CONTROLLERS)


@root_only
def test_grading_groups_are_handed_to_the_instructor_and_theirs_to_use(tmp_path):
    need(limits.GRADING_CONTROLLERS)
    cls = limits.class_name(tmp_path)
    try:
        folders = limits.delegate_grading(cls, NOBODY)
        assert len(folders) == 3 and all(f.stat().st_uid == NOBODY for f in folders)
        assert (folders[0].parent / "cgroup.procs").stat().st_uid == 0  # above it: root's
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the instructor (here nobody) makes a run's groups, joins them, ends them
            code = 1
            try:
                as_nobody()()
                run = limits.GradingRun.make(cls, 1 << 30, 64, 1.0)
                run.join()
                inside = os.getpid() in run.members()
                (run.groups[0].parent.parent / "cgroup.procs").write_text(str(os.getpid()))  # leave: refused
            except PermissionError:
                code = 0 if inside else 3
            finally:
                os.write(write, str(code).encode())
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            code = f.read()
        os.waitpid(pid, 0)
        assert code == "0"
        runs = [g for f in folders for g in f.glob("run-*")]
        assert runs and all(g.stat().st_uid == NOBODY for g in runs)
        assert limits.GradingRun(runs).end() == set() and not any(g.exists() for g in runs)
    finally:
        limits.remove_class(cls)
    assert not any((limits.BASE / c / "ddplab" / cls).exists() for c in limits.GRADING_CONTROLLERS)


def test_without_its_groups_a_grading_says_so_and_runs_on_rlimits(tmp_path):
    assert limits.GradingRun.make("class-none", 1 << 30, 64, 1.0, base=tmp_path) is None


# --- what doctor and classroom say ----------------------------------------------------------

def fake_cgroups(base, controllers):
    for c in controllers:
        (base / c).mkdir(parents=True)
        (base / c / "cgroup.procs").write_text("")
    return base


def test_doctor_says_what_is_enforced_and_what_stands_in(tmp_path, monkeypatch, capsys):
    base = fake_cgroups(tmp_path, ["memory", "pids"])
    said = limits.enforced(base, namespace="unshare: Operation not permitted")
    root = os.geteuid() == 0
    assert said["memory per learner"] == ("yes: cgroup v1 memory (all of a learner's processes together)" if root else
                                          "yes, for a hub run as root: cgroup v1 memory mounted "
                                          "(all of a learner's processes together)")
    assert said["GPUs per learner"] == ("no: cgroup v1 devices not mounted here; instead CUDA_VISIBLE_DEVICES only, "
                                        "which a learner can change")
    assert said["CPU per learner"].startswith("no: cgroup v1 cpu, cpuset not mounted")
    assert said["grading in a cgroup"] == "no: cgroup v1 cpu not mounted here; instead rlimits per process"
    assert said["private /tmp and /dev/shm"].endswith("unshare: Operation not permitted" +
                                                      ("; /tmp and /dev/shm are shared" if root else ""))
    everything = limits.enforced(fake_cgroups(tmp_path / "all", limits.CONTROLLERS), namespace=None)
    assert all(v.startswith("yes") for v in everything.values()), everything
    lines = limits.describe(3.0, 2, base, namespace="no root")
    assert "GPUs: NOT enforced: a seat's GPUs are CUDA_VISIBLE_DEVICES only, which a learner can change" in lines
    assert "/tmp and /dev/shm: NOT private, shared by every learner (no mount namespace: no root)" in lines
    assert "grading: rlimits per process only (address space, processes per account): no cgroup here" in lines

    from ddplab.cli import doctor

    monkeypatch.setattr(doctor, "class_limits", lambda: said)
    doctor.main((1,))
    out = capsys.readouterr().out
    assert "class limits" in out and f"  GPUs per learner: {said['GPUs per learner']}" in out



# --- the hub's own config, without a hub ---------------------------------------------------

SERVER_C = r"""
import os
open("/tmp/from-the-server-" + os.environ["MARK"], "w").write("x")
print("cgroups", open("/proc/self/cgroup").read().replace("\n", " "))
print("tmp", [l.split(" - ")[1].split()[::2] for l in open("/proc/self/mountinfo") if l.split()[4] == "/tmp"])
print("uid", os.getuid(), flush=True)
import time; time.sleep(600)
"""


@root_only
@pytest.mark.more  # jupyterhub's import and the config: 10-25 s on a loaded 2-core machine
@pytest.mark.timeout(180)
def test_the_hubs_spawner_puts_a_learners_server_in_its_groups_and_namespace(monkeypatch, tmp_path):
    pytest.importorskip("jupyterhub")
    need(limits.CONTROLLERS)
    if private_tmp.works():
        pytest.skip(f"no mount namespace here: {private_tmp.works()}")
    from types import SimpleNamespace

    from traitlets.config import Config

    from ddplab.course import accounts, hubconfig, safety

    monkeypatch.setattr(accounts, "check_logins", lambda names: None)  # nobody has no password
    monkeypatch.setattr(safety, "close_checkout", lambda: None)  # (this checkout stays as it is)
    folder = tmp_path / "class"
    folder.mkdir()
    text = hubconfig.render(folder=str(folder), learners=["nobody"], admin="root", gpus_per_learner=0, threads=1,
                            mem_gib=0.25, spawner="local", trusted=False, ip="127.0.0.1", port=8000,
                            proxy_cmd="/opt/chp", idle_timeout=600)
    hub = {"get_config": Config}
    cls = limits.class_name(folder)
    server = None
    try:
        exec(compile(text, "jupyterhub_config.py", "exec"), hub)
        config = hub["c"]
        assert config.Spawner.environment["DDPLAB_GPU_LOCK_DIR"] == "/var/tmp/ddplab-gpu-locks"
        assert hub["PRIVATE_TMP"] is True
        assert all(f.is_dir() for f in limits.grading_folders(cls))  # handed to the instructor (root here)
        spawner = hub["SeatedSpawner"](user=SimpleNamespace(name="nobody", url="/user/nobody/"))
        config.Spawner.pre_spawn_hook(spawner)  # take_seat: the seat and the learner's groups
        out = tmp_path / "server.out"
        mark = tmp_path.name  # a name of this run's: a file another run left in /tmp says nothing
        with open(out, "w") as f:
            server = subprocess.Popen([PYTHON, "-c", SERVER_C], stdout=f, stderr=subprocess.STDOUT,
                                      env=dict(os.environ, MARK=mark),
                                      preexec_fn=spawner.make_preexec_fn("nobody"), start_new_session=True)
        deadline = time.monotonic() + 60
        while "uid" not in out.read_text() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        said = out.read_text()
        assert f"uid {NOBODY}" in said, said
        for controller in limits.CONTROLLERS:
            assert re.search(rf":{controller}:/ddplab/{cls}/nobody ", said), (controller, said)
        # a tmpfs of --mem-gib, 0.25 GiB (its mode, 1777, is tmpfs's default: mountinfo leaves it out)
        assert re.search(r"tmp \[\['tmpfs', 'rw,size=262144k\b", said), said
        assert not os.path.exists(f"/tmp/from-the-server-{mark}")  # written in its private /tmp
        config.Spawner.post_stop_hook(spawner)  # end_learner: every process in the groups ended
        server.wait(timeout=30)
        assert not any(g.exists() for g in limits.groups(cls, "nobody"))
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, 9)
            server.wait()
        limits.end(cls, "nobody")
        limits.remove_class(cls)
    assert not any((limits.BASE / c / "ddplab" / cls).exists() for c in limits.CONTROLLERS)
