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

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the ddplab checkout (an editable install)


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


def check_accounts(names: list[str], instructor: str, grader: str) -> None:
    why = accounts.can_create()
    if why:
        raise ValueError(why)
    if instructor in names:
        raise ValueError(f"the instructor {instructor!r} is also on the roster")
    if grader in [*names, instructor]:
        raise ValueError(f"the grading account {grader!r} must be an account of its own (--grader NAME)")
    taken = [n for n in [*names, grader] if accounts.exists(n)]
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


def make_accounts(folder: pathlib.Path, names: list[str], instructor: str, grader: str,
                  exchange_course: pathlib.Path) -> dict:
    """Every learner's account (and the instructor's if missing), the grading account, the course
    and the course's exchange folder made the instructor's."""
    made, passwords = [], {}
    try:
        # The grading account: no password (it never logs in), nothing of the course readable.
        accounts.create(grader, folder / "homes" / grader, note=f"{folder} grading")
        made.append(grader)
        (folder / "accounts.txt").write_text(f"{grader}\n")
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
        # The course's exchange folder exists, the instructor's, before any learner could make
        # it (a learner's would block every release: nbgrader refuses a folder it does not own).
        exchange_course.mkdir(exist_ok=True)
        os.chown(exchange_course, owner.pw_uid, owner.pw_gid)
        exchange_course.chmod(0o755)
        install_grading_rule(folder, instructor, grader)
        close_checkout()  # the answers in the ddplab checkout: closed before a learner exists
        # The learners' servers must start: ddplab, JupyterHub and nbgrader importable as a learner.
        probe = subprocess.run(["runuser", "-u", names[0], "--", sys.executable, "-c",
                                "import ddplab, jupyterhub.singleuser, nbgrader"],
                               capture_output=True, text=True, cwd="/")
        if probe.returncode != 0:
            raise ValueError(f"a learner's account cannot run {sys.executable} with ddplab: "
                             f"{probe.stderr.strip()[-500:]}")
    except Exception:
        delete_accounts(folder)
        remove_rules(folder)
        raise
    return passwords


# What a learner's account needs of the ddplab checkout: the package, labs/ but its solution
# notebooks (labs/exercises/, the tour), the proxy and the package's metadata; the environment
# if it lives inside.
LEARNERS_NEED = {"ddplab", "labs", "proxy"}


def close_checkout(root: pathlib.Path = ROOT, keep_inside: pathlib.Path = pathlib.Path(sys.prefix)) -> list[str]:
    """Close the ddplab checkout to other accounts but for what learners need; returns what it closed.

    The checkout holds every answer: the solution notebooks (labs/NN-*.ipynb), the tests'
    solutions, the git history. Only "others" lose access; owner and group keep theirs. A git
    pull re-creates changed files with open modes, so the hub re-closes them at every start.
    """
    root = pathlib.Path(root).resolve()
    if not ((root / "pyproject.toml").is_file() and (root / "labs").is_dir()):
        return []  # an installed package (site-packages) carries no labs: nothing to close
    keep = set(LEARNERS_NEED)
    try:
        keep.add(pathlib.Path(keep_inside).resolve().relative_to(root).parts[0])
    except (ValueError, IndexError):
        pass
    closed = []

    def close(path: pathlib.Path, bits: int) -> None:
        mode = path.lstat().st_mode
        if not path.is_symlink() and mode & bits:
            path.chmod(mode & 0o7777 & ~bits)
            closed.append(str(path))

    close(root, 0o004)  # others may pass through to the package, not list the checkout
    for entry in sorted(root.iterdir()):
        if entry.name not in keep and not entry.name.endswith(".egg-info"):
            close(entry, 0o007)
    labs = root / "labs"
    if labs.is_dir():
        close(labs, 0o004)
        for entry in sorted(labs.glob("[0-9][0-9]-*")):  # the solution notebooks (NN-topic.ipynb)
            close(entry, 0o007)
    return closed


def git_outside(root: pathlib.Path = ROOT) -> str | None:
    """Where a worktree's git data lives outside the checkout (close_checkout cannot close it)."""
    marker = pathlib.Path(root) / ".git"
    if marker.is_file():
        return marker.read_text().removeprefix("gitdir:").strip()
    return None


def install_grading_rule(folder: pathlib.Path, instructor: str, grader: str) -> None:
    """The sudo rule that lets the instructor's autograde run the sandbox as the grading account."""
    from ddplab.course import gradebox

    installed = accounts.install_sudoers(gradebox.sudo_rule(instructor, grader),
                                         accounts.sudoers_name(folder) + "-grading")
    with open(folder / "sudoers-installed.txt", "a") as f:
        f.write(f"{installed}\n")


def remove_rules(folder: pathlib.Path) -> None:
    """The sudo rules this class installed (grading, Slurm), removed."""
    record = pathlib.Path(folder) / "sudoers-installed.txt"
    if record.exists():
        for rule in record.read_text().split():
            pathlib.Path(rule).unlink(missing_ok=True)
        record.unlink()


def delete_accounts(folder: pathlib.Path) -> list[str]:
    """Delete the accounts (and homes) listed in the class's accounts.txt that ddplab made."""
    record = pathlib.Path(folder) / "accounts.txt"
    if not record.exists():
        return []
    gone = [n for n in record.read_text().split() if accounts.delete(n)]
    record.unlink()
    return gone
