"""Errors a Cluster raises, and how a rank's traceback is shown in the kernel.

Teaches: in data-parallel code one rank's failure is everybody's problem. A
rank that raises before a collective leaves its peers blocked inside that
collective until the group's timeout (torch's default: 30 minutes on gloo,
10 on NCCL). The
Cluster turns that into one error, raised within seconds, that names the
rank(s), the original exception, the rank's traceback with the notebook
cell's own source lines, and what the other ranks were doing.

Leaves out, compared with torch: torchrun's elastic agent and its error
files (``torch.distributed.elastic.multiprocessing.errors.record``).
"""
from __future__ import annotations

import linecache

from ddplab.cluster import diagnosis


class ClusterError(RuntimeError):
    """The cluster itself could not do what was asked (start, closed, ...)."""


def format_traceback(info: dict) -> str:
    """Rebuild a rank's traceback; source lines come from the kernel's linecache.

    A function defined in a notebook cell has a file name that exists only in
    the kernel (ipykernel keeps cell sources in ``linecache``), so the rank
    cannot show the line; the kernel can.
    """
    # A rank that died (a signal, os._exit) has no Python traceback: say what happened only.
    lines = ["Traceback (most recent call last):"] if info["frames"] else []
    for filename, lineno, name, line in info["frames"]:
        lines.append(f'  File "{filename}", line {lineno}, in {name}')
        source = line or linecache.getline(filename, lineno).strip()
        if source:
            lines.append(f"    {source}")
    lines.append(f"{info['type']}: {info['message']}" if info["message"] else info["type"])
    return "\n".join(lines)


class RankError(RuntimeError):
    """One or more ranks raised. ``.failures`` maps rank -> error details,
    ``.exceptions`` maps rank -> the original exception when it could be
    pickled back, ``.status`` maps every rank -> what it was doing."""

    def __init__(self, failures: dict, status: dict, note: str = "", stacks: dict | None = None,
                 head: str | None = None):
        self.failures = failures
        self.status = status
        self.stacks = stacks or {}
        self.exceptions = {r: f.get("exception_obj") for r, f in failures.items()}
        if head is None:
            head = diagnosis.headline(failures)  # the root cause first, then knock-on errors
        parts = [head]
        for r in diagnosis.root_cause_order(failures):
            parts.append(f"\n--- rank {r} ---\n" + format_traceback(failures[r]))
        parts.append("\n--- every rank ---")
        parts += [f"rank {r}: {s}" for r, s in sorted(status.items())]
        for r, text in sorted(self.stacks.items()):
            parts.append(f"\n--- where rank {r} was (Python stacks) ---\n{text.rstrip()}")
        if note:
            parts.append("\n" + note)
        super().__init__("\n".join(parts))

    @property
    def ranks(self) -> list[int]:
        return sorted(self.failures)


class CollectiveTimeout(RankError, TimeoutError):
    """A collective stalled longer than the cluster's ``timeout`` (a rank
    skipped it, or called a different one). The group is unusable after
    this, so the ranks are replaced."""


class JobTimeout(RankError, TimeoutError):
    """A job ran longer than its ``job_timeout``; the ranks are replaced."""


class RankDied(RankError):
    """A rank process exited in the middle of a job (killed, crashed, aborted)."""
