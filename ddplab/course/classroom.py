"""``python -m ddplab classroom``: a class on one server, from a few options, into one folder.

Teaches how the Jupyter ecosystem's own parts fit a ddplab workshop:
JupyterHub (with configurable-http-proxy, an authenticator, a spawner and
jupyterhub-idle-culler) gives each learner a JupyterLab with a seat (GPUs and
CPUs, :mod:`ddplab.course.seats`); nbgrader hands out the labs as
assignments, collects them and autogrades them on live ranks.

The folder it writes::

    jupyterhub_config.py       the hub (hubconfig.py says what each line is for)
    course/nbgrader_config.py  the instructor's nbgrader course: ddplab's stub and
                               preprocessors, a per-cell timeout above the graders' 40 s
    course/source/<lab>/<lab>.ipynb   every graded lab, one assignment each
    course/roster.csv          the learners, for `nbgrader db student import`
    learner-config/nbgrader_config.py the learners' side: exchange, course, student id
    exchange/                  nbgrader's exchange folder (release, collect)
    homes/<learner>/           each learner's folder (local-process spawner)
    README.md                  the instructor's steps

Leaves out: creating system accounts (PAM needs them; a one-day workshop uses
the dummy or first-use authenticator instead) and TLS (docs/classroom.md).
References: JupyterHub and nbgrader documentation; docs/classroom.md.
"""
from __future__ import annotations

import argparse
import csv
import pathlib
import re
import shutil
import sys

from ddplab.course import hubconfig

COURSE_ID = "ddplab"
NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
# Above the 40 s a grader may wait on a hung rank; nbgrader's default is 30 s per cell.
CELL_TIMEOUT_S = 120


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", help="where to write the set-up (created; must be empty or absent)")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--learners", type=int, help="this many learners, named learner01, learner02, ...")
    who.add_argument("--roster", help="a file with one learner name per line")
    p.add_argument("--instructor", default="instructor", help="the hub admin's name")
    p.add_argument("--gpus-per-learner", type=int, default=None,
                   help="GPUs in each learner's set (default 2 when nvidia-smi shows GPUs, else 0)")
    p.add_argument("--cpu-only", action="store_true", help="no GPUs for anyone (gloo on CPU)")
    p.add_argument("--threads", type=int, default=2, help="CPUs per learner (affinity) [2]")
    p.add_argument("--mem-gib", type=float, default=3.0,
                   help="memory per learner, enforced by the systemd spawner only [3]")
    p.add_argument("--spawner", choices=hubconfig.SPAWNERS, default="local")
    p.add_argument("--auth", choices=sorted(hubconfig.AUTHENTICATORS), default="dummy")
    p.add_argument("--ip", default="127.0.0.1",
                   help="where the proxy listens for browsers [127.0.0.1; put TLS in front before 0.0.0.0]")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--proxy", default=None,
                   help="configurable-http-proxy (default: proxy/node_modules/.bin in the ddplab "
                        "checkout, after `npm ci --prefix proxy`, else on PATH)")
    p.add_argument("--idle-timeout", type=int, default=1800,
                   help="seconds before an idle learner's server is stopped [1800]")


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


def gpus_per_learner(args) -> int:
    if args.cpu_only:
        return 0
    if args.gpus_per_learner is not None:
        if args.gpus_per_learner < 0:
            raise ValueError("--gpus-per-learner must be 0 or more")
        return args.gpus_per_learner
    from ddplab.cluster.gpus import discover

    return 2 if discover() else 0


def graded_labs() -> list[pathlib.Path]:
    """Every lab that has an exercise version (labs/exercises/, nbgrader's release of it)."""
    labs = pathlib.Path(__file__).resolve().parents[2] / "labs"
    return [p for p in sorted(labs.glob("[0-9][0-9]-*.ipynb")) if (labs / "exercises" / p.name).exists()]


def write(args) -> pathlib.Path:
    folder = pathlib.Path(args.folder).resolve()
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"{folder} is not empty: choose a new folder")
    names, proxy, per = learners(args), find_proxy(args.proxy), gpus_per_learner(args)
    if args.threads < 1:
        raise ValueError("--threads must be at least 1")
    course, exchange = folder / "course", folder / "exchange"
    for sol in graded_labs():
        (course / "source" / sol.stem).mkdir(parents=True)
        shutil.copyfile(sol, course / "source" / sol.stem / sol.name)
    for d in [exchange, folder / "learner-config"] + [folder / "homes" / n for n in names]:
        d.mkdir(parents=True, exist_ok=True)
    exchange.chmod(0o1777)  # nbgrader's exchange: every learner may submit (sticky, like /tmp)
    with open(course / "roster.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id"])
        w.writerows([n] for n in names)
    (course / "nbgrader_config.py").write_text(course_config(course, exchange))
    (folder / "learner-config" / "nbgrader_config.py").write_text(learner_config(exchange))
    (folder / "jupyterhub_config.py").write_text(hubconfig.render(
        folder=str(folder), users=names + [args.instructor], admin=args.instructor,
        gpus_per_learner=per, threads=args.threads, mem_gib=args.mem_gib, spawner=args.spawner,
        auth=args.auth, ip=args.ip, port=args.port, proxy_cmd=proxy, idle_timeout=args.idle_timeout))
    from ddplab.course.classroom_readme import readme

    (folder / "README.md").write_text(readme(folder, names, per, args))
    return folder


def course_config(course: pathlib.Path, exchange: pathlib.Path) -> str:
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
        "",
    ])


def learner_config(exchange: pathlib.Path) -> str:
    return "\n".join([
        '"""nbgrader for a learner\'s server (JUPYTER_CONFIG_PATH points here)."""',
        "import os",
        "",
        "c = get_config()  # noqa: F821",
        f"c.CourseDirectory.course_id = {COURSE_ID!r}",
        f"c.Exchange.root = {str(exchange)!r}",
        "# Every learner's server runs under one uid with the local-process spawner; nbgrader",
        "# would take the OS user name for all of them (it reads JUPYTERHUB_USER only for",
        "# 'jovyan'), so the student id is the hub's user name.",
        "# Their submit cache is shared for the same reason, and fetch_feedback returns the",
        "# feedback of every submission in the cache: one cache per learner.",
        "if os.environ.get('JUPYTERHUB_USER'):",
        "    from jupyter_core.paths import jupyter_data_dir",
        "",
        "    c.CourseDirectory.student_id = os.environ['JUPYTERHUB_USER']",
        "    c.Exchange.cache = os.path.join(jupyter_data_dir(), 'nbgrader_cache',",
        "                                    os.environ['JUPYTERHUB_USER'])",
        "",
    ])


def run(args, parser) -> int:
    try:
        folder = write(args)
    except ValueError as e:
        parser.error(str(e))
    print(f"wrote {folder}: read {folder / 'README.md'}, then\n"
          f"  cd {folder} && {sys.executable} -m jupyterhub -f jupyterhub_config.py")
    return 0
