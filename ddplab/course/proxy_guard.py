"""Whatever the hub starts, tied to its life: ``python -m ddplab.course.proxy_guard [--parent PID] COMMAND...``.

Teaches: JupyterHub starts configurable-http-proxy as a child in a session of its own, so that
the proxy keeps routing while the hub restarts. A hub stopped cleanly stops its proxy; a hub
that is SIGKILLed (out of memory, ``kill -9``, a crashed container init) cannot, and the proxy
lives on, holding the class's port, so the next hub cannot start. This guard asks the kernel to
send the proxy SIGTERM when the process that started it dies (``prctl(PR_SET_PDEATHSIG)``,
which survives the exec below), then becomes the proxy. The classroom's hub config puts it in
front of the proxy command, and in front of the idle culler's and every learner's server's
command too: a SIGKILLed hub would leave those running as well. For a learner's server the
spawner switches to the learner's account before this runs, which matters: a change of user
clears the setting, so it must be made after the switch (credentials(7)). A server's SIGTERM
shuts its kernels down, and ddplab's ranks die with their kernel.

Two gaps it closes besides:

- the hub may die while the guard is still starting (Python takes a few tenths of a second to
  get here): the guard is then already an orphan, and a setting made now would watch its new
  parent (init), not the hub. So the hub's config writes the hub's pid into the command
  (``--parent PID``): a guard whose parent is no longer that pid, and that pid gone, starts
  nothing. (A parent that is alive but another, such as systemd starting the command for
  systemdspawner, is not the hub: nothing to tie to, and the command runs as it would without
  the guard.)
- a process started in the background by a shell inherits SIGINT ignored, and the exec keeps
  that; the idle culler would then ignore the SIGINT a stopping hub sends it, and the hub waits
  30 s (JupyterHub's ``interrupt_timeout``) before it sends SIGTERM. The guard sets SIGINT and
  SIGTERM back to their defaults before the exec.

Leaves out: systems without prctl (macOS): there the guard only execs the proxy, and a killed
hub's proxy must be stopped by hand (its pid is in the hub's log).
References: prctl(2) (PR_SET_PDEATHSIG); signal(7) (dispositions across execve); JupyterHub's
ConfigurableHTTPProxy (``should_start``) and LocalProcessSpawner (``interrupt_timeout``).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
USAGE = "usage: python -m ddplab.course.proxy_guard [--parent PID] COMMAND [ARGS...]"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a learner's guard asking about the root hub: it exists
        return True
    return True


def tie_to_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Ask for ``sig`` when ``parent`` (default: the present parent) dies.

    False where prctl is missing (not Linux) or the parent is not ``parent`` but someone alive;
    ends this process at once when ``parent`` has already died.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = parent or os.getppid()
    if os.getppid() != parent:
        if not alive(parent):
            sys.exit(f"proxy_guard: the process that started this one (pid {parent}) has ended: "
                     "not starting its command")
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    # The parent may have died before prctl took effect: then we were re-parented already.
    if os.getppid() != parent:
        sys.exit(f"proxy_guard: the process that started this one (pid {parent}) has ended")
    return True


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parent = None
    if argv[:1] == ["--parent"]:
        if len(argv) < 2 or not argv[1].isdigit():
            print(f"{USAGE}\n--parent takes the pid of the process that starts this one", file=sys.stderr)
            return 2
        parent, argv = int(argv[1]), argv[2:]
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):  # ignored ones would be ignored after the exec too
        signal.signal(sig, signal.SIG_DFL)
    tie_to_parent(parent=parent)
    os.execvp(argv[0], argv)  # becomes the proxy; returns only on failure (raises OSError)
    return 127


if __name__ == "__main__":
    sys.exit(main())
