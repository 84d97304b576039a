"""One long-lived thread that starts and stops every rank, so ranks outlive the thread that asked.

Teaches: two Linux facts a launcher inside a notebook kernel must respect.
- ``PR_SET_PDEATHSIG`` (how a rank dies with the kernel, even when the kernel
  is SIGKILLed) fires when the *thread* that started the rank exits, not the
  process. A Cluster made from a widget callback's thread, or ranks replaced
  by a ``run()`` from a short-lived thread, would die with that thread. So
  every ``Popen`` of a rank happens on one daemon thread that lives as long
  as the kernel process.
- Jupyter's Interrupt is a ``KeyboardInterrupt`` raised in the kernel's main
  thread at whatever line it is running, possibly half-way through starting
  or stopping ranks. Starting and stopping therefore run on that same
  thread, which never sees KeyboardInterrupt: an interrupted caller stops
  *waiting*, the operation still finishes, and the next call finds the
  cluster in a known state (see ``Task.wait``).

Tests reach the races through ``interruption_point(name)``: the Cluster calls it at named
moments inside start, run and replacement, and a test hook can deliver SIGINT
exactly there, so each race happens on every run instead of by chance.

Leaves out, compared with torch.distributed.elastic: restart policies and
health checks; here a caller asks, and this thread does it.

References: prctl(2) PR_SET_PDEATHSIG; Python's signal module (handlers run
in the main thread only); concurrent.futures (the same idea, but its
workers refuse new work once interpreter shutdown begins, when ``atexit``
still has ranks to stop).
"""
from __future__ import annotations

import os
import queue
import threading

_test_hook = None  # tests set a callable(name); see interruption_point()


def interruption_point(name: str) -> None:
    """A named moment inside start, run or replacement (for tests; no-op otherwise)."""
    hook = _test_hook
    if hook is not None:
        hook(name)


class Task:
    """One start/stop operation handed to the spawner thread."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self.error = exc
        finally:
            self.done.set()

    def wait(self):
        """Wait for the operation; return its result or raise its error.

        A KeyboardInterrupt while waiting leaves the operation running to its
        end on the spawner thread; the caller's next call waits for it then."""
        while not self.done.wait(0.1):  # short waits: the main thread stays interruptible
            pass
        if self.error is not None:
            raise self.error
        return self.result


class _Spawner:
    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> Task:
        """Queue ``fn(*args)``; operations run one at a time, in the order submitted."""
        task = Task(fn, args)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, daemon=True, name="ddplab-ranks")
                self._thread.start()
            self._queue.put(task)
        return task

    def _loop(self) -> None:
        while True:
            self._queue.get().run()


spawner = _Spawner()

# The kernel's end of the lifeline: every rank gets the read end. No other
# process holds the write end (it is close-on-exec, and ranks are started with
# close_fds), so the read end sees EOF exactly when the kernel process is gone,
# however it died; each rank's reaper then kills the rank's whole process group.
_lifeline: tuple[int, int] | None = None
_lifeline_lock = threading.Lock()


def lifeline_fd() -> int:
    """The read end of the kernel's lifeline pipe (created once per process)."""
    global _lifeline
    with _lifeline_lock:
        if _lifeline is None or _lifeline[1] != os.getpid():  # a forked copy needs its own
            r, w = os.pipe()
            _lifeline = (r, os.getpid())
            _lifeline_write_ends.append(w)
        return _lifeline[0]


_lifeline_write_ends: list[int] = []  # kept open for the life of the process, on purpose
