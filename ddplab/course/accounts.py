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


def check_logins(names: list[str], shadow: str = "/etc/shadow", today: int | None = None) -> None:
    """Raise unless PAM would let every name log in with its password (the hub's start calls it).

    Reads each account's line of /etc/shadow (shadow(5): name, hash, last change, min, max,
    warn, inactive, expire, all dates in days since 1970) and refuses, as pam_unix would:

    - an empty hash: no password, and Debian's PAM stack (``nullok``) accepts an empty one;
    - a hash that starts with ``!`` (locked) or ``*`` (never set, as useradd leaves it), or is not
      a hash at all (``usermod -p x``): nothing typed ever matches it;
    - an account past its expiry date (``chage -E``): pam_unix's account check refuses it;
    - a password that must be changed first (``chage -d 0``, or older than its maximum age):
      JupyterHub's log-in cannot change it, so PAM's account check refuses it too.
    """
    try:
        with open(shadow) as f:
            lines = {fields[0]: fields for fields in (line.rstrip("\n").split(":") for line in f) if len(fields) > 1}
    except PermissionError as e:
        raise AccountError(f"cannot read {shadow}: start the hub as root (PAM and the spawner need it)") from e
    missing = [n for n in names if not exists(n)]
    if missing:
        raise AccountError(f"no Unix account for {', '.join(missing)}: create it with "
                           "`python -m ddplab classroom` or useradd, then set a password")
    today = int(time.time() // 86400) if today is None else today
    problems = {n: why_refused(lines.get(n, [n, ""]), today) for n in names}
    problems = {n: why for n, why in problems.items() if why}
    if problems:
        fixes = [f"`chage -E -1 {n}`" if why.startswith("is expired") else f"`passwd {n}`"
                 for n, why in problems.items()]
        raise AccountError("; ".join(f"{n} {why}" for n, why in problems.items()) + ": as root, run "
                           + ", ".join(fixes) + " before starting the hub")


HASH = re.compile(r"^(\$[^$:]+\$.+|[./0-9A-Za-z]{13})$")  # crypt(5): $id$...; or 13 characters of DES


def why_refused(fields: list[str], today: int) -> str | None:
    """Why PAM (pam_unix) would refuse every password for this /etc/shadow line, else None."""
    def day(i):
        value = fields[i] if len(fields) > i else ""
        return int(value) if value.strip().lstrip("-").isdigit() else None

    secret = fields[1]
    if not secret:
        return "has no password"
    if secret.startswith(("!", "*")):
        return "cannot log in with a password (locked, or never set)"
    if not HASH.match(secret):
        return "has a password field that is not a hash (no password ever matches it)"
    changed, longest, inactive, expire = day(2), day(4), day(6), day(7)
    if expire is not None and expire >= 0 and today >= expire:
        return "is expired (its account expiry date has passed)"
    if changed == 0:
        return "must change its password before logging in (which the hub's log-in cannot do)"
    if changed is not None and longest is not None and longest >= 0 and today - changed > longest:
        return ("has a password past its maximum age" + (" and inactive" if inactive is not None and inactive >= 0
                and today - changed > longest + inactive else "") + " (PAM asks for a new one first)")
    return None


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
