"""Progress bars from the ranks: one line per rank, rewritten in place.

Teaches: a progress bar such as tqdm is a line that never ends. It writes
``"\\r 40%|####  | 20/50"`` to stderr again and again, each carriage return
moving the cursor back to the start of the line, and only ``"\\n"`` when it
closes. A terminal shows one line changing; a notebook that printed each
piece would show thousands, and two ranks writing into one line would make
a mess of both. So the kernel keeps, for each rank and stream, the text
after the last carriage return and shows it as one display per rank that it
updates in place (Jupyter's ``display_id``); when the line ends, the display
shows the final text and stays. Outside Jupyter only the final text is
printed.

Leaves out: cursor movement other than ``\\r`` (tqdm's ``position=`` for
nested bars moves up lines with ANSI codes; each rank shows its last line).

References: tqdm (how it writes: ``\\r`` + bar, ``\\n`` at close); Jupyter
messaging's display_data / update_display_data with ``transient.display_id``.
"""
from __future__ import annotations

import time

MIN_INTERVAL_S = 0.1  # a rank's line is redrawn at most this often (its final text always)


def visible(text: str) -> str:
    """What a terminal shows of a line holding carriage returns: the last
    non-empty piece (tqdm pads each redraw, so it covers the one before)."""
    if "\r" not in text:
        return text
    pieces = [p for p in text.split("\r") if p]
    return pieces[-1] if pieces else ""


def _shell_with_kernel():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return shell if shell is not None and getattr(shell, "kernel", None) is not None else None


class LiveLines:
    """The open in-place lines of the current job, by (rank, stream)."""

    def __init__(self):
        self.handles: dict = {}  # (rank, stream) -> [DisplayHandle or None, last text, last draw time]

    def is_open(self, key) -> bool:
        return key in self.handles

    def update(self, key, line: str) -> None:
        """Show ``line`` as this key's live line (created on first use)."""
        entry = self.handles.get(key)
        now = time.monotonic()
        if entry is None:
            handle = None
            if _shell_with_kernel() is not None:
                from IPython.display import display

                handle = display({"text/plain": line}, raw=True, display_id=True)
            self.handles[key] = [handle, line, now]
            return
        entry[1] = line
        if entry[0] is not None and now - entry[2] >= MIN_INTERVAL_S:
            entry[0].update({"text/plain": line}, raw=True)
            entry[2] = now

    def finish(self, key, line: str, out) -> None:
        """The line ended: show its final text, in place in Jupyter, else on ``out``."""
        handle = self.handles.pop(key, [None])[0]
        if handle is not None:
            handle.update({"text/plain": line}, raw=True)
        else:
            out.write(line + "\n")
            out.flush()

    def finish_all(self, out_for) -> None:
        """End every open line with its last text (the job is over)."""
        for key in list(self.handles):
            self.finish(key, self.handles[key][1], out_for(key[1]))
