"""Where the ranks meet: a FileStore in a directory only this user can enter.

Teaches: before ranks can all-reduce they must find each other, through a
key-value *store* (``torch.distributed.Store``). torchrun and most tutorials
use a TCPStore: one process listens on a port and the others connect. On a
server that several learners share that is a problem: torch's TCPStore
server listens on every interface (IPv4 and IPv6) whatever host name it is
given, with no authentication, so any local user (or anyone who can reach
the machine) can read every key, fill the server's memory, or rewrite the
keys the next generation of ranks will read.

So the kernel hosts no listener at all. Each Cluster makes a directory with
``tempfile.mkdtemp`` (mode 0700: nobody else may list it or open anything
inside), and each generation of ranks meets on a ``torch.distributed.FileStore``
at a fresh path inside it: a store left behind by ranks that did not destroy
their group would hang the next init, and a fresh name per generation cannot
be guessed or pre-written by another user anyway. The directory also holds
each rank's stack-dump file (faulthandler writes there on SIGUSR1, so a rank
that floods its stdout cannot bury its own stacks). It is deleted at shutdown;
the directory of a kernel that died without one (SIGKILL, a lost power
socket) names its kernel's pid, and the next Cluster of this user removes it
once that process is gone.

What is still exposed: once the group exists, gloo's own transport listens
on the loopback interface (127.0.0.1, ports the OS picks) and connects the
ranks over TCP; another local user can open connections to those ports (gloo
does not authenticate them, and keeps stray connections open), though not
read the ranks' traffic. Multi-node training under torchrun is different
again: its c10d rendezvous is a TCPStore on the master node that every node
must reach, so keep it on a private network.

Leaves out: authentication of gloo's connections (torch offers none).

References: torch.distributed.FileStore; tempfile.mkdtemp; mkdtemp(3).
"""
from __future__ import annotations

import os
import shutil
import tempfile

OWNER = "kernel.pid"  # inside each directory: the process that made it


class PrivateRendezvous:
    """One mode-0700 directory per Cluster; one store file per generation of ranks."""

    def __init__(self):
        remove_leftovers()
        self.dir = tempfile.mkdtemp(prefix="ddplab-")  # 0700, a name nobody can predict
        with open(os.path.join(self.dir, OWNER), "w") as f:
            f.write(str(os.getpid()))

    def store_path(self, generation: int) -> str:
        return os.path.join(self.dir, f"gen{generation}.store")

    def stacks_path(self, generation: int, rank: int) -> str:
        return os.path.join(self.dir, f"gen{generation}-rank{rank}.stacks")

    def forget(self, generation: int, world_size: int) -> None:
        """Delete one generation's files once its ranks are gone."""
        for path in [self.store_path(generation)] + [self.stacks_path(generation, r)
                                                     for r in range(world_size)]:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def remove_leftovers(root: str | None = None) -> list[str]:
    """Delete this user's rendezvous directories whose kernel process is gone."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith("ddplab-")]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, OWNER)) as f:
                pid = int(f.read())
        except (OSError, ValueError):  # not a rendezvous directory, or not ours
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has that pid now: leave the folder
        return True
    return True
