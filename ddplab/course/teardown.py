"""The end of a class: its accounts deleted, nothing of the learners' lost by surprise, no file left to a freed uid.

Teaches what ``userdel --remove`` leaves behind and why it matters on a shared server:

- it removes the home, and with it every notebook a learner never submitted: :func:`save_homes`
  first ends the learner's processes, then copies their home (links as links, never followed;
  caches, FIFOs, files over 256 MiB and sparse files left out, the last two named) into
  ``course/saved-homes/<learner>/``, which only the instructor (or root) reads;
- it frees the uid, and the next account ``useradd`` creates may get the same number: every
  file still carrying it (in the class folder, the exchange, /tmp, /var/tmp, /dev/shm) would
  then belong to a stranger, a learner's submission in the exchange for instance.
  :func:`disown` gives each such file to the instructor, or to root where the instructor's
  account went too.

``python -m ddplab classroom FOLDER --delete-accounts`` asks before it deletes anything (or takes
``--yes``), then saves, deletes, and disowns, in that order.

Leaves out: mail spools and crontabs (``userdel`` removes the spool; ``crontab -r -u`` is not
run: learners' accounts have no cron use here), files on other machines (a Slurm class's nodes
share the class folder, which is covered).
References: userdel(8) ("files owned by the user elsewhere must be found and removed by
hand"), useradd(8) on uid reuse.
"""
from __future__ import annotations

import os
import pathlib
import pwd
import shutil

from ddplab.course import accounts

CACHES = shutil.ignore_patterns(".cache", "runtime", "__pycache__", ".ipynb_checkpoints", "*.pyc")


MAX_FILE_BYTES = 256 << 20  # a learner's file above this is not saved (a dataset, a checkpoint, a bomb)
SPARSE_BELOW = 8  # a file holding less than 1/8 of its size on disk is sparse: not saved


def skip(folder: str, names: list[str], said: list[str] | None = None) -> set[str]:
    """Caches, and anything but folders, files and links: a FIFO a learner left would hang the
    copy; files above MAX_FILE_BYTES or sparse (a 1 TB file of holes would fill the disk when
    copied), each of those named in ``said``."""
    import stat

    odd = set()
    for name in names:
        try:
            st = os.lstat(os.path.join(folder, name))
        except OSError:
            odd.add(name)
            continue
        mode = st.st_mode
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            odd.add(name)
        elif stat.S_ISREG(mode) and (st.st_size > MAX_FILE_BYTES or
                                     (st.st_size > 1 << 20 and st.st_blocks * 512 * SPARSE_BELOW < st.st_size)):
            odd.add(name)
            why = "sparse" if st.st_blocks * 512 * SPARSE_BELOW < st.st_size else f"over {MAX_FILE_BYTES >> 20} MiB"
            if said is not None:
                said.append(f"{os.path.join(folder, name)} ({st.st_size >> 20} MiB, {why})")
    return set(CACHES(folder, names)) | odd


ELSEWHERE = [pathlib.Path("/tmp"), pathlib.Path("/var/tmp"), pathlib.Path("/dev/shm")]


def recorded(folder: pathlib.Path) -> list[str]:
    """The accounts ``classroom`` created for the class in ``folder`` that still exist."""
    record = pathlib.Path(folder) / "accounts.txt"
    return [n for n in record.read_text().split() if accounts.is_ours(n)] if record.exists() else []


def save_homes(folder: pathlib.Path, learners: list[str], owner: int,
               skipped: list[str] | None = None) -> pathlib.Path:
    """Each learner's home copied to course/saved-homes/<learner>/, given to ``owner``; their
    processes end first (a running one could grow or swap a file during the copy); the files
    left out for their size are added to ``skipped``."""
    target = pathlib.Path(folder) / "course" / "saved-homes"
    target.mkdir(mode=0o700, parents=True, exist_ok=True)
    said = [] if skipped is None else skipped
    for name in learners:
        entry = pwd.getpwnam(name)
        accounts.stop_processes(entry.pw_uid)
        home = pathlib.Path(entry.pw_dir)
        if home.is_dir():
            shutil.copytree(home, target / name, symlinks=True, dirs_exist_ok=True,
                            ignore=lambda d, names: skip(d, names, said))
    for path in [target, *target.rglob("*")]:
        os.lchown(path, owner, owner)
    return target


def disown(uids: set[int], gids: set[int], owner: int, places: list[pathlib.Path]) -> int:
    """Give every file under ``places`` whose owner or group is a freed id to ``owner``; how many."""
    changed = 0

    def give(path: str) -> None:
        nonlocal changed
        try:
            st = os.lstat(path)
        except OSError:
            return
        if st.st_uid in uids or st.st_gid in gids:
            os.lchown(path, owner if st.st_uid in uids else -1, owner if st.st_gid in gids else -1)
            changed += 1

    for place in places:
        if place.exists():
            give(str(place))
            for root, dirs, files in os.walk(place):
                for name in dirs + files:
                    give(os.path.join(root, name))
    return changed


def setting(text: str, name: str) -> str | None:
    """The string a config line ``name = '...'`` gives (the class's own config files)."""
    import re

    found = re.search(rf"^{re.escape(name)} = '([^']*)'", text, re.M)
    return found.group(1) if found else None


def end_class(folder: pathlib.Path) -> dict:
    """Save the learners' homes, delete the class's accounts, disown their files; what it did."""
    from ddplab.course import safety

    folder = pathlib.Path(folder).resolve()
    names = recorded(folder)
    roster = (folder / "course" / "roster.csv")
    learners = [n for n in (roster.read_text().split()[1:] if roster.exists() else []) if n in names]
    config = folder / "jupyterhub_config.py"
    instructor = setting(config.read_text(), "INSTRUCTOR") if config.exists() else None
    keeps = instructor and instructor not in names and accounts.exists(instructor)
    owner = pwd.getpwnam(instructor).pw_uid if keeps else 0
    ids = {n: (pwd.getpwnam(n).pw_uid, pwd.getpwnam(n).pw_gid) for n in names}
    skipped: list[str] = []
    saved = save_homes(folder, learners, owner, skipped) if learners else None
    gone = safety.delete_accounts(folder)  # their processes end first
    from ddplab.course import limits

    limits.remove_class(limits.class_name(folder))
    safety.remove_rules(folder)
    course_config = folder / "course" / "nbgrader_config.py"
    exchange = setting(course_config.read_text(), "c.Exchange.root") if course_config.exists() else None
    places = [folder, *([pathlib.Path(exchange)] if exchange else []), *ELSEWHERE]
    freed = [ids[n] for n in gone]
    changed = disown({u for u, _ in freed}, {g for _, g in freed}, owner, places)
    return {"deleted": gone, "saved": saved, "learners": learners, "disowned": changed, "skipped": skipped,
            "owner": instructor if keeps else "root"}
