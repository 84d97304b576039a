"""``python -m ddplab classroom``: a class on one server or on Slurm, from a few options, into one folder.

Teaches how the Jupyter ecosystem's own parts fit a ddplab workshop, safely by default:
JupyterHub (with configurable-http-proxy, PAM log-in, a spawner and jupyterhub-idle-culler)
gives each learner a JupyterLab with a seat (GPUs and CPUs, :mod:`ddplab.course.seats`),
running as that learner's own Unix account (:mod:`ddplab.course.accounts`); nbgrader hands out
the labs as assignments, collects them and autogrades them on live ranks.

The folder it writes (modes as set here; "instructor" is the ``--instructor`` account)::

    jupyterhub_config.py       the hub (hubconfig.py says what each line is for)
    hub/                       the hub's database and cookie secret (0700, made at start)
    course/                    0700, the instructor's: nbgrader's course, the solutions
                               (course/source/<lab>/<lab>.ipynb), the gradebook, the roster
    learner-config/            the learners' side of nbgrader (exchange, course, student id),
                               Formgrader and Create Assignment switched off
    exchange/                  nbgrader's exchange (1777 with the sticky bit, as nbgrader asks)
    homes/<learner>/           each learner's home (0700, the learner's own)
    accounts.txt               the accounts this command created (for --delete-accounts)
    templates/error.html       JupyterHub's error page, saying "the class is full" past
                               --max-learners servers (ddplab/course/capacity.py)
    sudoers                    (--spawner slurm) the hub's sudo rule: sbatch, squeue, scancel as
                               the learners only (ddplab/course/slurmhub.py)
    README.md                  the instructor's steps

Each learner's password (and the instructor's, for an account it creates) is generated,
printed once, and kept only as a hash by the system. ``--trusted-class`` keeps the old
one-account mode: every server runs as the hub's user and every learner can read the
solutions; only for a class whose learners may see everything.

Leaves out: directory services (LDAP), OAuth log-in, Kubernetes.
References: JupyterHub and nbgrader documentation; docs/classroom.md.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import re
import shutil
import sys

from ddplab.course import accounts, capacity, hubconfig, limits, safety
from ddplab.course import logins as logins_module

COURSE_ID = "ddplab"
NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
# Above the 40 s a grader may wait on a hung rank; nbgrader's default is 30 s per cell.
CELL_TIMEOUT_S = 120
# The grading sandbox limits each process's address space; torch with gloo reserves far more
# than it touches, so less than this fails lab 00's import before any learner code runs.
GRADING_MIN_GIB = 8.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", nargs="?", help="where to write the set-up (created; must be empty or absent); "
                                  "with --delete-accounts, the class to remove the accounts of")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--learners", type=int, help="this many learners, named learner01, learner02, ...")
    who.add_argument("--roster", help="a file with one learner name per line")
    who.add_argument("--plan", action="store_true",
                     help="say how many learners this machine holds at --mem-gib and --threads, and at "
                          "what speed (figures measured by make load-test); writes nothing")
    who.add_argument("--delete-accounts", action="store_true",
                     help="delete the Unix accounts (and homes) this command created for FOLDER's class, "
                          "after saving each learner's home to FOLDER/course/saved-homes/ (asks first)")
    who.add_argument("--unlock", nargs="+", metavar="NAME",
                     help="forget the failed log-ins counted for these names in FOLDER's running hub (it "
                          "reads them at its next log-in attempt); run as the hub's user (root)")
    p.add_argument("--yes", action="store_true", help="with --delete-accounts: do not ask")
    p.add_argument("--passwords-file", default=None,
                   help="also write the passwords to this new file, readable by its owner only (0600); "
                        "a `| tee` would leave them readable by every account")
    p.add_argument("--instructor", default="instructor",
                   help="the hub admin's name; an existing account of that name is used as it is, "
                        "else one is created [instructor]")
    p.add_argument("--grader", default=None,
                   help="the grading account autograde runs submissions as (created, no password, no "
                        "rights) [INSTRUCTOR-grader]")
    p.add_argument("--trusted-class", action="store_true",
                   help="UNSAFE: no Unix accounts; every learner's server runs as the hub's user, so "
                        "every learner can read the solutions, the gradebook and each other's work")
    p.add_argument("--gpus-per-learner", type=int, default=None,
                   help="GPUs in each learner's set (default 2 when nvidia-smi shows GPUs, else 0)")
    p.add_argument("--cpu-only", action="store_true", help="no GPUs for anyone (gloo on CPU)")
    p.add_argument("--threads", type=int, default=2, help="CPUs per learner (affinity) [2]")
    p.add_argument("--mem-gib", type=float, default=3.0,
                   help="memory per learner, enforced by the systemd spawner, or by the local spawner "
                        "where cgroup v1 is writable (the command says which) [3]")
    p.add_argument("--max-learners", type=int, default=None,
                   help="servers at once (the instructor's counts as one); the next learner reads \"the "
                        "class is full\" [as many as this machine's memory holds at --mem-gib: see --plan]")
    p.add_argument("--spawner", choices=hubconfig.SPAWNERS, default="local")
    p.add_argument("--ip", default="127.0.0.1",
                   help="where the proxy listens for browsers [127.0.0.1]; another address needs "
                        "--ssl-cert and --ssl-key, or --insecure-lan")
    p.add_argument("--ssl-cert", help="TLS certificate (PEM) for --ip: the class is served over https")
    p.add_argument("--ssl-key", help="the certificate's private key (PEM)")
    p.add_argument("--insecure-lan", action="store_true",
                   help="serve a non-loopback --ip over plain http (passwords cross the network "
                        "readable): only on a network you trust")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--proxy", default=None,
                   help="configurable-http-proxy (default: proxy/node_modules/.bin in the ddplab "
                        "checkout, after `npm ci --prefix proxy`, else on PATH)")
    p.add_argument("--idle-timeout", type=int, default=1800,
                   help="seconds before an idle learner's server is stopped [1800]")
    logins = p.add_argument_group("log-in limits (ddplab/course/logins.py): past them a log-in is refused at "
                                  "once, saying when to try again; a successful log-in clears its own name's "
                                  "failures from its address")
    logins.add_argument("--login-failures", type=int, default=logins_module.PER_NAME,
                        help="failed log-ins per name from one address within --login-window (0: no limit); "
                             "the name is refused from that address only [%(default)s]")
    logins.add_argument("--login-address-failures", type=int, default=None,
                        help="failed log-ins per address within --login-window (0: no limit); a log-in "
                             "counts as failed until its password is checked [the class's accounts + "
                             f"{logins_module.PER_ADDRESS}: a whole class behind one address may log in at once]")
    logins.add_argument("--login-name-failures-everywhere", type=int, default=logins_module.PER_NAME_EVERYWHERE,
                        help="failed log-ins per name from all addresses together within --login-window (0: no "
                             "limit); the name is then refused from addresses it never logged in from [%(default)s]")
    logins.add_argument("--login-window", type=float, default=logins_module.WINDOW_S,
                        help="seconds a failed log-in counts, at most a day [%(default)s]")
    logins.add_argument("--trusted-proxy", action="append", default=[], metavar="ADDRESS",
                        help="a reverse proxy of yours in front of the hub (address or network; repeat for "
                             "more): a log-in from it is counted at the address it puts in X-Forwarded-For")
    p.add_argument("--exchange", default=None,
                   help="nbgrader's exchange folder (default FOLDER/exchange); with --spawner slurm it "
                        "must be on storage every node mounts at the same path, as FOLDER must")
    slurm = p.add_argument_group("--spawner slurm (docs/hpc.md, 'A class on Slurm')")
    slurm.add_argument("--time-limit", default="02:00:00",
                       help="each learner's server job's time limit (sbatch --time) [02:00:00]")
    slurm.add_argument("--partition", default="", help="the partition the server jobs run in")
    slurm.add_argument("--hub-ip", default="127.0.0.1",
                       help="the hub API's address on the login node, reachable from the compute "
                            "nodes [127.0.0.1: only when the nodes are this machine]")
    slurm.add_argument("--hub-user", default="root",
                       help="the account the hub runs as: the sudo rule lets it run sbatch, squeue and "
                            "scancel as the learners, nothing else [root]")


def learners(args) -> list[str]:
    if args.roster:
        names = [line.strip() for line in pathlib.Path(args.roster).read_text().splitlines()
                 if line.strip() and not line.startswith("#")]
    else:
        if args.learners < 1:
            raise ValueError(f"--learners must be at least 1, got {args.learners}")
        names = [f"learner{i:02d}" for i in range(1, args.learners + 1)]
    bad = [n for n in names if not NAME.match(n)]
    if bad:
        raise ValueError(f"learner names must be lower-case letters, digits, - or _ (a letter "
                         f"first, at most 32): {bad[:3]}")
    if len(set(names)) != len(names):
        raise ValueError("the roster names a learner twice")
    return names


def find_proxy(given: str | None) -> str:
    if given:
        path = shutil.which(given) or given
    else:
        local = pathlib.Path(__file__).resolve().parents[2] / "proxy" / "node_modules" / ".bin"
        path = str(local / "configurable-http-proxy") if (local / "configurable-http-proxy").exists() \
            else shutil.which("configurable-http-proxy")
    if not path or not pathlib.Path(path).exists():
        raise ValueError("configurable-http-proxy not found: run `npm ci --prefix proxy` in the "
                         "ddplab checkout (Node.js >= 18), or pass --proxy /path/to/it")
    return str(pathlib.Path(path).resolve())


def login_limits(args, accounts_n: int = 0) -> dict:
    """LoginLimits' keywords from the options (hubconfig writes them into the hub's config).

    Every log-in counts as failed until PAM has checked it, and a class behind one NAT address
    logs in at once at 9:00: measured with make load-test, 20 right passwords sent at once met a
    limit of 10 per address, and 10 learners read "too many failed log-ins from your address".
    So by default the address limit is the class's accounts plus 10."""
    per_address = args.login_address_failures
    if per_address is None:
        per_address = accounts_n + logins_module.PER_ADDRESS
    given = dict(per_name=args.login_failures, per_address=per_address,
                 window_s=args.login_window, per_name_everywhere=args.login_name_failures_everywhere)
    if args.trusted_proxy:
        given["trusted_proxies"] = [str(n) for n in logins_module.trusted_networks(args.trusted_proxy)]
    return given


def grader(args) -> str:
    name = args.grader or f"{args.instructor}-grader"
    if not NAME.match(name):
        raise ValueError(f"the grading account's name {name!r} is not a valid account name: pass --grader NAME")
    return name


def gpus_per_learner(args) -> int:
    if args.cpu_only:
        return 0
    if args.gpus_per_learner is not None:
        if args.gpus_per_learner < 0:
            raise ValueError("--gpus-per-learner must be 0 or more")
        return args.gpus_per_learner
    from ddplab.placement.gpus import discover

    return 2 if discover() else 0


def graded_labs() -> list[pathlib.Path]:
    """Every lab that has an exercise version (labs/exercises/, nbgrader's release of it)."""
    labs = pathlib.Path(__file__).resolve().parents[2] / "labs"
    return [p for p in sorted(labs.glob("[0-9][0-9]-*.ipynb")) if (labs / "exercises" / p.name).exists()]


def write(args) -> tuple[pathlib.Path, dict]:
    """Write the class folder; returns it and the passwords to show once (name -> password)."""
    folder = pathlib.Path(args.folder).resolve()
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"{folder} is not empty: choose a new folder")
    names, proxy, per = learners(args), find_proxy(args.proxy), gpus_per_learner(args)
    if args.threads < 1:
        raise ValueError("--threads must be at least 1")
    args.max_servers = max_servers(args)
    logins_module.LoginLimits(**login_limits(args, len(names) + 1))  # refused in words before anything is made
    safety.check_network(args)
    if not args.trusted_class:
        safety.check_accounts(names, args.instructor, grader(args))
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    try:
        return _fill(folder, names, proxy, per, args)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)  # it was empty or absent: leave nothing half-made
        raise


def _fill(folder: pathlib.Path, names: list[str], proxy: str, per: int, args) -> tuple[pathlib.Path, dict]:
    if not args.trusted_class and accounts.reachable(folder):
        raise ValueError(f"learners cannot enter {folder} ({accounts.reachable(folder)} is closed to "
                         "other users): choose a folder such as /srv/ddplab-class")
    course = folder / "course"
    exchange = pathlib.Path(args.exchange).resolve() if args.exchange else folder / "exchange"
    if args.spawner == "slurm":
        check_slurm(args)
    spawns = capacity.spawn_limit(capacity.machine().cpus)
    for sol in graded_labs():
        (course / "source" / sol.stem).mkdir(parents=True)
        shutil.copyfile(sol, course / "source" / sol.stem / sol.name)
    for d in [exchange, folder / "learner-config" / "labconfig", folder / "homes"]:
        d.mkdir(parents=True, exist_ok=True)
    exchange.chmod(0o1777)  # nbgrader's exchange: every learner may submit (sticky, like /tmp)
    with open(course / "roster.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id"])
        w.writerows([n] for n in names)
    (course / "nbgrader_config.py").write_text(course_config(
        course, exchange, None if args.trusted_class else grader(args), args.mem_gib, args.threads))
    write_learner_config(folder / "learner-config", exchange)
    (folder / "jupyterhub_config.py").write_text(hubconfig.render(
        folder=str(folder), learners=names, admin=args.instructor, gpus_per_learner=per,
        threads=args.threads, mem_gib=args.mem_gib, spawner=args.spawner, trusted=args.trusted_class,
        ip=args.ip, port=args.port, proxy_cmd=proxy, idle_timeout=args.idle_timeout,
        ssl_cert=args.ssl_cert and str(pathlib.Path(args.ssl_cert).resolve()),
        ssl_key=args.ssl_key and str(pathlib.Path(args.ssl_key).resolve()), hub_ip=args.hub_ip,
        time_limit=args.time_limit, partition=args.partition, hub_user=args.hub_user,
        login_limits=login_limits(args, len(names) + 1), max_servers=args.max_servers, spawns=spawns))
    if args.max_servers:
        (folder / "templates").mkdir()
        (folder / "templates" / "error.html").write_text(capacity.full_page(args.max_servers, args.mem_gib, spawns,
                                                                              args.max_learners is not None))
    if args.spawner == "slurm":
        from ddplab.course import slurmhub

        rule = slurmhub.sudoers(args.hub_user, names)
        (folder / "sudoers").write_text(rule)
        if args.hub_user != "root":  # root may already run anything as anyone
            installed = accounts.install_sudoers(rule, accounts.sudoers_name(folder))
            with open(folder / "sudoers-installed.txt", "a") as f:
                f.write(f"{installed}\n")
    from ddplab.course.classroom_readme import readme

    (folder / "README.md").write_text(readme(folder, names, per, args))
    if args.trusted_class:
        for n in names + [args.instructor]:
            (folder / "homes" / n).mkdir(exist_ok=True)
        # JupyterHub's shared-password log-in wants 32 characters or more for the admin's
        return folder, dict(zip(hubconfig.PASSWORD_VARS, [accounts.new_password(), accounts.new_password(groups=7)]))
    return folder, safety.make_accounts(folder, names, args.instructor, grader(args), exchange / COURSE_ID)


def max_servers(args) -> int | None:
    """The class's size on this machine (None on Slurm: its scheduler queues the servers)."""
    return capacity.class_size(args.spawner, args.mem_gib, args.max_learners)


def plan(args) -> int:
    """--plan: what this machine holds, from the live machine and the figures measured here."""
    try:
        said = capacity.describe(capacity.plan(args.mem_gib, args.threads, capacity.machine()))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print("\n".join(said))
    return 0


def check_slurm(args) -> None:
    """A Slurm class needs real accounts, the client programs, and an environment they can run."""
    if args.trusted_class:
        raise ValueError("--spawner slurm runs each server as its learner's account: it cannot be "
                         "combined with --trusted-class")
    import importlib.util

    if importlib.util.find_spec("batchspawner") is None:
        raise ValueError("batchspawner is not installed: pip install -c constraints.txt -e '.[classroom,slurm]'")
    missing = [p for p in ("sbatch", "squeue", "scancel", "scontrol") if not shutil.which(p)]
    if missing:
        raise ValueError(f"{', '.join(missing)} not found: the hub's machine needs Slurm's client "
                         "programs (Debian: apt-get install slurm-client)")
    for path in (pathlib.Path(sys.prefix), pathlib.Path(sys.executable).resolve()):
        closed = accounts.reachable(path)
        if closed:
            raise ValueError(f"the learners' jobs run {sys.executable}, and their accounts cannot "
                             f"enter {closed}: build the environment outside it (for example "
                             "`/usr/bin/python3 -m venv /opt/ddplab-venv`), on storage the nodes share")


def course_config(course: pathlib.Path, exchange: pathlib.Path, grader: str | None = None,
                  mem_gib: float = 3.0, threads: int = 2) -> str:
    guarded = [
        "# Each submission runs as the grading account, which can read nothing of the course",
        "# (ddplab/course/gradebox.py); collect takes a submission only from the learner it names",
        "# and never one dated in the future (ddplab/course/exchange_guard.py).",
        "from ddplab.course import gradebox",
        "",
        f"gradebox.configure(c, user={grader!r}, memory_gib={max(mem_gib, GRADING_MIN_GIB)!r},",
        "                    # each submission in cgroups of its own, as limited as a learner",
        f"                    cgroup_class={limits.class_name(course.parent)!r}, group_memory_gib={mem_gib!r},",
        f"                    group_cpus={float(threads)!r})",
        "c.ExchangeFactory.collect = 'ddplab.course.exchange_guard.OwnedCollect'",
    ] if grader else []
    return "\n".join([
        '"""nbgrader course for a ddplab class; written by `python -m ddplab classroom`."""',
        "from ddplab.course.exercises import configure",
        "",
        "c = get_config()  # noqa: F821",
        "configure(c)  # ddplab's stub, header cell and raises-exception on graders",
        f"c.CourseDirectory.course_id = {COURSE_ID!r}",
        f"c.CourseDirectory.root = {str(course)!r}",
        f"c.Exchange.root = {str(exchange)!r}",
        "# A grader waits up to 40 s on a hung rank before it says so: above nbgrader's 30 s.",
        f"c.Execute.timeout = {CELL_TIMEOUT_S}",
        "# nbgrader autogrades one notebook at a time: one lab's ranks (3-4 processes) at once.",
        "# Feedback and Formgrader pages leave out a submission's scripts: a learner's HTML output or",
        "# markdown would otherwise run in your browser, logged in to the hub.",
        "c.HTMLExporter.sanitize_html = True",
        *guarded,
        "",
    ])


# What a learner's JupyterLab leaves out (page_config.json's disabledExtensions): nbgrader's
# instructor tools, and JupyterLab's news pop-up (it asks to fetch news from the internet).
LEARNER_HIDDEN = ["@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:course-list",
                  "@jupyter/nbgrader:create-assignment", "@jupyterlab/apputils-extension:announcements"]


LEARNER_SERVER_OFF = ["nbgrader.server_extensions.formgrader", "nbgrader.server_extensions.course_list"]


def write_learner_config(config: pathlib.Path, exchange: pathlib.Path) -> None:
    """learner-config/: read by every learner's server (JUPYTER_CONFIG_PATH), written by root."""
    (config / "nbgrader_config.py").write_text(learner_config(exchange))
    (config / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": dict.fromkeys(LEARNER_HIDDEN, True)}, indent=1) + "\n")
    # ... and the server parts behind them: /user/<learner>/formgrader answers 404
    (config / "jupyter_server_config.json").write_text(json.dumps(
        {"ServerApp": {"jpserver_extensions": dict.fromkeys(LEARNER_SERVER_OFF, False)}}, indent=1) + "\n")
    for path in [config, config / "labconfig"]:
        path.chmod(0o755)


def learner_config(exchange: pathlib.Path) -> str:
    return "\n".join([
        '"""nbgrader for a learner\'s server (JUPYTER_CONFIG_PATH points here)."""',
        "import os",
        "",
        "c = get_config()  # noqa: F821",
        f"c.CourseDirectory.course_id = {COURSE_ID!r}",
        f"c.Exchange.root = {str(exchange)!r}",
        "# The student id is the hub's user name. With learners as their own accounts it is also",
        "# the OS user name, which nbgrader takes by default; in the one-account mode",
        "# (--trusted-class) every server has the same OS user, and nbgrader reads",
        "# JUPYTERHUB_USER only for 'jovyan'. There they would also share one submit cache, and",
        "# fetch_feedback returns the feedback of every submission in it: one cache per learner.",
        "if os.environ.get('JUPYTERHUB_USER'):",
        "    from jupyter_core.paths import jupyter_data_dir",
        "",
        "    c.CourseDirectory.student_id = os.environ['JUPYTERHUB_USER']",
        "    c.Exchange.cache = os.path.join(jupyter_data_dir(), 'nbgrader_cache',",
        "                                    os.environ['JUPYTERHUB_USER'])",
        "",
    ])


def write_private(path: pathlib.Path, text: str) -> None:
    """A new file only its owner can read: created 0600, never an existing file overwritten."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def delete(args, parser) -> int:
    """--delete-accounts: asks (or takes --yes), saves the learners' homes, deletes, disowns."""
    from ddplab.course import teardown

    folder = pathlib.Path(args.folder)
    names = teardown.recorded(folder)
    if not names:
        print(f"no accounts recorded for {folder} (accounts.txt): nothing deleted")
        safety.remove_rules(folder)
        return 0
    question = (f"delete {len(names)} account(s) and their homes ({' '.join(names)})? Each learner's "
                f"home is first copied to {folder / 'course' / 'saved-homes'}")
    if not args.yes:
        if not sys.stdin.isatty():
            parser.error(f"--delete-accounts would {question}: add --yes to confirm")
        if input(f"{question[0].upper()}{question[1:]}. [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    done = teardown.end_class(folder)
    if done["saved"]:
        print(f"saved the homes of {len(done['learners'])} learner(s) to {done['saved']} ({done['owner']}'s)")
        for line in done["skipped"]:
            print(f"  not saved: {line}")
    print(f"deleted {len(done['deleted'])} account(s) and their homes: {' '.join(done['deleted'])}")
    print(f"{done['disowned']} file(s) still owned by a deleted account given to {done['owner']} (the class "
          "folder, the exchange, /tmp, /var/tmp, /dev/shm): a later account with the same uid owns none")
    return 0


def unlock(args, parser) -> int:
    """--unlock: a request the running hub reads at its next log-in attempt (logins.request_unlock)."""
    try:
        names = logins_module.request_unlock(pathlib.Path(args.folder).resolve(), args.unlock)
    except ValueError as e:
        parser.error(str(e))
    print(f"asked the hub to forget the failed log-ins of {' '.join(names)}: it does so at the next log-in "
          "attempt (a hub that is not running starts with none counted anyway)")
    return 0


def run(args, parser) -> int:
    if args.plan:
        return plan(args)
    if not args.folder:
        parser.error("the class's FOLDER is needed (only --plan goes without one)")
    if args.delete_accounts:
        return delete(args, parser)
    if args.unlock:
        return unlock(args, parser)
    if args.passwords_file and os.path.lexists(args.passwords_file):
        parser.error(f"{args.passwords_file} exists: --passwords-file writes a new file only")
    try:
        folder, passwords = write(args)
    except (ValueError, accounts.AccountError) as e:
        parser.error(str(e))
    hub = f"{sys.executable} -m jupyterhub -f jupyterhub_config.py"
    print(f"wrote {folder}: read {folder / 'README.md'}")
    if args.passwords_file:
        write_private(pathlib.Path(args.passwords_file), "".join(f"{k} {v}\n" for k, v in passwords.items()))
        print(f"the passwords are also in {args.passwords_file} (0600): hand them out, then delete it")
    if args.trusted_class:
        print("\nUNSAFE one-account class (--trusted-class): every learner can read the solutions,\n"
              "the gradebook and each other's work. The passwords below are shown once:\n"
              "the learners share the first, the instructor logs in with the second.\n\n"
              f"  cd {folder} && " + " ".join(f"{k}={v}" for k, v in passwords.items()) + f" \\\n    {hub}")
        return 0
    print("\nPasswords, shown this once (the system keeps only their hashes; as root,\n"
          "`passwd NAME` sets a new one):\n")
    width = max(map(len, passwords))
    for name, password in passwords.items():
        print(f"  {name:<{width}}  {password}")
    outside = safety.git_outside()
    if outside:
        print(f"\nWARNING: the ddplab checkout's git data ({outside}) lies outside it and stays readable "
              "by every account, with the solutions in its history: chmod o-rwx it, or install ddplab "
              "from a plain clone", file=sys.stderr)
    if args.spawner == "local":
        print("\nWhat this machine enforces per learner (ddplab/course/limits.py):")
        for line in limits.describe(args.mem_gib, args.threads):
            print(f"  - {line}")
    print(f"\nStart the hub as root (it checks passwords and starts each server as its learner):\n"
          f"  cd {folder} && {hub}")
    return 0
