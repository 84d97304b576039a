"""How many learners one server holds, and what the next learner reads when it is full.

Teaches the arithmetic behind ``python -m ddplab classroom --plan`` and the hub's server limit.
Each learner's server, kernels and ranks run in a memory cgroup of ``--mem-gib``
(:mod:`ddplab.course.limits`): past it the kernel's OOM killer ends a process of that learner
only. That promise holds only while the limits of every running server add up to no more than
the machine's memory: beyond it the machine runs out before any learner reaches their own limit,
and the kernel's global OOM killer picks the biggest process on the machine, which may be
another learner's kernel or rank. So a class holds at most::

    floor((MemTotal - headroom) / mem_gib)      servers at once

with ``headroom`` for the system, the hub, the proxy and the instructor's server (whose own
server counts as one of the class's). The hub is told this number as JupyterHub's
``active_server_limit``: the next learner to start a server gets JupyterHub's 429 page,
which the class's ``templates/error.html`` completes with "The class is full" and the
instructor's options, instead of a server that takes memory from the others.

Starting a server is CPU work (jupyter_server, JupyterLab and nbgrader import for seconds of
CPU each): ten at once on 2 busy cores all missed the hub's 120 s ``http_timeout`` together, and
the class had no server at all (measured: docs/classroom.md). So the hub starts as many at once
as the machine has CPUs, at least 2 (``concurrent_spawn_limit``); a learner beyond that gets
JupyterHub's 429 "Too many users trying to log in right now. Try again in 40 seconds." and tries
again, as the class's error page explains. (The wait is drawn from JupyterHub's
``spawn_throttle_retry_range``, 30 to 60 s, about one server's start here; in JupyterHub 6.1.1 that
trait is not configurable: it lacks ``config=True``.)

What a learner uses is measured, not guessed: ``make load-test`` (tools/class_load.py) logs N
learners in at once through the proxy, starts their servers, runs lab 00's first cell in each
on 2 gloo ranks and records each learner's cgroup peak and the times. :data:`MEASURED` keeps the
figures measured on the machine named in it; ``--plan`` shows them next to the live machine's
memory and cores. CPUs do not set the class's size (with the two CPU settings here, every
learner's ranks run, only slower): the measured first-cell times say how much slower.

CPU time has a trap of its own in cgroup v1: a group competes with each process beside it as ONE
entity of weight ``cpu.shares`` (1024, a plain process's weight). A class's learners all sit in
``ddplab/<class>/``, so under load from 20 processes outside it the whole class got the CPU of
one of them, about a tenth of a core here: servers missed the hub's timeout and lab 00's ranks
did not start (measured: docs/classroom.md). :func:`weigh_class` gives the class's groups the
weight of as many processes as the class has servers; each learner's quota (``--threads``) still
caps what one learner takes.

Leaves out: GPUs (seats say who gets one: :mod:`ddplab.course.seats`), disk, swap (a machine
that swaps is slow for everyone, and the limits here do not count it).
References: JupyterHub's ``active_server_limit`` and ``concurrent_spawn_limit``
(jupyterhub/app.py, handlers/base.py ``spawn_single_user``); the kernel's cgroup-v1
memory.txt (limits, OOM per group) and the scheduler's sched-design-CFS ("group scheduler
extensions": cpu.shares); proc(5) for /proc/meminfo.
"""
from __future__ import annotations

import math
import os
import pathlib
import sys
from dataclasses import dataclass

from ddplab.course import limits

# The system, the hub, the proxy, the idle culler and the instructor's unlimited server.
HEADROOM_GIB = 3.0

# Measured by `make load-test N="10 20 30"` (tools/class_load.py) on the machine named here;
# one row per N: servers started, refused ("the class is full"), failures, medians and 95th
# percentiles in seconds, each learner's cgroup memory peak (MiB, median and largest) and the
# machine's 1-minute load average when the run started (other jobs share this machine).
MEASURED: dict = {
    "machine": "a 2-core, 24 GiB machine without GPU, shared with other jobs (load 8-23 on its own)",
    "date": "2026-11-28", "mem_gib": 3.0, "threads": 1, "runs": [
        {"n": 10, "started": 6, "refused": 4, "failures": 0, "peak_mib_median": 721, "peak_mib_max": 724,
         "load": 20.9, "login_median": 11.7, "login_p95": 13.2, "spawn_median": 66.7, "spawn_p95": 105.2,
         "first_cell_median": 18.6, "first_cell_p95": 26.9},
        {"n": 20, "started": 6, "refused": 14, "failures": 0, "peak_mib_median": 722, "peak_mib_max": 722,
         "load": 23.0, "login_median": 9.3, "login_p95": 12.2, "spawn_median": 60.7, "spawn_p95": 99.0,
         "first_cell_median": 22.3, "first_cell_p95": 27.4},
        {"n": 30, "started": 6, "refused": 24, "failures": 0, "peak_mib_median": 721, "peak_mib_max": 723,
         "load": 15.3, "login_median": 23.2, "login_p95": 29.8, "spawn_median": 74.7, "spawn_p95": 120.2,
         "first_cell_median": 32.0, "first_cell_p95": 39.3},
        # at the --mem-gib that --plan suggests from the rows above: a class of 16
        {"n": 20, "mem_gib": 1.25, "started": 16, "refused": 4, "failures": 0, "peak_mib_median": 722,
         "peak_mib_max": 723, "load": 7.7, "login_median": 12.2, "login_p95": 16.7, "spawn_median": 116.6,
         "spawn_p95": 205.2, "first_cell_median": 12.3, "first_cell_p95": 25.6},
    ]}


@dataclass(frozen=True)
class Machine:
    total_gib: float      # MemTotal
    available_gib: float  # MemAvailable: what other jobs leave now
    cpus: int             # the CPUs this process may use


def machine(meminfo: str = "/proc/meminfo") -> Machine:
    """The live machine's memory and CPUs."""
    fields = {}
    with open(meminfo) as f:
        for line in f:
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024  # kB
    return Machine(fields["MemTotal"] / 2**30, fields.get("MemAvailable", fields["MemFree"]) / 2**30,
                   len(os.sched_getaffinity(0)))


def server_limit(mem_gib: float, total_gib: float, headroom_gib: float = HEADROOM_GIB) -> int:
    """Servers whose memory limits together fit in ``total_gib`` less ``headroom_gib``."""
    if mem_gib <= 0:
        raise ValueError(f"--mem-gib must be more than 0, got {mem_gib}")
    fits = math.floor((total_gib - headroom_gib) / mem_gib + 1e-9)
    if fits < 1:
        raise ValueError(f"this machine's {total_gib:.1f} GiB, less {headroom_gib:g} GiB for the system and the "
                         f"hub, hold no learner at --mem-gib {mem_gib:g}: give a smaller --mem-gib")
    return fits


SHARES = 1024          # cgroup v1's cpu.shares of a group, and a plain process's weight
SHARES_MAX = 262144    # the kernel's largest cpu.shares


def weigh_class(cls: str, servers: int, base: pathlib.Path = limits.BASE) -> list[pathlib.Path]:
    """The class's cpu groups (ddplab/ and ddplab/<cls>/) weighed as ``servers`` processes, never
    less than they are (ddplab/ may hold other classes); returns the files written."""
    wanted = min(SHARES_MAX, SHARES * max(1, servers))
    written = []
    for level in (base / "cpu" / "ddplab", base / "cpu" / "ddplab" / cls):
        shares = level / "cpu.shares"
        if shares.exists() and int(shares.read_text()) < wanted:
            shares.write_text(str(wanted))
            written.append(shares)
    return written


def spawn_limit(cpus: int) -> int:
    """Servers the hub starts at one moment: one per CPU, at least 2."""
    return max(2, cpus)


# measured on the machine of MEASURED: a learner who ran all of lab 00 in a class at 1.5 GiB had
# ranks killed for memory, and grading an untouched submission there lost its kernel
WHOLE_LAB_KILLED_AT_GIB = 1.5
WHOLE_LAB_GIB = 3.0  # classroom's default --mem-gib, under which lab 00 ran whole in the hub tests


def mem_gib_for(peak_mib: float, margin: float = 1.5) -> float:
    """A --mem-gib above a measured peak: ``margin`` times it, rounded up to a quarter GiB."""
    return math.ceil(peak_mib * margin / 1024 * 4) / 4


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation between the sorted values."""
    if not values:
        return None
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def plan(mem_gib: float, threads: int, live: Machine, measured: dict = MEASURED,
         headroom_gib: float = HEADROOM_GIB) -> dict:
    """What ``classroom --plan`` says: the class's size here, and the measured times near it."""
    limit = server_limit(mem_gib, live.total_gib, headroom_gib)
    runs = sorted(measured.get("runs", []), key=lambda r: r["n"])
    peaks = [r["peak_mib_max"] for r in runs if r.get("peak_mib_max")]
    nearest = max((r for r in runs if r["started"] <= limit and not r["failures"]),
                  key=lambda r: r["started"], default=None)
    suggested = mem_gib_for(max(peaks)) if peaks else None
    return {
        "limit": limit, "mem_gib": mem_gib, "threads": threads, "headroom_gib": headroom_gib,
        "total_gib": live.total_gib, "available_gib": live.available_gib, "cpus": live.cpus,
        # what the class's limits add up to, against what other jobs leave free now
        "short_now_gib": max(0.0, limit * mem_gib - (live.available_gib - headroom_gib)),
        "cpus_per_learner": live.cpus / limit,
        "measured": measured, "nearest": nearest, "suggested_mem_gib": suggested,
        "limit_at_suggested": server_limit(suggested, live.total_gib, headroom_gib) if suggested else None,
    }


def describe(p: dict) -> list[str]:
    """``plan``'s answer in lines, for the instructor."""
    lines = [
        f"this machine: {p['total_gib']:.1f} GiB of memory ({p['available_gib']:.1f} GiB free now), "
        f"{p['cpus']} CPU(s)",
        f"each learner's memory limit: {p['mem_gib']:g} GiB (--mem-gib), {p['threads']} CPU(s) (--threads)",
        f"the class holds {p['limit']} servers at once: ({p['total_gib']:.1f} - {p['headroom_gib']:g} GiB "
        f"headroom) / {p['mem_gib']:g} GiB; the next learner reads \"the class is full\" "
        "(JupyterHub's active_server_limit; the instructor's own server counts as one)",
    ]
    if p["short_now_gib"] > 0:
        lines.append(f"WARNING: other jobs use memory now: {p['short_now_gib']:.1f} GiB short of what a full "
                     "class's limits add up to; a learner who reaches their limit may then get another's "
                     "process killed: stop those jobs, or give --max-learners fewer")
    if p["cpus_per_learner"] < 1:
        lines.append(f"CPUs: {p['cpus_per_learner']:.2f} per learner when the class is full: every "
                     "learner's cells run, more slowly (the measured times below)")
    m = p["measured"]
    if not m.get("runs"):
        lines.append("no measured figures stored: run `make load-test N=\"10 20 30\"` on this machine")
        return lines
    lines.append(f"measured on {m['machine']} ({m['date']}, --threads {m['threads']}; lab 00's first cell "
                 "on 2 gloo ranks per learner; GiB each: --mem-gib):")
    lines.append("    N  GiB each  served  full  failed  log-in s  start s  first cell s  peak MiB/learner  load")
    for r in m["runs"]:
        lines.append(f"  {r['n']:3d}  {r.get('mem_gib', m['mem_gib']):8g}  {r['started']:6d}  {r['refused']:4d}  "
                     f"{r['failures']:6d}  "
                     f"{_pair(r, 'login')}  {_pair(r, 'spawn')}  {_pair(r, 'first_cell', 12)}  "
                     f"{r['peak_mib_median']:7.0f} / {r['peak_mib_max']:<6.0f}  {r['load']:4.1f}")
    if p["nearest"]:
        r = p["nearest"]
        lines.append(f"at {r['started']} learners there, lab 00's first cell took {r['first_cell_median']:.0f} s "
                     f"(median; 95th percentile {r['first_cell_p95']:.0f} s)"
                     + (f"; {p['limit']} at once were not measured" if r["started"] < p["limit"] else ""))
    peak = max(r['peak_mib_max'] for r in m['runs'])
    lines.append(f"lab 00's first cell peaked at {peak:.0f} MiB per learner there, but a whole lab takes more: "
                 f"all of lab 00 (3 ranks, then two torchrun nodes of 2 ranks each) was killed for memory at "
                 f"--mem-gib {WHOLE_LAB_KILLED_AT_GIB:g}, in a learner's server and in its grading. Keep --mem-gib "
                 f"at {WHOLE_LAB_GIB:g} or more unless you measured the labs you teach (make load-test times the "
                 "first cell only)")
    return lines


def _pair(r: dict, key: str, width: int = 8) -> str:
    text = f"{r[key + '_median']:.0f}/{r[key + '_p95']:.0f}" if r.get(key + "_median") is not None else "-"
    return f"{text:>{width}}"


def full_page(limit: int, mem_gib: float, spawns: int = 2, set_by_instructor: bool = False) -> str:
    """The class's templates/error.html: JupyterHub's own error page, and when a 429 says the
    active-server limit was reached, what that means in this class and what the instructor can do;
    when it says too many servers are starting, that the learner only has to wait."""
    return "\n".join([
        '{% extends "templates/error.html" %}',
        "{% block error_detail %}",
        "{{ super() }}",
        "{% if status_code == 429 and 'Active user limit' in (message or '') %}",
        f"<p class=\"ddplab-class-full\"><strong>The class is full</strong>: {limit} servers are running, "
        + (f"as many as the instructor set (<code>--max-learners {limit}</code>)" if set_by_instructor else
           f"as many as this machine holds with {mem_gib:g} GiB of memory for each learner")
        + ". Nobody's work was stopped to "
        "make room. Try again when someone logs out (File &gt; Log Out), or ask the instructor: they can stop "
        "idle servers on the hub's admin page, or start the class with <code>--max-learners</code> or a "
        "smaller <code>--mem-gib</code> (<code>python -m ddplab classroom --plan</code> says what this "
        "machine holds).</p>",
        "{% elif status_code == 429 and 'Too many users' in (message or '') %}",
        f"<p class=\"ddplab-class-starting\">This machine starts {spawns} learners' servers at a time, and "
        f"{spawns} are starting now. Your place is kept: nothing is lost by waiting. Go back and log in "
        "(or reload this page) after the time above.</p>",
        "{% endif %}",
        "{% endblock error_detail %}",
        "",
    ])


def class_size(spawner: str, mem_gib: float, max_learners: int | None) -> int | None:
    """The servers a class may run at once on this machine: what its memory holds at ``mem_gib``
    each, or ``max_learners`` (warned about when above that); None on Slurm, whose scheduler
    queues the servers."""
    if spawner == "slurm":
        if max_learners is not None:
            raise ValueError("--max-learners is for a class on this machine: with --spawner slurm, "
                             "Slurm's partition limits say how many servers run at once")
        return None
    fits = server_limit(mem_gib, machine().total_gib)
    if max_learners is None:
        return fits
    if max_learners < 1:
        raise ValueError(f"--max-learners must be at least 1, got {max_learners}")
    if max_learners > fits:
        print(f"WARNING: --max-learners {max_learners} is more than this machine's memory holds at "
              f"--mem-gib {mem_gib:g} ({fits}): when the learners' use adds up past it, the kernel may "
              "kill one learner's kernel for another's memory (python -m ddplab classroom --plan)",
              file=sys.stderr)
    return max_learners
