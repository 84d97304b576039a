"""``nbgrader collect`` that takes a submission only from the learner it names, as written, when written.

Teaches what nbgrader's exchange trusts and what a class on one server must check. A learner
submits by writing ``inbound/<student>+<assignment>+<timestamp>+<random>`` into the shared
exchange; ``collect`` reads the student and the time from that NAME. nbgrader's own collect
compares the file's owner with the student it names but only logs "cheating attempt?" and
collects it anyway, and it keeps the newest timestamp: a file named for another learner, dated
next year, would be collected as theirs and win over every real resubmission of theirs.

:class:`OwnedCollect` (the class's course config selects it through nbgrader's
``ExchangeFactory.collect``) drops, before nbgrader picks the newest of each learner:

- a submission whose owner (the Unix account that wrote it, by ``lstat``: a top-level link is
  judged as itself, and refused, never by what it points to) is not the learner it names;
- a submission holding anything but the learner's own folders and files: a symbolic link (the
  instructor's copy would read ``/etc/shadow`` or the gradebook through it), a FIFO or other
  special file, another account's file, a file with a second hard link;
- a submission dated later than now (a minute's leeway for clocks), or whose name's date is
  more than 120 s away from when it was last written: the newest ``st_ctime`` in its tree,
  which its owner cannot set back (``utime`` sets only the access and modification times).

Each refusal is an ERROR line in collect's output, naming the file, whom it claims and what is
wrong, so the instructor sees who tried; the other learners' submissions are collected. The copy
then follows no link either: each folder and file is opened with ``O_NOFOLLOW`` and checked again
on the open descriptor, so an entry swapped for a link after the check is refused, not read.
The collected ``timestamp.txt`` (which autograde reads for lateness) is rewritten with the time
the submission was written, so a late submission cannot pass as on time by its own file.

Leaves out: the one-account class (``--trusted-class``), where every file has the one owner and
this check cannot tell learners apart: it is not selected there; nbgrader's ``groupshared``
permissions (this class does not share the course with a group).
References: nbgrader's exchange (nbgrader/exchange/default/collect.py) and its docs on the
exchange's file names; stat(2) (st_ctime), open(2) (O_NOFOLLOW).
"""
from __future__ import annotations

import datetime
import glob
import os
import pwd
import shutil
import stat
from collections import defaultdict

from nbgrader.exchange.default.collect import ExchangeCollect
from nbgrader.utils import ignore_patterns

LEEWAY = datetime.timedelta(minutes=1)  # clocks: a name dated up to a minute ahead of now
STAMP_LEEWAY = datetime.timedelta(seconds=120)  # nbgrader submit names the entry, then copies into it


class Unsafe(ValueError):
    """Something in a submission that collect must not copy: a link, a special file, another's file."""


def name_of(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def owner_of(path: str) -> str:
    """Who wrote ``path`` itself (lstat: a link is not followed to what it names)."""
    return name_of(os.lstat(path).st_uid)


def wrong(st: os.stat_result, shown: str, uid: int) -> str | None:
    """Why one entry of a submission may not be copied, in words; None when it may."""
    if stat.S_ISLNK(st.st_mode):
        return f"{shown} is a symbolic link"
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return f"{shown} is a special file (not a file or a folder)"
    if st.st_uid != uid:
        return f"{shown} belongs to {name_of(st.st_uid)}"
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        return f"{shown} is a hard link ({st.st_nlink} names for one file)"
    return None


def inspect(path: str, uid: int) -> tuple[list[str], float]:
    """What in the tree at ``path`` may not be copied, and its newest change time (st_ctime,
    which no one but root can set back), every entry seen by lstat, no link followed."""
    top = os.lstat(path)
    problems, newest = [], top.st_ctime
    if not stat.S_ISDIR(top.st_mode):
        return [wrong(top, ".", uid) or ". is not a folder"], newest
    if top.st_uid != uid:
        problems.append(wrong(top, ".", uid))
    todo = [(path, ".")]
    while todo:
        folder, shown = todo.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError as e:  # a folder closed to the instructor: one learner's, not collect's, failure
            problems.append(f"{shown} cannot be read ({e.strerror})")
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError as e:
                problems.append(f"{entry.name} cannot be read ({e.strerror})")
                continue
            newest = max(newest, st.st_ctime)
            here = os.path.join(shown, entry.name) if shown != "." else entry.name
            why = wrong(st, here, uid)
            if why:
                problems.append(why)
            elif stat.S_ISDIR(st.st_mode):
                todo.append((entry.path, here))
    return problems, newest


def copy_owned(src: str, dest: str, uid: int, ignore=None) -> None:
    """Copy the tree at ``src`` to a new ``dest`` without following a link: every folder and
    file is opened with O_NOFOLLOW and checked on the open descriptor, so an entry swapped for
    a link after :func:`inspect` is refused here (raises :class:`Unsafe`), not followed."""
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _copy_folder(fd, src, ".", dest, uid, ignore)
    finally:
        os.close(fd)


def _copy_folder(fd: int, real: str, shown: str, dest: str, uid: int, ignore) -> None:
    st = os.fstat(fd)
    why = wrong(st, shown, uid)
    if why:
        raise Unsafe(why)
    os.mkdir(dest, 0o700)
    names = sorted(os.listdir(fd))
    skipped = set(ignore(real, names)) if ignore else set()
    for name in names:
        if name in skipped:
            continue
        here = name if shown == "." else os.path.join(shown, name)
        try:
            child = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError as e:  # ELOOP: a link
            raise Unsafe(f"{here} could not be opened without following it ({e.strerror})") from None
        try:
            cst = os.fstat(child)
            why = wrong(cst, here, uid)
            if why:
                raise Unsafe(why)
            if stat.S_ISDIR(cst.st_mode):
                _copy_folder(child, os.path.join(real, name), here, os.path.join(dest, name), uid, ignore)
            else:
                _copy_file(child, cst, os.path.join(dest, name))
        finally:
            os.close(child)
    os.chmod(dest, (st.st_mode & 0o755) | 0o700)


def _copy_file(fd: int, st: os.stat_result, dest: str) -> None:
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        while os.sendfile(out, fd, None, 1 << 20):
            pass
        os.fchmod(out, (st.st_mode & 0o755) | 0o600)
        os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        os.close(out)


def utc(stamp: datetime.datetime) -> datetime.datetime:
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=datetime.timezone.utc)


def examine(path: str, record: dict, now: datetime.datetime) -> tuple[str | None, datetime.datetime]:
    """Why a submission is refused (None when it is its learner's own, copyable and dated
    honestly), and the time it was written (naive UTC, as nbgrader's records)."""
    try:
        uid = pwd.getpwnam(record["username"]).pw_uid
    except KeyError:
        uid = -1
    problems, changed = inspect(path, uid)
    written = datetime.datetime.fromtimestamp(changed, datetime.timezone.utc)
    owner = owner_of(path)
    if owner != record["username"] or uid == -1:
        return (f"it claims to be {record['username']}'s but was written by {owner}: not collected "
                f"(a submission is collected only from the account it names)"), written
    if problems:
        return (f"{'; '.join(problems[:5])}{' ...' if len(problems) > 5 else ''}: not collected "
                "(a submission holds only its learner's own files and folders)"), written
    stamp = utc(record["timestamp"])
    if stamp > now + LEEWAY:
        return (f"it is dated {stamp:%Y-%m-%d %H:%M:%S} UTC, later than now: not collected "
                "(a future date would win over every real resubmission)"), written
    if abs(stamp - written) > STAMP_LEEWAY:
        return (f"its name dates it {stamp:%Y-%m-%d %H:%M:%S} UTC but it was last written at "
                f"{written:%Y-%m-%d %H:%M:%S} UTC: not collected (a submission's date is when it "
                "was written)"), written
    return None, written


def refusal(path: str, record: dict, now: datetime.datetime) -> str | None:
    """Why a submission is refused, in words; None when it is collected."""
    return examine(path, record, now)[0]


class OwnedCollect(ExchangeCollect):
    """nbgrader's collect, refusing impersonated, linked and misdated submissions."""

    def init_src(self):
        super().init_src()
        # init_src kept each learner's newest record: choose again among the honest ones only
        student = self.coursedir.student_id or "*"  # nbgrader's default: every student
        pattern = os.path.join(self.inbound_path, f"{student}+{self.coursedir.assignment_id}+*")
        honest, now = defaultdict(list), datetime.datetime.now(datetime.timezone.utc)
        self.written = {}
        for path in sorted(glob.glob(pattern)):
            record = self._path_to_record(path)
            try:
                why, written = examine(path, record, now)
            except OSError as e:  # removed or closed meanwhile
                why = f"it cannot be read ({e.strerror}): not collected"
            if why:
                self.log.error("REFUSED %s: %s", record["filename"], why)
                continue
            record["timestamp"] = written.replace(tzinfo=None)  # the time it was written, not its name's
            self.written[record["filename"]] = written
            honest[record["username"]].append(record)
        self.src_records = [newest(records, self.duedate if self.before_duedate else None)
                            for records in honest.values()]

    def do_copy(self, src, dest, log=None):
        """nbgrader's copy (size limit, ignore/include patterns), with no link followed and
        the copy's timestamp.txt saying when the submission was written."""
        size = self.get_size(src)
        if size > 1000 * self.coursedir.max_dir_size:
            raise RuntimeError(f"Directory size is too big. Size is {size}, maximum size is "
                               f"{1000 * self.coursedir.max_dir_size}")
        name = os.path.basename(src)
        uid = pwd.getpwnam(self._path_to_record(src)["username"]).pw_uid
        try:
            copy_owned(src, dest, uid, ignore_patterns(exclude=self.coursedir.ignore,
                                                       include=self.coursedir.include,
                                                       max_file_size=self.coursedir.max_file_size,
                                                       log=self.log))
        except (Unsafe, OSError) as e:
            self.log.error("REFUSED %s: %s: not collected (it changed while being collected)", name, e)
            shutil.rmtree(dest, ignore_errors=True)  # our own copy: no link in it
            return
        written = self.written.get(name)
        if written is not None:
            with open(os.path.join(dest, "timestamp.txt"), "w") as f:
                f.write(written.strftime(self.timestamp_format))


def newest(records: list[dict], duedate) -> dict:
    """The newest record, or with a due date the newest before it if there is one (nbgrader's rule)."""
    records = sorted(records, key=lambda r: r["timestamp"], reverse=True)
    if duedate is not None:
        return next((r for r in records if r["timestamp"] <= duedate), records[0])
    return records[0]
