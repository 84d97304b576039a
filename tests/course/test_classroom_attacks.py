"""Attacks an outside review found on the class, each stopped, without accounts or a hub (runs
as any user; the parts that hand files to another account skip unless root).

- collect: a submission holding a link, a FIFO, a hard link or another account's file is
  refused by name, and the copy never follows a link swapped in after that check; a top-level
  link is refused though the link itself is the learner's; a submission whose name dates it
  other than when it was written is refused, and the collected timestamp.txt says when it was
  written, so a late submission cannot pass as on time.
"""
import datetime
import os
import pwd
import sys

import pytest
from traitlets.config import Config

from ddplab.course import exchange_guard

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
