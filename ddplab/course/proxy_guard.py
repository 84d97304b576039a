"""Whatever the hub starts, tied to the hub's life: ``python -m ddplab.course.proxy_guard COMMAND ARGS...``.

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

Leaves out: systems without prctl (macOS): there the guard only execs the proxy, and a killed
hub's proxy must be stopped by hand (its pid is in the hub's log).
References: prctl(2) (PR_SET_PDEATHSIG); JupyterHub's ConfigurableHTTPProxy (``should_start``).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def tie_to_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask for ``sig`` when the parent dies; False where prctl is missing (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    parent = os.getppid()
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    # The parent may have died before prctl took effect: then we were re-parented already.
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m ddplab.course.proxy_guard PROXY [ARGS...]", file=sys.stderr)
        return 2
    tie_to_parent()
    os.execvp(argv[0], argv)  # becomes the proxy; returns only on failure (raises OSError)
    return 127


if __name__ == "__main__":
    sys.exit(main())
