"""Attacks an outside review found on the class, each stopped, without accounts or a hub (runs
as any user; the parts that hand files to another account skip unless root).

- collect: a submission holding a link, a FIFO, a hard link or another account's file is
  refused by name, and the copy never follows a link swapped in after that check; a top-level
  link is refused though the link itself is the learner's; a submission whose name dates it
  other than when it was written is refused, and the collected timestamp.txt says when it was
  written, so a late submission cannot pass as on time.
- autograde: the outputs that come back are streams, errors, plain text and PNG only (no HTML,
  JavaScript, SVG, metadata or attachments); the lock lives in the course root, not beside a
  config file the submission carries; the grading account's processes are ended before and
  after each grading, also when autograde is interrupted; each submission runs in memory, pids
  and cpu groups of its own (as root), removed after it (its fork bomb and memory hog:
  tests/course/test_classroom_enforced.py).
- the sandbox: HOME, Jupyter's and IPython's folders inside the scratch folder, no user site;
  its files in /tmp-like places removed without following a link; the sandbox process is not
  dumpable (its /proc/<pid>/fd is closed to the kernel of the same uid).
- the end of a class: each learner's processes end before their home is copied; a file above
  the size limit and a sparse file are not copied, and each is named.
"""
import datetime
import json
import os
import pwd
import sys

import nbformat
import pytest
from traitlets.config import Config

pytest.importorskip("nbgrader", reason="the classroom's tests need nbgrader (the [test] extra)")

from ddplab.course import exchange_guard, gradebox

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="hands files to another account: root only")
LEARNER = "nobody"


def uid(name=LEARNER):
    return pwd.getpwnam(name).pw_uid


def now():
    return datetime.datetime.now(datetime.timezone.utc)


def submission(folder, owner=LEARNER):
    """A submission folder of ``owner``'s: a notebook and a timestamp, as nbgrader submit leaves."""
    folder.mkdir(parents=True)
    (folder / "00-x.ipynb").write_text("{}")
    (folder / "timestamp.txt").write_text("2020-01-01 00:00:00.000000 UTC")
    give(folder, owner)
    return folder


def give(path, owner=LEARNER):
    for p in [path, *path.rglob("*")]:
        os.lchown(p, uid(owner), -1)


def record(path, when=None):
    return {"username": LEARNER, "filename": path.name, "timestamp": (when or now()).replace(tzinfo=None)}


@root_only
@pytest.mark.parametrize("plant, said", [
    (lambda d: (d / "answers").symlink_to("/etc/shadow"), "answers is a symbolic link"),
    (lambda d: os.mkfifo(d / "pipe"), "pipe is a special file"),
    (lambda d: os.link(d / "00-x.ipynb", d / "again.ipynb"), "00-x.ipynb is a hard link (2 names"),
    (lambda d: (d / "sub").mkdir() or (d / "sub" / "f").write_text("x"), "sub/f belongs to daemon"),
])
def test_collect_refuses_links_special_files_and_others_files(tmp_path, plant, said):
    sub = submission(tmp_path / "s")
    plant(sub)
    for p in [sub, *sub.rglob("*")]:  # the learner's own, but for the planted other's file
        os.lchown(p, uid("daemon") if p.name == "f" else uid(), -1)
    why = exchange_guard.refusal(str(sub), record(sub), now())
    assert why and said in why and "not collected" in why


@root_only
def test_collect_refuses_a_top_level_link_though_the_link_is_the_learners(tmp_path):
    real = submission(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    os.lchown(link, uid(), -1)
    why = exchange_guard.refusal(str(link), record(link), now())
    assert why and ". is a symbolic link" in why
    assert exchange_guard.owner_of(str(link)) == LEARNER  # lstat: the link's own owner


@root_only
def test_the_copy_follows_no_link_swapped_in_after_the_check(tmp_path):
    sub = submission(tmp_path / "s")
    assert exchange_guard.refusal(str(sub), record(sub), now()) is None
    (sub / "00-x.ipynb").unlink()
    (sub / "00-x.ipynb").symlink_to("/etc/shadow")  # the race: after the check, before the copy
    os.lchown(sub / "00-x.ipynb", uid(), -1)
    with pytest.raises(exchange_guard.Unsafe, match="00-x.ipynb could not be opened without following it"):
        exchange_guard.copy_owned(str(sub), str(tmp_path / "copy"), uid())
    (sub / "00-x.ipynb").unlink()
    os.mkfifo(sub / "00-x.ipynb")  # never opened for reading in a way that blocks
    os.lchown(sub / "00-x.ipynb", uid(), -1)
    with pytest.raises(exchange_guard.Unsafe, match="special file"):
        exchange_guard.copy_owned(str(sub), str(tmp_path / "copy2"), uid())


@root_only
def test_a_submission_is_dated_when_it_was_written_not_by_its_name(tmp_path):
    sub = submission(tmp_path / "s")
    backdated = now() - datetime.timedelta(hours=1)
    why, written = exchange_guard.examine(str(sub), record(sub, backdated), now())
    assert "its name dates it" in why and "but it was last written at" in why
    assert abs(written - now()) < datetime.timedelta(seconds=30)
    assert exchange_guard.examine(str(sub), record(sub), now())[0] is None


def course(tmp_path):
    config = Config()
    config.CourseDirectory.root = str(tmp_path / "course")
    config.CourseDirectory.course_id = "c"
    config.CourseDirectory.assignment_id = "00-x"
    config.Exchange.root = str(tmp_path / "exchange")
    (tmp_path / "exchange" / "c" / "inbound").mkdir(parents=True)
    (tmp_path / "course").mkdir()
    return config


def collect(config, monkeypatch):
    from nbgrader.coursedir import CourseDirectory

    monkeypatch.setenv("PATH", f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")  # the gradebook's alembic

    step = exchange_guard.OwnedCollect(coursedir=CourseDirectory(config=config), config=config)
    step.start()
    return step


@root_only
def test_a_folder_collect_cannot_read_refuses_that_submission_only(tmp_path, monkeypatch):
    sub = submission(tmp_path / "s")
    (sub / "closed").mkdir()
    os.lchown(sub / "closed", uid(), -1)
    real_scandir = os.scandir

    def scandir(path):  # root reads every folder: the instructor's EACCES, played
        if str(path).endswith("closed"):
            raise PermissionError(13, "Permission denied")
        return real_scandir(path)

    monkeypatch.setattr(exchange_guard.os, "scandir", scandir)
    why = exchange_guard.refusal(str(sub), record(sub), now())
    assert why and "closed cannot be read (Permission denied)" in why


@pytest.mark.more  # nbgrader makes its gradebook (alembic): about 13 s here
@root_only
def test_collect_takes_the_honest_one_and_writes_its_true_time(tmp_path, caplog, monkeypatch):
    config = course(tmp_path)
    inbound = tmp_path / "exchange" / "c" / "inbound"
    stamp = now()
    honest = submission(inbound / f"{LEARNER}+00-x+{stamp:%Y-%m-%d %H:%M:%S.%f} UTC+aaa")
    (honest / "timestamp.txt").write_text("2020-01-01 00:00:00.000000 UTC")  # it claims to be early
    os.lchown(honest / "timestamp.txt", uid(), -1)
    later = submission(inbound / f"{LEARNER}+00-x+{stamp + datetime.timedelta(seconds=5):%Y-%m-%d %H:%M:%S.%f} UTC+bbb")
    (later / "grades").symlink_to("/etc/shadow")
    os.lchown(later / "grades", uid(), -1)
    step = collect(config, monkeypatch)
    assert "REFUSED" in caplog.text and "grades is a symbolic link" in caplog.text
    assert [r["filename"] for r in step.src_records] == [honest.name]
    got = tmp_path / "course" / "submitted" / LEARNER / "00-x"
    assert (got / "00-x.ipynb").read_text() == "{}" and not (got / "grades").exists()
    from nbgrader.utils import parse_utc

    written = parse_utc((got / "timestamp.txt").read_text())
    assert abs(written - stamp.replace(tzinfo=None)) < datetime.timedelta(seconds=30)


def graded(monkeypatch, outputs, config=None):
    """SandboxedExecute on a one-cell notebook whose sandbox sends back ``outputs``."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"),
                nbformat.v4.new_markdown_cell("see", attachments={"a.svg": {"image/svg+xml": "<svg/>"}})]
    calls = []

    def sandbox(user, request, wall_s, max_bytes, join=None):
        calls.append("run")
        back = nbformat.reads(json.loads(request)["notebook"], as_version=4)
        back.cells[0].outputs = nbformat.from_dict(outputs)
        return nbformat.writes(back)

    monkeypatch.setattr(gradebox, "run_as", sandbox)
    monkeypatch.setattr(gradebox, "end_all", lambda user: calls.append("end"))
    step = gradebox.SandboxedExecute(user="nobody", config=config or Config())
    return step.preprocess(nb, {"metadata": {"path": "."}})[0], calls


def test_only_plain_outputs_come_back_from_the_sandbox(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    script = "<script>fetch('/hub/api/users', {method: 'POST'})</script>"
    outputs = [
        {"output_type": "stream", "name": "stdout", "text": ["passed\n"]},
        {"output_type": "display_data", "data": {"text/html": script, "application/javascript": "alert(1)",
                                                 "image/svg+xml": "<svg onload='x()'/>"},
         "metadata": {"isolated": False}},
        {"output_type": "execute_result", "execution_count": 1, "metadata": {"trusted": True},
         "data": {"text/plain": "3", "text/html": script, "image/png": "iVBORw0KGgo="}},
        {"output_type": "error", "ename": "CheckFailed", "evalue": "no", "traceback": ["t"]},
        {"output_type": "display_data", "data": {"image/png": '"><script>x()</script>'}},
        {"output_type": "unknown", "data": {"text/html": script}},
    ]
    nb, _ = graded(monkeypatch, outputs)
    back = nb.cells[0].outputs
    assert [o["output_type"] for o in back] == ["stream", "execute_result", "error"]
    assert back[0]["text"] == "passed\n"
    assert dict(back[1]["data"]) == {"text/plain": "3", "image/png": "iVBORw0KGgo="}
    assert not back[1]["metadata"] and back[1]["execution_count"] == 1
    assert "attachments" not in nb.cells[1]
    nbformat.validate(nb)


def test_the_lock_is_in_the_course_root_not_beside_a_config_the_submission_carries(monkeypatch, tmp_path):
    course, submitted = tmp_path / "course", tmp_path / "course" / "autograded" / "s" / "00-x"
    submitted.mkdir(parents=True)
    (submitted / "nbgrader_config.py").write_text("# carried in by the submission\n")
    config = Config()
    config.CourseDirectory.root = str(course)
    step = gradebox.SandboxedExecute(user="nobody", config=config)
    assert step.coursedir_lock() == course / ".autograde.lock"
    graded(monkeypatch, [], config)
    assert (course / ".autograde.lock").exists() and not (submitted / ".autograde.lock").exists()


def test_the_grading_account_is_ended_before_and_after_also_when_interrupted(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    _, calls = graded(monkeypatch, [])
    assert calls == ["end", "run", "end"]
    calls.clear()

    def interrupted(*args, **kwargs):
        calls.append("run")
        raise KeyboardInterrupt

    monkeypatch.setattr(gradebox, "run_as", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gradebox.SandboxedExecute(user="nobody").preprocess(nbformat.v4.new_notebook(), {})
    assert calls == ["end", "run", "end"]


@root_only
def test_each_submission_runs_in_groups_of_its_own_removed_after(monkeypatch, tmp_path):
    from ddplab.course import limits

    if not set(limits.GRADING_CONTROLLERS) <= set(limits.writable()):
        pytest.skip("cgroup v1 memory, pids and cpu not writable here")
    monkeypatch.chdir(tmp_path)
    cls, seen = limits.class_name(tmp_path), []

    def sandbox(user, request, wall_s, max_bytes, join=None):
        run = join.__self__  # the GradingRun whose join the child calls before it execs
        files = {"memory": "memory.limit_in_bytes", "pids": "pids.max", "cpu": "cpu.cfs_quota_us"}
        controller = {g: g.relative_to(limits.BASE).parts[0] for g in run.groups}
        seen.append({controller[g]: (g / files[controller[g]]).read_text().strip() for g in run.groups})
        seen.append(run.groups)
        return request and json.loads(request)["notebook"]

    monkeypatch.setattr(gradebox, "run_as", sandbox)
    monkeypatch.setattr(gradebox, "end_all", lambda user: None)
    step = gradebox.SandboxedExecute(user="nobody", cgroup_class=cls, group_memory_gib=0.5, group_cpus=1.5,
                                     group_tasks=99)
    try:
        step.preprocess(nbformat.v4.new_notebook(), {})
        assert seen[0] == {"memory": str(1 << 29), "pids": "99", "cpu": "150000"}
        assert len(seen[1]) == 3 and not any(g.exists() for g in seen[1])  # removed after the run
    finally:
        limits.remove_class(cls)
    config = Config()
    gradebox.configure(config, "g", 8.0, cgroup_class="class-x", group_memory_gib=3.0, group_cpus=2.0)
    assert config.SandboxedExecute.cgroup_class == "class-x" and config.SandboxedExecute.group_cpus == 2.0


def test_a_grading_keeps_no_home_jupyter_or_user_site_of_the_last(tmp_path):
    env = gradebox.scratch_env(tmp_path)
    for var in ("HOME", "IPYTHONDIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "TMPDIR"):
        assert env[var].startswith(str(tmp_path) + "/") and os.path.isdir(env[var]), var
    assert env["PYTHONNOUSERSITE"] == "1"
    assert gradebox.ENTRY[0] == "-s" and "-s -m ddplab.course.gradebox" in gradebox.sudo_rule("t", "t-grader")
    # grade() puts them in place before the notebook runs (execute stands in for the kernel here)
    home = tmp_path / "grader"
    home.mkdir()

    def child():
        gradebox.pwd.getpwuid = lambda uid: pwd.struct_passwd(("g", "x", 0, 0, "", str(home), "/bin/sh"))
        gradebox.limit = lambda memory_bytes: None
        gradebox.execute = lambda text, folder, timeout: json.dumps(dict(os.environ))
        return gradebox.grade({"notebook": "", "timeout": 1, "memory_bytes": 0})

    seen = json.loads(in_a_child(child))
    for var in ("HOME", "IPYTHONDIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR"):
        assert seen[var].startswith(f"{home}/grading-"), (var, seen[var])
    assert seen["PYTHONNOUSERSITE"] == "1"
    assert not list(home.iterdir())  # the scratch folder went with the run


def in_a_child(work) -> str:
    """What ``work()`` returns, run in a forked child (it changes the process: environment, prctl)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, str(work()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return text


@root_only
def test_the_grading_accounts_leftovers_go_without_a_link_followed(tmp_path):
    place, outside = tmp_path / "tmp", tmp_path / "outside"
    (place / "mine" / "deep").mkdir(parents=True)
    (place / "mine" / "deep" / "f").write_text("x")
    (place / "theirs").mkdir()
    (place / "theirs" / "mine.txt").write_text("x")  # the account's file in another's folder
    (place / "theirs" / "keep.txt").write_text("x")
    (place / "mixed").mkdir()  # the account's folder holding another's file: left with it
    (place / "mixed" / "keep.txt").write_text("x")
    outside.mkdir()
    (outside / "precious").write_text("x")
    (place / "to-file").symlink_to(outside / "precious")
    (place / "to-folder").symlink_to(outside)
    mine = [place / "mine", place / "mine" / "deep", place / "mine" / "deep" / "f", place / "theirs" / "mine.txt",
            place / "mixed", place / "to-file", place / "to-folder"]
    for p in mine:
        os.lchown(p, uid(), -1)
    os.lchown(outside / "precious", uid(), -1)  # the account's, but outside the places: kept
    assert gradebox.remove_mine(uid(), [str(place)]) == 6
    assert sorted(p.name for p in place.rglob("*")) == ["keep.txt", "keep.txt", "mixed", "theirs"]
    assert (outside / "precious").read_text() == "x"


def test_the_sandbox_process_is_not_dumpable():
    import ctypes

    def child():
        libc = ctypes.CDLL(None)
        before = libc.prctl(3, 0, 0, 0, 0)  # 3: PR_GET_DUMPABLE
        gradebox.undumpable()
        return f"{before} {libc.prctl(3, 0, 0, 0, 0)}"

    assert in_a_child(child).split() == ["1", "0"]


def test_the_sandbox_makes_itself_undumpable_before_anything_else(monkeypatch):
    seen = []
    monkeypatch.setattr(gradebox, "undumpable", lambda: seen.append("undumpable"))
    monkeypatch.setattr(gradebox.os, "geteuid", lambda: 0)  # refused as root, after the prctl
    assert gradebox.main(["x"]) == 2 and seen == ["undumpable"]
    # as root, --end would kill(-1) every process of the machine: refused too
    monkeypatch.setattr(gradebox, "_kill_every_process_of_mine", lambda: seen.append("killed"))
    monkeypatch.setattr(gradebox, "remove_mine", lambda uid, places: seen.append("removed"))
    assert gradebox.main(["--end"]) == 2 and "killed" not in seen and "removed" not in seen


def test_the_end_of_a_class_stops_learners_first_and_skips_huge_and_sparse_files(monkeypatch, tmp_path):
    from ddplab.course import teardown

    home = tmp_path / "home"
    home.mkdir()
    (home / "lab.ipynb").write_text("{}")
    (home / "big.bin").write_bytes(b"x" * 4096)
    with open(home / "holes.bin", "wb") as f:  # 1 GiB of holes: a few KiB on disk
        f.truncate(1 << 30)
    monkeypatch.setattr(teardown, "MAX_FILE_BYTES", 2048)
    seen = []
    fake = pwd.struct_passwd(("learner01", "x", 4242, 4242, "", str(home), "/bin/sh"))
    monkeypatch.setattr(teardown.pwd, "getpwnam", lambda name: fake)
    monkeypatch.setattr(teardown.accounts, "stop_processes", lambda uid: seen.append(("stopped", uid)))
    real_copytree = teardown.shutil.copytree

    def copytree(*args, **kwargs):
        seen.append(("copied",))
        return real_copytree(*args, **kwargs)

    monkeypatch.setattr(teardown.shutil, "copytree", copytree)
    skipped = []
    target = teardown.save_homes(tmp_path / "class", ["learner01"], os.getuid(), skipped)
    assert seen == [("stopped", 4242), ("copied",)]
    assert sorted(p.name for p in (target / "learner01").iterdir()) == ["lab.ipynb"]
    assert any("big.bin" in line and "over 0 MiB" in line for line in skipped), skipped
    assert any("holes.bin (1024 MiB, sparse)" in line for line in skipped), skipped
