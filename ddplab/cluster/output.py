"""Showing what the ranks print: whole lines, prefixed by rank, in the calling cell.

Teaches: N processes writing at once produce interleaved fragments. The
ranks' pipes deliver bytes in arbitrary chunks, so each (rank, stream) keeps
its unfinished line until the newline arrives, and every complete line is
shown as ``[rank r] ...`` on the kernel's stdout or stderr (which Jupyter
puts under the running cell; stderr is shown in red).

A job may print without end (a loop with a stray ``print``); the cell then
shows a bounded share of each rank's output per job: the first
``HEAD_BYTES`` as they arrive, the last ``TAIL_BYTES`` when the job ends, and
a line saying how much was dropped in between (a job that is stopped, by
``job_timeout`` or Interrupt, may add up to one more head of output that
arrived while its ranks were being stopped). The bound is applied where
the pipes are read, so the kernel's memory and the time it spends printing
stay bounded too, and it keeps looking at the clock (``job_timeout``) and
for Interrupt however fast a rank writes.

A line rewritten with carriage returns (a progress bar) is shown as one line
per rank that changes in place (progress.py).

Leaves out: per-rank log files, timestamps (torchrun's ``--tee`` and
``--log-dir`` do those).
"""
from __future__ import annotations

import collections
import queue
import sys

from ddplab.cluster.progress import LiveLines, visible

HEAD_BYTES = 512 * 1024  # per rank per job, shown as it arrives
TAIL_BYTES = 512 * 1024  # per rank per job, shown when the job ends


class OutputBudget:
    """Per rank: pass the first HEAD_BYTES of a job's output, keep only the
    last TAIL_BYTES of the rest, and count what falls in between."""

    def __init__(self, world_size: int, head: int | None = None, tail: int | None = None):
        self.world_size = world_size
        self.head = HEAD_BYTES if head is None else head
        self.tail_cap = TAIL_BYTES if tail is None else tail
        self.reset()

    def reset(self) -> dict:
        """Start a new job; return the last job's overflow: {rank: (dropped, tail)}."""
        old = {r: (self.dropped[r], list(self.tail[r])) for r in range(self.world_size)
               if self.dropped[r] or self.tail[r]} if hasattr(self, "tail") else {}
        self.passed = [0] * self.world_size
        self.dropped = [0] * self.world_size
        self.tail = [collections.deque() for _ in range(self.world_size)]  # (stream, bytes)
        self.tail_size = [0] * self.world_size
        return old

    def take(self, rank: int, stream: str, data: bytes) -> bytes:
        """Return the part of ``data`` to show now; keep or drop the rest."""
        room = self.head - self.passed[rank]
        shown, rest = (data[:room], data[room:]) if room > 0 else (b"", data)
        self.passed[rank] += len(shown)
        if rest:
            tail = self.tail[rank]
            tail.append((stream, rest))
            self.tail_size[rank] += len(rest)
            while self.tail_size[rank] > self.tail_cap:
                old_stream, chunk = tail.popleft()
                cut = min(len(chunk), self.tail_size[rank] - self.tail_cap)
                self.dropped[rank] += cut
                self.tail_size[rank] -= cut
                if cut < len(chunk):
                    tail.appendleft((old_stream, chunk[cut:]))
        return shown


class RankOutput:
    """Drains the queue the pump thread fills; prints complete lines by rank."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()  # (rank, "stdout" | "stderr", bytes)
        self.partial: dict = {}
        self.shown_ranks = None  # None: every rank; else a set (``%%ddp --ranks``)
        self.live = LiveLines()

    def show(self, final: bool = False) -> None:
        """Print everything queued so far; ``final`` also flushes unfinished lines."""
        while True:
            try:
                rank, stream, data = self.queue.get_nowait()
            except queue.Empty:
                break
            self.add(rank, stream, data)
        if final:
            for (rank, stream), rest in list(self.partial.items()):
                if rest:
                    self.add(rank, stream, b"\n")
            self.partial.clear()
            self.live.finish_all(lambda stream: sys.stderr if stream == "stderr" else sys.stdout)

    def show_overflow(self, overflow: dict) -> None:
        """After a job: say how much each rank's output lost, then show its tail."""
        self.show(final=True)
        for rank, (dropped, tail) in sorted(overflow.items()):
            if dropped:
                # The tail starts mid-line; drop up to its first newline too.
                while tail:
                    stream, chunk = tail[0]
                    cut = chunk.find(b"\n")
                    dropped += len(chunk) if cut < 0 else cut + 1
                    tail[0] = (stream, chunk[cut + 1:])
                    if cut >= 0:
                        break
                    tail.pop(0)
                self.emit(rank, "stderr", f"... {_size(dropped)} of this job's output dropped here "
                                          f"(a cell shows the first {_size(HEAD_BYTES)} and the last "
                                          f"{_size(TAIL_BYTES)} of each rank's output) ...\n")
            for stream, chunk in tail:
                self.add(rank, stream, chunk)
        self.show(final=True)

    def add(self, rank: int, stream: str, data: bytes) -> None:
        key = (rank, stream)
        text = self.partial.pop(key, "") + data.decode(errors="replace")
        *lines, rest = text.split("\n")
        lines = [visible(line) for line in lines]
        if lines and self.live.is_open(key):  # a progress line ends: its final text, in place
            out = sys.stderr if stream == "stderr" else sys.stdout
            self.live.finish(key, f"[rank {rank}] {lines.pop(0)}", out)
        if "\r" in rest:
            rest = visible(rest)
            if self.shown_ranks is None or rank in self.shown_ranks:
                self.live.update(key, f"[rank {rank}] {rest}")
        if rest:
            self.partial[key] = rest
        if lines:
            self.emit(rank, stream, "".join(f"{line}\n" for line in lines))

    def emit(self, rank: int, stream: str, text: str) -> None:
        if self.shown_ranks is not None and rank not in self.shown_ranks:
            return
        out = sys.stderr if stream == "stderr" else sys.stdout
        prefix = f"[rank {rank}] "
        out.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
        out.flush()


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
