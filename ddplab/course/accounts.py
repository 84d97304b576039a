"""Learners as Unix accounts: create them from a roster, give each a password, delete them after.

Teaches: on a shared server the operating system is what keeps learners apart. A learner's
Jupyter server runs as that learner's own account (JupyterHub's ``LocalProcessSpawner``
switches to it with setuid before it starts the server), so a notebook cell or a terminal
can read only what that account may: its own home (mode 0700), the class's shared folders
(learner settings, nbgrader's exchange) and nothing of the instructor's course folder
(mode 0700, the solutions and the gradebook in it) or of another learner.

- :func:`create` makes one account with ``useradd``: its own group, a home at the path the
  class chooses (0700), ``/bin/bash`` (JupyterLab's terminal uses the account's shell) and a
  comment that marks it as ddplab's, so :func:`delete` never removes an account ddplab did not
  make.
- :func:`set_password` hands ``chpasswd`` a generated password (:func:`new_password`); the
  system stores only its hash (``/etc/shadow``). JupyterHub's ``PAMAuthenticator`` checks it.
- :func:`delete` stops the account's processes, then ``userdel --remove`` (account, group,
  home).

One function per step so that other spawners reuse them (a batch-system spawner that runs each
learner's server as a job under that learner's uid needs exactly these accounts).

Leaves out: LDAP or other directory services (a university's own accounts: use PAM against
them and skip account creation), quotas, and shells other than bash.
References: useradd(8), chpasswd(8), userdel(8), credentials(7); JupyterHub's
LocalProcessSpawner and PAMAuthenticator.
"""
from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

MARK = "ddplab class account"  # the GECOS comment of every account ddplab creates
ALPHABET = "abcdefghjkmnpqrstuvwxyz23456789"  # no 0/o, 1/l/i: read aloud or off a slip of paper


class AccountError(RuntimeError):
    """An account could not be created or used; the message says what to do."""


def can_create() -> str | None:
    """None when this process can create accounts; else why not, in words."""
    if os.geteuid() != 0:
        return ("creating the learners' Unix accounts needs root: run it with sudo (or as root), "
                "or pass --trusted-class for the unsafe one-account mode")
    missing = [c for c in ("useradd", "userdel", "chpasswd") if not shutil.which(c)]
    if missing:
        return f"{', '.join(missing)} not found (Debian/Ubuntu: apt-get install passwd)"
    return None


def exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def is_ours(name: str) -> bool:
    """True when ``name`` is an account ddplab created (its comment carries MARK)."""
    try:
        return pwd.getpwnam(name).pw_gecos.startswith(MARK)
    except KeyError:
        return False


def new_password(groups: int = 3, size: int = 4) -> str:
    """A password such as ``k7mp-q2xd-9trw``: 60 bits from ``secrets``, easy to type."""
    return "-".join("".join(secrets.choice(ALPHABET) for _ in range(size)) for _ in range(groups))


def create(name: str, home: Path, note: str = "") -> pwd.struct_passwd:
    """A new account ``name`` with its own group and a 0700 home at ``home``.

    Refuses a name that is already taken, so a roster cannot capture someone's account.
    """
    why = can_create()
    if why:
        raise AccountError(why)
    if exists(name):
        raise AccountError(f"a Unix account named {name!r} already exists: pick another name in the "
                           "roster, or delete that account first if it is a leftover of an old class")
    home = Path(home)
    home.parent.mkdir(parents=True, exist_ok=True)
    comment = f"{MARK} {note}".strip().replace(":", " ").replace(",", " ")
    run = subprocess.run(["useradd", "--create-home", "--home-dir", str(home), "--shell", "/bin/bash",
                          "--user-group", "--comment", comment, name], capture_output=True, text=True)
    if run.returncode != 0:
        raise AccountError(f"useradd {name} failed: {run.stderr.strip()}")
    home.chmod(0o700)  # useradd follows HOME_MODE in login.defs (0755 on older systems)
    return pwd.getpwnam(name)


def set_password(name: str, password: str) -> None:
    if not password:
        raise AccountError("an empty password is never set")
    run = subprocess.run(["chpasswd"], input=f"{name}:{password}\n", capture_output=True, text=True)
    if run.returncode != 0:
        raise AccountError(f"chpasswd for {name} failed: {run.stderr.strip()}")


def processes_of(uid: int) -> list[int]:
    """Pids of every process running as ``uid`` (real or effective), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        real, effective = map(int, line.split()[1:3])
                        if uid in (real, effective):
                            found.append(int(entry))
                        break
        except OSError:
            pass
    return found


def stop_processes(uid: int) -> None:
    """Every process of ``uid`` asked to stop (SIGTERM), then killed after 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in processes_of(uid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 5
        while processes_of(uid) and time.monotonic() < end:
            time.sleep(0.1)


def delete(name: str) -> bool:
    """Stop ``name``'s processes and remove the account, its group and its home.

    Only accounts ddplab created are removed; returns False (and removes nothing) for others.
    """
    if not is_ours(name):
        return False
    stop_processes(pwd.getpwnam(name).pw_uid)
    run = subprocess.run(["userdel", "--remove", name], capture_output=True, text=True)
    # userdel exits 12 when it removed the account but found no mail spool to remove
    if run.returncode not in (0, 12) or exists(name):
        raise AccountError(f"userdel {name} failed: {run.stderr.strip()}")
    return True


def reachable(path: Path) -> Path | None:
    """The first folder on the way to ``path`` that other users cannot enter, else None."""
    path = Path(path).resolve()
    folders = [*reversed(path.parents)] + ([path] if path.is_dir() else [])
    for folder in folders:
        if not os.stat(folder).st_mode & 0o001:
            return folder
    return None


def check_logins(names: list[str], shadow: str = "/etc/shadow") -> None:
    """Raise unless every name is an account with a password set (the hub's start calls it).

    An empty hash field in /etc/shadow means "no password", and Debian's PAM stack (``nullok``)
    then accepts an empty one. A field that starts with ``!`` (locked) or is ``*`` (never set, as
    useradd leaves it) lets nobody log in with a password: that learner would only ever read
    "Invalid username or password".
    """
    try:
        with open(shadow) as f:
            hashes = {fields[0]: fields[1] for fields in (line.split(":") for line in f) if len(fields) > 1}
    except PermissionError as e:
        raise AccountError(f"cannot read {shadow}: start the hub as root (PAM and the spawner need it)") from e
    missing = [n for n in names if not exists(n)]
    if missing:
        raise AccountError(f"no Unix account for {', '.join(missing)}: create it with "
                           "`python -m ddplab classroom` or useradd, then set a password")
    empty = [n for n in names if not hashes.get(n)]
    if empty:
        raise AccountError(f"{', '.join(empty)} has no password: set one with `passwd NAME` (as root) "
                           "before starting the hub")
    locked = [n for n in names if hashes[n].startswith(("!", "*"))]
    if locked:
        raise AccountError(f"{', '.join(locked)} cannot log in with a password (locked, or never set): set "
                           "one with `passwd NAME` (as root) before starting the hub")


def install_sudoers(text: str, name: str) -> Path:
    """Check ``text`` with ``visudo -c`` and install it as /etc/sudoers.d/NAME (0440)."""
    if not shutil.which("visudo"):
        raise ValueError("visudo not found: install sudo (Debian: apt-get install sudo)")
    target = Path("/etc/sudoers.d") / name
    tmp = target.with_name(f".{name}.new")
    target.parent.mkdir(mode=0o750, exist_ok=True)
    tmp.write_text(text)
    tmp.chmod(0o440)
    check = subprocess.run(["visudo", "-c", "-q", "-f", str(tmp)], capture_output=True, text=True)
    if check.returncode != 0:
        tmp.unlink()
        raise ValueError(f"visudo refused the sudo rule: {check.stdout}{check.stderr}")
    tmp.replace(target)
    return target


def sudoers_name(folder: Path) -> str:
    # sudo skips files in sudoers.d whose names contain a dot or end in ~
    return "ddplab-" + re.sub(r"[^A-Za-z0-9_-]", "_", str(folder).strip("/"))[-60:]
