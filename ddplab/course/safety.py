"""What makes a class safe before it starts: the network it listens on and the learners' accounts.

Teaches the checks ``python -m ddplab classroom`` makes and the modes it sets:

- a class listening beyond loopback is served over https (JupyterHub's ``ssl_cert`` and
  ``ssl_key``), or only when told ``--insecure-lan``: otherwise every password crosses the
  network readable;
- every learner is a new Unix account (:mod:`ddplab.course.accounts`); a roster name that is
  already an account is refused, so a roster cannot hand out someone's account;
- the course folder (solutions, gradebook, submissions) belongs to the instructor, mode 0700;
- the environment the servers run from must be reachable by the learners' accounts, and is
  tried as the first learner before the class is declared ready.

Leaves out: firewalls, quotas, and what runs outside the class (ssh logins with these
passwords are possible where sshd runs: docs/classroom.md says how to refuse them).
References: useradd(8), runuser(1), JupyterHub's security overview.
"""
from __future__ import annotations

import ipaddress
import os
import pathlib
import pwd
import subprocess
import sys

from ddplab.course import accounts


def check_network(args) -> None:
    """A class on a non-loopback address is served over https, unless told --insecure-lan."""
    for given in (args.ssl_cert, args.ssl_key):
        if given and not pathlib.Path(given).is_file():
            raise ValueError(f"{given}: no such file (--ssl-cert and --ssl-key take PEM files)")
    if bool(args.ssl_cert) != bool(args.ssl_key):
        raise ValueError("--ssl-cert and --ssl-key go together")
    try:
        loopback = args.ip == "localhost" or ipaddress.ip_address(args.ip).is_loopback
    except ValueError as e:
        raise ValueError(f"--ip takes an IP address, got {args.ip!r}") from e
    if not loopback and not args.ssl_cert and not args.insecure_lan:
        raise ValueError(f"--ip {args.ip} lets other machines reach the class, and its passwords would "
                         "cross the network readable: give --ssl-cert and --ssl-key (https), or keep "
                         "--ip 127.0.0.1 behind a reverse proxy with TLS (docs/classroom.md), or say "
                         "--insecure-lan on a network you trust")


def check_accounts(names: list[str], instructor: str) -> None:
    why = accounts.can_create()
    if why:
        raise ValueError(why)
    if instructor in names:
        raise ValueError(f"the instructor {instructor!r} is also on the roster")
    taken = [n for n in names if accounts.exists(n)]
    if taken:
        raise ValueError(f"Unix accounts named {', '.join(taken[:5])} already exist: learners get new "
                         "accounts, so choose other names (or delete those accounts if they are an old "
                         "class's: python -m ddplab classroom OLD_FOLDER --delete-accounts)")
    if accounts.exists(instructor) and pwd.getpwnam(instructor).pw_uid == 0:
        raise ValueError("the instructor's account must not be root: servers never run as root here")
    for need in (pathlib.Path(sys.prefix), pathlib.Path(__file__).resolve().parents[2]):
        blocked = accounts.reachable(need)
        if blocked:
            raise ValueError(f"the learners' accounts cannot reach {need} ({blocked} is closed to other "
                             "users): install ddplab's environment where every account can read it, "
                             "e.g. python3 -m venv /opt/ddplab (not under /root)")


def make_accounts(folder: pathlib.Path, names: list[str], instructor: str) -> dict:
    """Every learner's account (and the instructor's if missing), the course made the instructor's."""
    made, passwords = [], {}
    try:
        for name in ([] if accounts.exists(instructor) else [instructor]) + names:
            accounts.create(name, folder / "homes" / name, note=str(folder))
            made.append(name)
            (folder / "accounts.txt").write_text("".join(f"{n}\n" for n in made))
            passwords[name] = accounts.new_password()
            accounts.set_password(name, passwords[name])
        owner = pwd.getpwnam(instructor)
        for path in [folder / "course", *(folder / "course").rglob("*")]:
            os.chown(path, owner.pw_uid, owner.pw_gid)
        (folder / "course").chmod(0o700)  # the solutions and the gradebook: the instructor's only
        # The learners' servers must start: ddplab, JupyterHub and nbgrader importable as a learner.
        probe = subprocess.run(["runuser", "-u", names[0], "--", sys.executable, "-c",
                                "import ddplab, jupyterhub.singleuser, nbgrader"],
                               capture_output=True, text=True, cwd="/")
        if probe.returncode != 0:
            raise ValueError(f"a learner's account cannot run {sys.executable} with ddplab: "
                             f"{probe.stderr.strip()[-500:]}")
    except Exception:
        delete_accounts(folder)
        raise
    return passwords


def delete_accounts(folder: pathlib.Path) -> list[str]:
    """Delete the accounts (and homes) listed in the class's accounts.txt that ddplab made."""
    record = pathlib.Path(folder) / "accounts.txt"
    if not record.exists():
        return []
    gone = [n for n in record.read_text().split() if accounts.delete(n)]
    record.unlink()
    return gone
