"""Showing what the ranks print: whole lines, prefixed by rank, in the calling cell.

Teaches: N processes writing at once produce interleaved fragments. The
ranks' pipes deliver bytes in arbitrary chunks, so each (rank, stream) keeps
its unfinished line until the newline arrives, and every complete line is
shown as ``[rank r] ...`` on the kernel's stdout or stderr (which Jupyter
puts under the running cell; stderr is shown in red).

A line rewritten with carriage returns (a progress bar) is shown as one line
per rank that changes in place (progress.py).

Leaves out: per-rank log files, timestamps (torchrun's ``--tee`` and
``--log-dir`` do those).
"""
from __future__ import annotations

import queue
import sys

from .progress import LiveLines, visible


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
