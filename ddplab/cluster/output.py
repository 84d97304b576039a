"""Showing what the ranks print: whole lines, prefixed by rank, in the calling cell.

Teaches: N processes writing at once produce interleaved fragments. The
ranks' pipes deliver bytes in arbitrary chunks, so each (rank, stream) keeps
its unfinished line until the newline arrives, and every complete line is
shown as ``[rank r] ...`` on the kernel's stdout or stderr (which Jupyter
puts under the running cell; stderr is shown in red).

Leaves out: per-rank log files, timestamps (torchrun's ``--tee`` and
``--log-dir`` do those).
"""
from __future__ import annotations

import queue
import sys


class RankOutput:
    """Drains the queue the pump thread fills; prints complete lines by rank."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()  # (rank, "stdout" | "stderr", bytes)
        self.partial: dict = {}
        self.shown_ranks = None  # None: every rank; else a set (``%%ddp --ranks``)

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
                    self.emit(rank, stream, rest + "\n")
            self.partial.clear()

    def add(self, rank: int, stream: str, data: bytes) -> None:
        text = self.partial.pop((rank, stream), "") + data.decode(errors="replace")
        *lines, rest = text.split("\n")
        if rest:
            self.partial[(rank, stream)] = rest
        if lines:
            self.emit(rank, stream, "".join(f"{line}\n" for line in lines))

    def emit(self, rank: int, stream: str, text: str) -> None:
        if self.shown_ranks is not None and rank not in self.shown_ranks:
            return
        out = sys.stderr if stream == "stderr" else sys.stdout
        prefix = f"[rank {rank}] "
        out.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
        out.flush()
