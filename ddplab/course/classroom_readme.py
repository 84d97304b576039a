"""The instructor's README that ``python -m ddplab classroom`` writes beside the hub's config.

Teaches the order of a class day in commands (start the hub, release, collect,
autograde, feedback) with this folder's own paths filled in. docs/classroom.md
has the long version (accounts, TLS, systemd, sizing). Leaves out everything
that is not a command to run.
"""
from __future__ import annotations

import sys


def readme(folder, names, gpus_per_learner, args) -> str:
    py = sys.executable
    seats = (f"{gpus_per_learner} GPU(s) each while free GPU sets last (GPUs another process uses "
             "are skipped); learners after that run on CPU and are told so when their first "
             "Cluster starts" if gpus_per_learner else "CPU only (gloo)")
    if args.spawner == "systemd":
        mem = "enforced (systemd units)"
    elif args.spawner == "slurm":
        mem = "enforced by Slurm (--mem of each server's job)"
    elif args.trusted_class:
        mem = "NOT enforced: one account runs every server, and the local-process spawner ignores mem_limit"
    else:  # each learner's server joins cgroups of its own where they can be written (limits.py)
        from ddplab.course import limits

        mem = ("enforced for all of a learner's processes together (cgroup v1 memory)"
               if "memory" in limits.writable() else
               "NOT per learner: no cgroup is writable here, only address space per process (RLIMIT_AS)")
    scheme = "https" if args.ssl_cert else "http"
    bin_dir = py.rsplit('/', 1)[0]
    if args.trusted_class:
        who = ("UNSAFE one-account class (--trusted-class): every learner's server runs as the hub's "
               "user, so every learner can read the solutions, the gradebook and each other's work.")
        start = (f"    DDPLAB_HUB_PASSWORD=... DDPLAB_HUB_ADMIN_PASSWORD=... {py} -m jupyterhub -f "
                 "jupyterhub_config.py\n    # the two passwords `classroom` printed (8 characters or more)")
        as_instructor = ""
    else:
        who = ("Each learner is a Unix account of their own (home 0700); course/ (solutions, gradebook) "
               f"belongs to {args.instructor} alone (0700). Passwords were printed once by `classroom`; "
               "as root, `passwd NAME` sets a new one.")
        start = f"    sudo {py} -m jupyterhub -f jupyterhub_config.py   # as root: PAM and setuid need it"
        as_instructor = f"runuser -u {args.instructor} -- "
    return f"""# A ddplab class: {len(names)} learner(s)

Written by `python -m ddplab classroom`. docs/classroom.md in ddplab explains every choice.

- {who}
- Learners: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}; instructor (hub admin): {args.instructor}.
- Seats: {seats}; {args.threads} CPU(s) per learner (affinity); memory {args.mem_gib} GiB {mem}.
- Hub: {scheme}://{args.ip}:{args.port}/ (proxy), hub API and proxy API on 127.0.0.1 only.
- Idle servers stop after {args.idle_timeout} s (jupyterhub-idle-culler): their ranks and seat go too.
{full_line(names, args)}
- If the hub is killed, its proxy, culler, servers, kernels and ranks stop with it; start it again.
- Wrong passwords are limited per name and address ("too many failed log-ins ... try again in N s");
  as root, `{py} -m ddplab classroom {folder} --unlock NAME` clears a name in the running hub.

## Start and stop

    cd {folder}
{start}
    # Ctrl-C stops the hub and every server

## The exercises with nbgrader

As the instructor: in your JupyterLab (log in as {args.instructor}), Nbgrader > Formgrader, or a
terminal there; from a root shell, put `{as_instructor or ''}` in front of each command.

    cd {folder}/course
    export PATH={bin_dir}:$PATH         # nbgrader's gradebook runs `alembic`
    nbgrader db student import roster.csv            # the learners, in the gradebook
    nbgrader generate_assignment 00-first-process-group   # once per lab you hand out
    nbgrader release_assignment 00-first-process-group
    # learners: Nbgrader > Assignment List in JupyterLab: Fetch, then Submit
    nbgrader collect 00-first-process-group          # into submitted/<learner>/<lab>/
    nbgrader autograde 00-first-process-group        # one notebook at a time, on live ranks
    nbgrader generate_feedback 00-first-process-group
    nbgrader release_feedback 00-first-process-group
    # learners: Nbgrader > Assignment List, Fetch Feedback
    nbgrader export                                  # grades.csv

A learner's score for a lab is the number of its graders that pass; a failing grader's
feedback shows the CheckFailed message that names the mistake (e.g. "no division by world
size").

## After the class

    sudo {py} -m ddplab classroom {folder} --delete-accounts   # asks, saves homes to course/saved-homes/, deletes
"""


def full_line(names: list[str], args) -> str:
    """What the class's size means for this roster (ddplab/course/capacity.py)."""
    size = getattr(args, "max_servers", None)
    if not size:
        return "- No limit on servers at once (Slurm's partition limits decide)."
    short = (f" {len(names) + 1} accounts (the roster and you) are more than that: the last to log in read "
             "\"The class is full\" until someone logs out.") if len(names) + 1 > size else ""
    return (f"- At most {size} servers at once (yours counts), so that the learners' memory limits fit in this "
            f"machine: `python -m ddplab classroom --plan` says why.{short}")
